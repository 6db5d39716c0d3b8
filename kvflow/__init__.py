"""kvflow: a readable LLM inference engine built around a vLLM V1-style scheduler."""
# Importing kvflow sets no environment: entry points call envs.set_process_defaults() instead.
from kvflow.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "LLMEngine", "EngineArgs", "RequestOutput", "CompletionOutput",
           "SamplingParams", "StructuredOutputsParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy, so that `import kvflow.core` (pure Python) never pulls in torch.
    if name in __all__:
        from kvflow import engine
        return getattr(engine, name)
    raise AttributeError(f"module 'kvflow' has no attribute {name!r}")
