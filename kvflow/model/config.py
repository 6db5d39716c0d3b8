"""A model's shape, read from an HF config.json dict (GGUF metadata is converted to one first).

Torch-free: the simulator reads its model shapes through hf_shape() too, so both read a
config.json the same way."""
from __future__ import annotations

from dataclasses import dataclass, field

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",      # same graph as Llama without sliding windows
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


def hf_shape(d: dict, default_dtype: str = "float32") -> dict:
    """The dense transformer shape of an HF config.json dict, whatever the architecture."""
    heads = d["num_attention_heads"]
    dtype = d.get("torch_dtype") or d.get("dtype") or default_dtype
    return dict(
        hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
        num_layers=d["num_hidden_layers"], num_heads=heads,
        num_kv_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or d["hidden_size"] // heads, vocab_size=d["vocab_size"],
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        torch_dtype=str(dtype).replace("torch.", ""))


@dataclass(slots=True)
class ModelConfig:
    architecture: str                   # "llama" | "qwen2" | "qwen3"
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_hf(cls, d: dict) -> "ModelConfig":
        archs = d.get("architectures") or []
        arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"unsupported architecture {archs!r}; kvflow runs "
                             f"{sorted(ARCHITECTURES)}")
        if d.get("sliding_window") and d.get("use_sliding_window", arch == "llama"):
            raise ValueError("sliding-window attention is not supported")
        # transformers >= 5 nests rope settings in "rope_parameters"; older files have
        # rope_theta / rope_scaling at the top level.
        rope = dict(d.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", None) or d.get("rope_theta", 10000.0)
        scaling = d.get("rope_scaling") or (rope if rope else None)
        if scaling is not None:
            scaling = dict(scaling)
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            scaling["rope_type"] = kind
            if kind == "default":
                scaling = None
        eos = d.get("eos_token_id")
        return cls(
            architecture=arch,
            **hf_shape(d),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            attention_bias=arch == "qwen2" or bool(d.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
        )

    @property
    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        return self.num_layers * layer + v * h * (1 if self.tie_word_embeddings else 2) + h

    def kv_bytes_per_token(self, dtype_size: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_size
