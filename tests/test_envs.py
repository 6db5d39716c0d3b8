"""kvflow/envs.py: every KVFLOW_* switch declared once, read through the table, documented in
docs/envs.md; and no environment set on import, only by the entry points and for children."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvflow import envs

ROOT = Path(__file__).parent.parent
# KVFLOW_* names that are not environment variables: a quantized format's name (quant.py).
NOT_SWITCHES = {"KVFLOW_I8_PC"}


def _names_in(paths) -> dict[str, str]:
    found = {}
    for p in paths:
        for name in re.findall(r"\bKVFLOW_[A-Z0-9_]+\b", p.read_text()):
            found.setdefault(name, str(p.relative_to(ROOT)))
    return found


def test_every_kvflow_name_in_the_code_and_docs_is_declared():
    """Code, comments and docs name only declared switches (a typo or a new ad-hoc switch fails)."""
    files = [p for p in (ROOT / "kvflow").rglob("*.py") if p.name != "envs.py"]
    files += [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    undeclared = {n: f for n, f in _names_in(files).items()
                  if n not in envs.SWITCHES and n not in NOT_SWITCHES}
    assert not undeclared, f"declare these in kvflow/envs.py: {undeclared}"


def test_every_declared_switch_is_read_somewhere():
    used = _names_in(p for p in (ROOT / "kvflow").rglob("*.py") if p.name != "envs.py")
    assert set(envs.SWITCHES) <= set(used), set(envs.SWITCHES) - set(used)


def test_no_module_reads_a_kvflow_variable_from_os_environ():
    """Reads go through the table: os.environ/os.getenv only with non-KVFLOW names (or to
    remove or pass one on, as the CLI and the replicas do)."""
    pattern = re.compile(r"(?:environ(?:\.get)?|getenv)\(\s*[\"']KVFLOW_|environ\[[\"']KVFLOW_")
    bad = [str(p.relative_to(ROOT)) for p in (ROOT / "kvflow").rglob("*.py")
           if p.name != "envs.py" and pattern.search(p.read_text())]
    assert not bad


def test_the_docs_table_is_the_declared_table():
    docs = (ROOT / "docs" / "envs.md").read_text()
    assert envs.markdown_table() in docs, \
        "docs/envs.md is out of date: paste `python -m kvflow.envs`'s output into it"
    assert "docs/envs.md" in (ROOT / "README.md").read_text()


def test_defaults_parsing_and_bad_values(monkeypatch):
    for name in envs.SWITCHES:
        monkeypatch.delenv(name, raising=False)
    assert envs.KVFLOW_CPU_KERNELS is True and envs.KVFLOW_TP_SOCKETS is False
    assert envs.KVFLOW_TP_TIMEOUT == 300.0 and envs.KVFLOW_CACHE_DIR is None
    monkeypatch.setenv("KVFLOW_CPU_KERNELS", "0")
    assert envs.KVFLOW_CPU_KERNELS is False and envs.get("KVFLOW_CPU_KERNELS") is False
    monkeypatch.setenv("KVFLOW_CPU_KERNELS", " ")           # blank: the default
    assert envs.KVFLOW_CPU_KERNELS is True
    monkeypatch.setenv("KVFLOW_CPU_QUANT_ISA", " Scalar ")
    assert envs.KVFLOW_CPU_QUANT_ISA == "scalar"
    monkeypatch.setenv("KVFLOW_EXIT_WITH_PARENT", "123")
    assert envs.KVFLOW_EXIT_WITH_PARENT == 123
    for name, bad in [("KVFLOW_CPU_KERNELS", "yes"), ("KVFLOW_CPU_QUANT_ISA", "sse9"),
                      ("KVFLOW_CPU_BF16W_ISA", "avx9"), ("KVFLOW_TP_TIMEOUT", "soon"),
                      ("KVFLOW_TP_TIMEOUT", "0"), ("KVFLOW_EXIT_WITH_PARENT", "pid")]:
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=f"{name}='{bad}'"):
            envs.get(name)
    with pytest.raises(AttributeError):
        envs.KVFLOW_NOT_A_SWITCH  # noqa: B018


def test_importing_kvflow_sets_no_environment():
    code = ("import os; before = dict(os.environ)\n"
            "import kvflow, kvflow.engine, kvflow.envs, kvflow.cli, kvflow.engine.core_client\n"
            "from kvflow import SamplingParams\n"
            "assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items())\n")
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def _unset_gomp(monkeypatch):
    # setenv first, so that monkeypatch restores the variable's absence afterwards too.
    monkeypatch.setenv("GOMP_SPINCOUNT", "x")
    monkeypatch.delenv("GOMP_SPINCOUNT")


def test_set_process_defaults_keeps_the_users_value():
    assert envs.set_process_defaults({})["GOMP_SPINCOUNT"] == "10000"
    assert envs.set_process_defaults({"GOMP_SPINCOUNT": "7"})["GOMP_SPINCOUNT"] == "7"


def test_the_cli_sets_gomp_spincount_first(monkeypatch):
    from kvflow.cli import main
    _unset_gomp(monkeypatch)
    with pytest.raises(SystemExit):
        main(["--help"])        # exits while parsing: the default was set before
    assert os.environ["GOMP_SPINCOUNT"] == "10000"


def test_spawned_processes_get_gomp_spincount(monkeypatch):
    from kvflow.engine import core_client, tp_executor
    from kvflow.engine.arg_utils import EngineArgs
    from kvflow.server import replicas
    _unset_gomp(monkeypatch)
    assert core_client._core_env()["GOMP_SPINCOUNT"] == "10000"

    envs_seen = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, env=None, **k: envs_seen.append(env))
    replicas._spawn([], 8001, None)
    tp_executor._spawn_worker(EngineArgs(), 1, 2, "127.0.0.1", 29500)
    assert [e["GOMP_SPINCOUNT"] for e in envs_seen] == ["10000", "10000"]
    assert "GOMP_SPINCOUNT" not in os.environ       # set for the children only

    monkeypatch.setenv("GOMP_SPINCOUNT", "7")       # the user's value wins
    assert core_client._core_env()["GOMP_SPINCOUNT"] == "7"
