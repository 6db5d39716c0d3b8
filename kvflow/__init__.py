"""kvflow: a readable LLM inference engine built around a vLLM V1-style scheduler."""
import os

# A short OpenMP spin: on shared cores a descheduled spinning thread stalls every small op
# (BENCHMARKS.md, "Design choices measured"). Set before torch loads libgomp; the user's wins.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from kvflow.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402

__all__ = ["LLM", "LLMEngine", "EngineArgs", "RequestOutput", "CompletionOutput",
           "SamplingParams", "StructuredOutputsParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy, so that `import kvflow.core` (pure Python) never pulls in torch.
    if name in __all__:
        from kvflow import engine
        return getattr(engine, name)
    raise AttributeError(f"module 'kvflow' has no attribute {name!r}")
