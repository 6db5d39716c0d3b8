"""Llama, in one readable file. Qwen2 and Qwen3 reuse it with their two differences switched on.

The forward pass takes the step's flattened tokens [T] (every request's query tokens back to
back, no padding) and returns hidden states only for the rows that sample (logits_indices), so a
prefill chunk never pays for the LM head on tokens nobody samples.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kvflow import envs
from kvflow.model.attention.backend import AttentionBackend, AttentionMetadata
from kvflow.model.config import ModelConfig
from kvflow.model.kernels.cpu_ops import ops
from kvflow.model.models.layers import MLP, RMSNorm, RotaryEmbedding, linear, use_skinny
from kvflow.model.distributed.parallel import TPGroup, local_config
from kvflow.model.quantization.quant_weights import QuantTensor, attach, embed

# KVFLOW_LM_HEAD_WX=0: the LM head is always x @ W.T (the plain path, neither W @ x.T nor
# skinny_linear). A module constant: _logits runs every step.
_LM_HEAD_WX = envs.KVFLOW_LM_HEAD_WX
_LM_HEAD_SKINNY_ROWS = 16


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        # Qwen3: RMSNorm over each head's vector of q and k, before RoPE.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, cos_sin, x, residual, backend: AttentionBackend, kv_cache,
                meta: AttentionMetadata) -> torch.Tensor:
        """Returns residual + attention(x): the o_proj and the residual add are one addmm."""
        t = x.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = linear(x, self.qkv_proj).view(t, h + 2 * kvh, d)
        qk = qkv[:, :h + kvh]
        if self.q_norm is not None:
            qkv[:, :h] = self.q_norm(qkv[:, :h])
            qkv[:, h:h + kvh] = self.k_norm(qkv[:, h:h + kvh])
        RotaryEmbedding.apply_(cos_sin, qk)     # q and k heads, in place in qkv
        kv = qkv[:, h:].view(t, 2, kvh, d)      # new keys and values, side by side
        o = backend.forward(qkv[:, :h], kv, kv_cache, meta, self.scale)
        if self.tp is None:
            return linear(o.reshape(t, self.q_size), self.o_proj, residual)
        return self.tp.reduce_linear(o.reshape(t, self.q_size), self.o_proj, residual)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, tp)

    def forward(self, cos_sin, h, backend, kv_cache, meta):
        # .forward, not __call__: no hooks are used, and nn.Module's call machinery costs ~1 us
        # a call, 150 calls a decode step.
        h = self.self_attn.forward(cos_sin, self.input_layernorm.forward(h), h, backend,
                                   kv_cache, meta)
        return self.mlp.forward(self.post_attention_layernorm.forward(h), h)


class LlamaForCausalLM(nn.Module):
    # HF checkpoint names that load into a slice of one of our fused parameters.
    stacked_params = (("q_proj", "qkv_proj", 0), ("k_proj", "qkv_proj", 1),
                      ("v_proj", "qkv_proj", 2), ("gate_proj", "gate_up_proj", 0),
                      ("up_proj", "gate_up_proj", 1))

    def __init__(self, cfg: ModelConfig, max_model_len: int, tp: TPGroup | None = None) -> None:
        """cfg: the whole model's shape. With tp (tensor parallelism, parallel.py) this rank
        builds its shard: self.cfg is the shard's shape, self.full_cfg the model's."""
        super().__init__()
        self.tp, self.full_cfg = tp, cfg
        if tp is not None:
            cfg = local_config(cfg, tp.world_size, tp.rank)
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(
            cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                      max_model_len)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                backend: AttentionBackend, meta: AttentionMetadata,
                logits_indices: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            h = embed(self.embed_tokens, input_ids)
        else:
            h = self.tp.embed(self.embed_tokens, input_ids, self.cfg.vocab_size)
        cos_sin = self.rotary.lookup(positions)
        fused = self.__dict__.get("fused_decode")      # set by loader.build_model
        if fused is not None and len(cos_sin) == 3 and meta.num_decodes == h.shape[0] \
                and "d_table" in meta.extra and kv_caches[0].dtype == torch.float32:
            h = ops.decode_layers(h, *cos_sin, meta.slot_mapping, meta.extra["d_table"],
                                  meta.extra["d_lens"], kv_caches, *fused)
        else:
            for layer, kv_cache in zip(self.layers, kv_caches):
                h = layer.forward(cos_sin, h, backend, kv_cache, meta)
        return self.norm(h[logits_indices])

    def lm_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, vocab_size] logits; under tensor parallelism, on rank 0 (the others get their
        own shard's, which nothing reads)."""
        if self.tp is None:
            return self._logits(hidden)
        return self.tp.gather_logits(self._logits(hidden), self.full_cfg.vocab_size)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.__dict__.get("lm_linear")     # the loader's packed or float32 head
        if head is not None:
            return linear(hidden, head)
        w = self.lm_weight()
        if _LM_HEAD_WX and use_skinny(hidden, self.__dict__.get("skinny", False),
                                      _LM_HEAD_SKINNY_ROWS, 1):
            # One pass over the vocabulary's weights for all rows; beats both torch orders even
            # for one row (BENCHMARKS.md, "Skinny GEMM").
            return ops.skinny_linear(hidden, w)
        if _LM_HEAD_WX and 1 < hidden.shape[0] <= 256 and w.dtype == torch.float32 \
                and not w.is_cuda:
            # W @ x.T, not x @ W.T: MKL's float32 GEMM with a few rows of x runs 2-3x slower
            # than the same product with the vocabulary as the long side (BENCHMARKS.md, issue 14).
            return torch.mm(w, hidden.t()).t().contiguous()
        return torch.nn.functional.linear(hidden, w)

    # ---- weights -------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantTensor]]) -> None:
        """Copy each weight into its parameter (or its shard of a fused one); a QuantTensor
        instead becomes its module's quantized weight (quant_weights.attach), parts in order."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        quant: dict[str, dict[int, QuantTensor]] = {}
        for name, w in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue        # tied: some checkpoints store the copy anyway
            name = name.removeprefix("model.")
            if self.tp is not None:     # this rank's rows or columns of the weight
                w = self.tp.shard_weight(name, w, self.full_cfg)
            for src, dst, shard in self.stacked_params:
                if f".{src}." in name:
                    name = name.replace(f".{src}.", f".{dst}.")
                    dst_view = _shard(_param(params, name), shard, self.cfg, dst)
                    _check_shape(w, dst_view, f"weight {src!r} of {name!r}")
                    _store(w, dst_view, quant.setdefault(name, {}), shard)
                    loaded.add(f"{name}#{shard}")
                    break
            else:
                p = _param(params, name)
                _check_shape(w, p, f"weight {name!r}")
                _store(w, p.data, quant.setdefault(name, {}), 0)
                loaded.add(name)
        missing = [n for n, p in params.items() if not _is_loaded(n, loaded)]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:3]}")
        for name, parts in quant.items():
            if parts:
                attach(self.get_submodule(name.removesuffix(".weight")),
                       [parts[k] for k in sorted(parts)])


def fused_decode_args(model: LlamaForCausalLM) -> tuple | None:
    """decode_layers' per-model arguments (csrc/cpu_decode.cpp: the whole stack in one call for
    a step of decodes), or None where it does not apply: it runs only the ops of a CPU float32
    model whose every linear is one quantized part, without tensor parallelism."""
    # KVFLOW_CPU_FUSED_DECODE=0: layer by layer in Python even where decode_layers applies.
    if not envs.KVFLOW_CPU_FUSED_DECODE or model.tp is not None \
            or not model.rotary.use_kernels:
        return None
    norms, linears, qk_norms = [], [], []
    for layer in model.layers:
        a, mlp = layer.self_attn, layer.mlp
        if not (layer.input_layernorm.use_kernels and mlp.use_kernels):
            return None
        norms += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        if a.q_norm is not None:
            qk_norms += [a.q_norm.weight, a.k_norm.weight]
        linears += [m.__dict__.get("quant1") for m in (a.qkv_proj, a.o_proj, mlp.gate_up_proj,
                                                       mlp.down_proj)]
    if any(q is None for q in linears) or norms[0].dtype != torch.float32:
        return None
    try:
        ops.decode_layers
    except (AttributeError, RuntimeError):      # a kernel library built before the op existed
        return None
    a = model.layers[0].self_attn
    return (norms, [q[0] for q in linears], [q[1] for q in linears], [q[2] for q in linears],
            [q[3] for q in linears], qk_norms, a.num_heads, a.num_kv_heads, model.cfg.rms_norm_eps,
            a.scale)


def _param(params: dict, name: str) -> torch.Tensor:
    p = params.get(name)
    if p is None:
        raise ValueError(f"unexpected weight {name!r} in the checkpoint")
    return p


def _check_shape(w, dst: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(w.shape):
        raise ValueError(f"{what}: checkpoint shape {tuple(w.shape)} != model shape "
                         f"{tuple(dst.shape)}")


def _store(w, dst: torch.Tensor, quant_parts: dict, shard: int) -> None:
    if isinstance(w, QuantTensor):
        quant_parts[shard] = w
    else:
        dst.copy_(w)


def _shard(p: torch.Tensor, shard: int, cfg: ModelConfig, dst: str) -> torch.Tensor:
    if dst == "qkv_proj":
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        start, size = (0, q) if shard == 0 else (q + (shard - 1) * kv, kv)
    else:
        size = cfg.intermediate_size
        start = shard * size
    return p.data.narrow(0, start, size)


def _is_loaded(name: str, loaded: set[str]) -> bool:
    if ".qkv_proj." in name:
        return all(f"{name}#{i}" in loaded for i in range(3))
    if ".gate_up_proj." in name:
        return all(f"{name}#{i}" in loaded for i in range(2))
    return name in loaded
