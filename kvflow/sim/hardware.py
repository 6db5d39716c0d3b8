"""GPU specs and model shapes: the numbers the cost model is built from, each with its source.

Datasheet numbers are peaks; what kernels really reach is the cost model's `mfu` / `mbu`
(see cost_model.py), which calibration fits to measured step times.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvflow.model.config import hf_shape

GIB = 1 << 30
MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class GPUSpec:
    name: str
    peak_flops: float       # dense bf16 tensor-core FLOP/s (no 2:4 sparsity)
    mem_bandwidth: float    # HBM bytes/s
    mem_bytes: int          # total device memory, as nvidia-smi reports it
    source: str


GPUS: dict[str, GPUSpec] = {
    # NVIDIA H100 Tensor Core GPU datasheet, SXM5 column: BF16 1,979 TFLOPS "with sparsity", so
    # 989.4 dense; HBM3 3.35 TB/s; 80 GB (nvidia-smi shows 81,559 MiB).
    "h100": GPUSpec("H100-SXM5-80GB", 989.4e12, 3.35e12, 81_559 * MIB,
                    "NVIDIA H100 datasheet (SXM5): 989.4 TFLOP/s dense BF16, 3.35 TB/s HBM3"),
    # NVIDIA H200 datasheet: the same Hopper die and tensor-core peak as H100 SXM, HBM3e 4.8 TB/s,
    # 141 GB (nvidia-smi shows 143,771 MiB).
    "h200": GPUSpec("H200-SXM-141GB", 989.4e12, 4.8e12, 143_771 * MIB,
                    "NVIDIA H200 datasheet: 989.4 TFLOP/s dense BF16, 4.8 TB/s HBM3e"),
    # NVIDIA A100 datasheet, 80GB SXM column: BF16 312 TFLOPS dense (624 with sparsity),
    # HBM2e 2,039 GB/s. The 40GB part has 1,555 GB/s.
    "a100": GPUSpec("A100-SXM4-80GB", 312e12, 2.039e12, 80 * GIB,
                    "NVIDIA A100 datasheet (80GB SXM): 312 TFLOP/s dense BF16, 2,039 GB/s HBM2e"),
    "a100-40gb": GPUSpec("A100-SXM4-40GB", 312e12, 1.555e12, 40 * GIB,
                         "NVIDIA A100 datasheet (40GB SXM): 312 TFLOP/s dense BF16, 1,555 GB/s"),
}


def get_gpu(name: str) -> GPUSpec:
    key = name.lower().replace("_", "-")
    if key not in GPUS:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}")
    return GPUS[key]


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A dense decoder-only transformer (Llama family: GQA attention, gated MLP)."""
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    max_model_len: int
    dtype_bytes: int = 2        # bf16

    @property
    def params_per_layer(self) -> int:
        h = self.hidden_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # q, k, v, o projections + gate, up, down; norms and biases are < 0.1% and left out.
        return h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size

    @property
    def layer_params(self) -> int:
        return self.num_layers * self.params_per_layer

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        embed = self.vocab_size * self.hidden_size
        return self.layer_params + embed + (0 if self.tie_word_embeddings else self.lm_head_params)

    @property
    def weight_bytes(self) -> int:
        """Bytes resident on the GPU (all parameters)."""
        return self.num_params * self.dtype_bytes

    @property
    def step_weight_bytes(self) -> int:
        """Bytes every forward pass streams from HBM: the layers and the LM head. The embedding
        table is only gathered row by row (unless tied, in which case it *is* the LM head)."""
        return (self.layer_params + self.lm_head_params) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @classmethod
    def from_hf_config(cls, cfg: dict, name: str = "custom") -> "ModelShape":
        if any(k in cfg for k in ("num_local_experts", "num_experts", "n_routed_experts")):
            raise ValueError("mixture-of-experts models are not modelled (dense shapes only)")
        s = hf_shape(cfg, default_dtype="bfloat16")     # the runner's reader, torch-free
        return cls(
            name=cfg.get("_name_or_path") or name,
            hidden_size=s["hidden_size"],
            num_layers=s["num_layers"],
            num_heads=s["num_heads"],
            num_kv_heads=s["num_kv_heads"],
            head_dim=s["head_dim"],
            intermediate_size=s["intermediate_size"],
            vocab_size=s["vocab_size"],
            tie_word_embeddings=s["tie_word_embeddings"],
            max_model_len=cfg.get("max_position_embeddings", 8192),
            dtype_bytes=4 if s["torch_dtype"] == "float32" else 2,
        )


def _shape(name, h, layers, heads, kv, inter, vocab, tied, max_len, head_dim=None) -> ModelShape:
    return ModelShape(name, h, layers, heads, kv, head_dim or h // heads, inter, vocab, tied,
                      max_len)


# Every number below is copied from the model's config.json on the Hugging Face Hub.
MODELS: dict[str, ModelShape] = {m.name.lower(): m for m in (
    # meta-llama/Meta-Llama-3-8B
    _shape("Llama-3-8B", 4096, 32, 32, 8, 14336, 128256, False, 8192),
    # meta-llama/Llama-3.1-8B (same shape, RoPE scaled to 128k)
    _shape("Llama-3.1-8B", 4096, 32, 32, 8, 14336, 128256, False, 131072),
    # meta-llama/Llama-2-7b-hf (multi-head attention: 32 KV heads)
    _shape("Llama-2-7B", 4096, 32, 32, 32, 11008, 32000, False, 4096),
    # mistralai/Mistral-7B-v0.1. Its 4096-token sliding window is not modelled: full attention.
    _shape("Mistral-7B", 4096, 32, 32, 8, 14336, 32000, False, 32768),
    # Qwen/Qwen3-0.6B (head_dim 128 is explicit, not hidden/heads)
    _shape("Qwen3-0.6B", 1024, 28, 16, 8, 3072, 151936, True, 40960, head_dim=128),
    # Qwen/Qwen3-8B
    _shape("Qwen3-8B", 4096, 36, 32, 8, 12288, 151936, False, 40960, head_dim=128),
    # Qwen/Qwen2.5-7B
    _shape("Qwen2.5-7B", 3584, 28, 28, 4, 18944, 152064, False, 32768),
    # HuggingFaceTB/SmolLM2-135M (the model kvflow's CPU engine embeds)
    _shape("SmolLM2-135M", 576, 30, 9, 3, 1536, 49152, True, 8192),
)}


def get_model(name_or_path: str) -> ModelShape:
    """A built-in shape by name (case-insensitive, an org/ prefix is ignored), or a config.json
    (or a directory holding one)."""
    p = Path(name_or_path)
    if p.is_dir():
        p = p / "config.json"
    if p.suffix == ".json" or p.is_file():
        cfg = json.loads(p.read_text())
        return ModelShape.from_hf_config(cfg, name=p.parent.name or p.stem)
    key = name_or_path.lower().rsplit("/", 1)[-1].removeprefix("meta-")
    key = {"llama-3-8b-instruct": "llama-3-8b", "mistral-7b-v0.1": "mistral-7b",
           "llama-2-7b-hf": "llama-2-7b"}.get(key, key)
    if key not in MODELS:
        raise ValueError(f"unknown model {name_or_path!r}; known: "
                         f"{', '.join(m.name for m in MODELS.values())}, or a config.json path")
    return MODELS[key]


def activation_reserve_bytes(shape: ModelShape, max_num_batched_tokens: int,
                             max_num_seqs: int) -> int:
    """Memory vLLM's profiling run would find in use besides weights and KV cache (estimate).

    vLLM measures the peak of a dummy forward pass of max_num_batched_tokens; we estimate it as
    the widest live activations (the MLP's gate+up output and a few hidden-size buffers per
    token), fp32 logits for one sampled position per sequence, and 1 GiB for the CUDA context,
    cuBLAS workspaces and CUDA graphs. It only moves num_gpu_blocks by a few percent.
    """
    per_token = (2 * shape.intermediate_size + 4 * shape.hidden_size) * shape.dtype_bytes
    logits = max_num_seqs * shape.vocab_size * 4
    return max_num_batched_tokens * per_token + logits + GIB


def num_gpu_blocks(shape: ModelShape, gpu: GPUSpec, block_size: int,
                   gpu_memory_utilization: float, max_num_batched_tokens: int,
                   max_num_seqs: int) -> int:
    """KV blocks that fit in gpu_memory_utilization of the GPU after weights and activations,
    the way vLLM sizes its cache."""
    free = (gpu.mem_bytes * gpu_memory_utilization - shape.weight_bytes
            - activation_reserve_bytes(shape, max_num_batched_tokens, max_num_seqs))
    blocks = int(free // (block_size * shape.kv_bytes_per_token))
    if blocks < 1:
        raise ValueError(f"{shape.name} does not fit on {gpu.name} at gpu_memory_utilization="
                         f"{gpu_memory_utilization}: no room left for the KV cache")
    return blocks
