"""Qwen2: the Llama graph with a bias on the q, k and v projections (config: attention_bias)."""
from __future__ import annotations

from kvflow.model.config import ModelConfig
from kvflow.model.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, max_model_len: int, tp=None) -> None:
        assert cfg.attention_bias and not cfg.qk_norm, "Qwen2 has qkv bias and no q/k norm"
        super().__init__(cfg, max_model_len, tp)
