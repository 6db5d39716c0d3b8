"""The engine: LLMEngine (step loop), LLM (offline API), tokenizer and detokenizer."""
from kvflow.engine.llm import LLM
from kvflow.engine.llm_engine import EngineArgs, LLMEngine
from kvflow.engine.outputs import CompletionOutput, RequestOutput

__all__ = ["CompletionOutput", "EngineArgs", "LLM", "LLMEngine", "RequestOutput"]
