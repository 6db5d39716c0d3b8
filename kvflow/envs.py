"""Every KVFLOW_* environment switch, declared once: its name, default, how its value is read and
what it does. kvflow reads them only through this module, at the time of use:
`envs.KVFLOW_CPU_KERNELS` (or `envs.get("KVFLOW_CPU_KERNELS")`) parses $KVFLOW_CPU_KERNELS now,
the default when it is unset or blank, and a bad value raises a ValueError naming the variable.

docs/envs.md holds this table (`python -m kvflow.envs` prints it; tests/test_envs.py checks that
the two match and that every KVFLOW_* name in kvflow/ is declared here).

Pure Python, no torch: kvflow's top level imports nothing heavier, and neither does this.
"""
from __future__ import annotations

import os
from collections.abc import Callable, MutableMapping
from typing import Any, NamedTuple


class Switch(NamedTuple):
    default: str | None     # as it would be written in the environment; None: unset
    parse: Callable[[str], Any]     # the value -> what kvflow uses; ValueError when bad
    doc: str


def _flag(value: str) -> bool:
    value = value.strip()
    if value not in ("0", "1"):
        raise ValueError("expected 0 or 1")
    return value == "1"


def _choice(*options: str) -> Callable[[str], str]:
    def parse(value: str) -> str:
        v = value.strip().lower()
        if v not in options:
            raise ValueError(f"expected one of {options}")
        return v
    return parse


def _seconds(value: str) -> float:
    s = float(value)
    if not s > 0:
        raise ValueError("expected a number of seconds > 0")
    return s


SWITCHES: dict[str, Switch] = {
    # Native CPU kernels (kvflow/model/kernels/)
    "KVFLOW_CPU_KERNELS": Switch(
        "1", _flag, "0: never build or load kvflow's native CPU kernels; the torch code paths run"),
    "KVFLOW_CPU_MARCH": Switch(
        "native", str, "the `-march` the CPU kernels are compiled for (e.g. `x86-64-v3`: AVX2 "
                       "only)"),
    "KVFLOW_CACHE_DIR": Switch(
        None, str, "where the compiled CPU kernels are cached (unset: `$XDG_CACHE_HOME/kvflow` "
                   "or `~/.cache/kvflow`)"),
    "KVFLOW_CPU_SKINNY_GEMM": Switch(
        "1", _flag, "0: float32 products of a few rows use torch's matmul, not kvflow's "
                    "`skinny_linear` kernel (read when kvflow.model.models.layers is imported)"),
    "KVFLOW_LM_HEAD_WX": Switch(
        "1", _flag, "0: the LM head is always `x @ W.T`, never `W @ x.T` or `skinny_linear` for a "
                    "few rows (read when kvflow.model.models.llama is imported)"),
    # Quantized weights (kvflow/model/quantization/, models/llama.py)
    "KVFLOW_CPU_QUANT": Switch(
        "1", _flag, "0: quantized weights (GGUF blocks, `quantization=`) are dequantized to "
                    "float32 at load instead of run as stored"),
    "KVFLOW_CPU_QUANT_ISA": Switch(
        "auto", _choice("auto", "avx2", "scalar"),
        "the quantized kernels' code path: `auto`, `avx2` or `scalar` (the portable one)"),
    "KVFLOW_CPU_FUSED_DECODE": Switch(
        "1", _flag, "0: a quantized model's decode steps run layer by layer in Python, not as one "
                    "native `decode_layers` call"),
    # bf16 weights (kvflow/model/models/layers.py, loader/model_loader.py)
    "KVFLOW_CPU_BF16_PACK": Switch(
        "1", _flag, "0: bf16 weights are never packed for oneDNN, as on a CPU that cannot "
                    "(tests reach the fallback on any CPU)"),
    "KVFLOW_CPU_BF16W": Switch(
        "1", _flag, "0: bf16 weights oneDNN cannot pack get float32 copies instead of staying "
                    "bf16 for `bf16w_linear`"),
    "KVFLOW_CPU_BF16W_ISA": Switch(
        "auto", _choice("auto", "avx2", "scalar"),
        "`bf16w_linear`'s few-row kernel: `auto`, `avx2` or `scalar` (the portable one)"),
    # Tensor parallelism (kvflow/model/distributed/parallel.py)
    "KVFLOW_TP_SOCKETS": Switch(
        "0", _flag, "1: on CPU, the small all-reduces go over direct sockets between the ranks "
                    "instead of gloo"),
    "KVFLOW_TP_TIMEOUT": Switch(
        "300", _seconds, "seconds a tensor-parallel collective waits for a slow or hung rank "
                         "before it raises"),
    # Engine, server, simulator
    "KVFLOW_ENABLE_MULTIPROCESSING": Switch(
        "1", _flag, "0: `AsyncLLM` (`kvflow serve`) steps the engine core in a thread, not in a "
                    "process of its own"),
    "KVFLOW_API_KEY": Switch(
        None, str, "the default of `--api-key` for `kvflow serve` and `kvflow router`"),
    "KVFLOW_EXIT_WITH_PARENT": Switch(
        None, int, "set by `kvflow serve --data-parallel-size` for its replicas: the router's "
                   "pid; the replica exits when that process is gone"),
    "KVFLOW_DATA_DIR": Switch(
        None, str, "where workload traces named by bare file name are found (unset: "
                   "kvflow/sim/data)"),
}


def get(name: str) -> Any:
    """$name parsed as declared, or its default when unset or blank (None: no default)."""
    switch = SWITCHES[name]     # KeyError: not declared above
    raw = os.environ.get(name, "")
    if not raw.strip():
        if switch.default is None:
            return None
        raw = switch.default
    try:
        return switch.parse(raw)
    except ValueError as e:
        raise ValueError(f"{name}={raw!r}: {e}") from None


def __getattr__(name: str) -> Any:
    # envs.<name> reads the environment now, not at import: tests and scripts set it later.
    if name in SWITCHES:
        return get(name)
    raise AttributeError(f"module 'kvflow.envs' has no attribute {name!r}")


def set_process_defaults(env: MutableMapping[str, str] | None = None) -> MutableMapping[str, str]:
    """The environment a process running kvflow's model should start with, set in env (default
    os.environ) where the user has not set it; returns env. Entry points call it before torch
    loads (libgomp reads its settings once, when loaded); spawners pass the child's env."""
    env = os.environ if env is None else env
    # A short OpenMP spin (torch's threads spin ~300k iterations by default): on shared cores a
    # descheduled spinning thread stalls every small op (BENCHMARKS.md, "Design choices measured").
    env.setdefault("GOMP_SPINCOUNT", "10000")
    return env


def markdown_table() -> str:
    """The switches as docs/envs.md's table."""
    rows = ["| Variable | Default | What it does |", "|---|---|---|"]
    for name, s in SWITCHES.items():
        default = "unset" if s.default is None else f"`{s.default}`"
        rows.append(f"| `{name}` | {default} | {s.doc} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
