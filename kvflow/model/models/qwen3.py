"""Qwen3: the Llama graph with RMSNorm on each head of q and k before RoPE (q_norm, k_norm),
no qkv bias, and a head_dim that need not be hidden_size / num_heads."""
from __future__ import annotations

from kvflow.model.config import ModelConfig
from kvflow.model.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, max_model_len: int, tp=None) -> None:
        assert cfg.qk_norm, "Qwen3 has q/k norm"
        super().__init__(cfg, max_model_len, tp)
