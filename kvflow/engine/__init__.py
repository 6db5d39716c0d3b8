"""The engine: LLMEngine (step loop), LLM (offline API), tokenizer and detokenizer."""
__all__ = ["CompletionOutput", "EngineArgs", "LLM", "LLMEngine", "RequestOutput"]

_LAZY = {"LLM": "kvflow.engine.llm", "LLMEngine": "kvflow.engine.llm_engine",
         "EngineArgs": "kvflow.engine.arg_utils", "RequestOutput": "kvflow.engine.outputs",
         "CompletionOutput": "kvflow.engine.outputs"}


def __getattr__(name: str):
    # Lazy, so that the torch-free modules here (arg_utils) load without torch.
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvflow.engine' has no attribute {name!r}")
