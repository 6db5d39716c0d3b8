"""The core is pure Python: importing it (and kvflow's top level) must not load torch."""
import subprocess
import sys


def test_core_does_not_import_torch():
    code = ("import sys, kvflow, kvflow.core; from kvflow import SamplingParams; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_engine_core_messages_do_not_import_torch():
    """Frontend and engine core share only these structs: reading them needs no torch."""
    code = ("import sys, kvflow.engine.messages; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_serving_frontend_does_not_import_torch():
    """`kvflow serve`'s own process (HTTP, tokenizer, detokenizer) leaves torch to the engine
    core's process: it starts faster and holds no second copy of torch."""
    code = ("import sys, kvflow.server.api_server, kvflow.engine.async_llm, "
            "kvflow.model.loader.checkpoint; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_lazy_top_level_names_resolve():
    import kvflow
    from kvflow.engine import LLM
    assert kvflow.LLM is LLM


def test_the_model_runner_never_imports_the_schedulers_requests():
    """The runner works from SchedulerOutput alone (its own per-request state), so the engine
    core could run in another process."""
    import ast
    from pathlib import Path
    root = Path(__file__).parent.parent / "kvflow" / "model" / "runner"
    for name in ("model_runner.py", "cuda_model_runner.py", "cuda_graphs.py"):
        tree = ast.parse((root / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                mods = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            else:
                continue
            assert not any(m.startswith("kvflow.core.request") for m in mods), (name, mods)
            assert not any(m == "kvflow.core" and a.name in ("Request", "RequestStatus")
                           for m in mods[:1] for a in getattr(node, "names", ())), name
