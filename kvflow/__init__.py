"""kvflow: a readable LLM inference engine built around a vLLM V1-style scheduler."""
import os

# torch's OpenMP threads spin ~300k iterations waiting for the next parallel region. A step is
# ~15 small ops per layer, so on a machine whose cores are shared, one descheduled thread makes
# every op wait for a time slice: measured on the 2-core dev VM with one busy process beside it,
# a decode step took 2.4 s by default and 0.33 s with a 10k spin (0.069 vs 0.070 s when quiet).
# It must be set before torch loads libgomp; a value the user set wins.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from kvflow.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "LLMEngine", "EngineArgs", "RequestOutput", "CompletionOutput",
           "SamplingParams"]
__version__ = "0.1.0"

_LAZY = {"LLM": "kvflow.engine.llm", "LLMEngine": "kvflow.engine.llm_engine",
         "EngineArgs": "kvflow.engine.arg_utils", "RequestOutput": "kvflow.engine.outputs",
         "CompletionOutput": "kvflow.engine.outputs"}


def __getattr__(name: str):
    # Lazy, so that `import kvflow.core` (pure Python) never pulls in torch.
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvflow' has no attribute {name!r}")
