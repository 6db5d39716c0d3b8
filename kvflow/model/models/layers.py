"""Layers shared by the decoder architectures. Numerics follow HF transformers (RoPE tables in
float32, cast to the model dtype at the same point) so float32 greedy outputs match token for
token; each layer is as few torch ops as possible, since on CPU every op costs a thread sync."""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from kvflow import envs
from kvflow.model.kernels.cpu_ops import ops
from kvflow.model.quantization.quant_weights import quant_linear

# Float32 CPU matmuls of SKINNY_MIN_ROWS..SKINNY_MAX_ROWS rows go through kvflow's skinny_linear
# kernel (csrc/cpu_gemm.cpp), which beats MKL there (BENCHMARKS.md); KVFLOW_CPU_SKINNY_GEMM=0
# forces torch's path. A module constant: use_skinny runs for every linear of every step.
_SKINNY_GEMM = envs.KVFLOW_CPU_SKINNY_GEMM
SKINNY_MAX_ROWS = 12


def _skinny_min_rows() -> int:
    from kvflow.model.kernels.cpu_ops import _cpu_flags
    # MKL's 2-4 row products are fast on AVX-512 CPUs (measured on a Xeon), not on AVX2 ones.
    return 5 if " avx512f" in _cpu_flags() else 2


SKINNY_MIN_ROWS = _skinny_min_rows()


def linear(x: torch.Tensor, m: nn.Linear, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T (+ bias) (+ residual), through the oneDNN-packed weight when pack_linear made one,
    through bf16w_linear for a bf16 weight mark_bf16w kept, or in float32 when upcast_linear
    widened the weight (rounded once to x's dtype)."""
    q1 = m.__dict__.get("quant1")       # one quantized part: the op, no Python in between
    if q1 is not None:
        return ops.quant_linear(x, q1[0], q1[1], q1[2], q1[3], residual)
    quant = m.__dict__.get("quant")
    if quant is not None:
        return quant_linear(x, quant, m.bias, residual)
    packed = m.__dict__.get("packed")
    if packed is not None:
        if residual is None:
            return torch.ops.mkldnn._linear_pointwise(x, packed, m.bias, "none", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, m.bias, "add")
    if m.__dict__.get("bf16w", False):     # a bf16 weight kept as is (mark_bf16w)
        return ops.bf16w_linear(x, m.weight, m.bias, residual)
    if m.weight.dtype != x.dtype:
        return _linear_upcast(x, m, residual)
    if use_skinny(x, m.__dict__.get("skinny", False), SKINNY_MAX_ROWS):
        return ops.skinny_linear(x, m.weight, m.bias, residual)
    if residual is None:
        return F.linear(x, m.weight, m.bias)
    if m.bias is not None:
        residual = residual + m.bias
    return torch.addmm(residual, x, m.weight.t())


def use_skinny(x: torch.Tensor, marked: bool, max_rows: int,
               min_rows: int = SKINNY_MIN_ROWS) -> bool:
    """Whether a product with x goes to skinny_linear: the weight is marked (a float32 CPU weight
    with the kernels built, use_cpu_kernels) and x has min_rows..max_rows float32
    rows."""
    return (marked and _SKINNY_GEMM and x.dim() == 2 and min_rows <= x.shape[0] <= max_rows
            and x.dtype == torch.float32)


def _linear_upcast(x: torch.Tensor, m: nn.Linear, residual: torch.Tensor | None) -> torch.Tensor:
    # Like oneDNN's bf16 path: exact products, float32 sums, bias and residual, one rounding.
    y = F.linear(x.float(), m.weight, m.bias)
    if residual is not None:
        y += residual
    return y.to(x.dtype)


def bf16_pack_supported() -> bool:
    """Whether bf16 Linear weights can be packed for oneDNN here: torch's own test (AVX512BW/VL/DQ
    or AVX-NE-CONVERT), confirmed by packing a tiny weight. KVFLOW_CPU_BF16_PACK=0 answers no on
    any CPU, so that tests reach the fallback wherever they run."""
    return envs.KVFLOW_CPU_BF16_PACK and _cpu_can_pack_bf16()


@functools.cache
def _cpu_can_pack_bf16() -> bool:
    try:
        if not (torch.backends.mkldnn.is_available()
                and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
            return False
        _reorder(torch.zeros(16, 16, dtype=torch.bfloat16))
        return True
    except (AttributeError, RuntimeError):     # an older/other torch build, or a stricter check
        return False


def bf16w_available() -> bool:
    """Whether bf16 weights that oneDNN cannot pack can stay bf16: kvflow's bf16w_linear kernel is
    built (cpu_ops). KVFLOW_CPU_BF16W=0 answers no, restoring the float32 weight copies (the
    benchmarks' old path)."""
    if not envs.KVFLOW_CPU_BF16W:
        return False
    from kvflow.model.kernels import cpu_ops
    return cpu_ops.available()


def prepare_linears(linears: list[nn.Linear], dtype: torch.dtype, device: str) -> str | None:
    """Get a CPU model's bf16 Linear weights ready for `linear` (dtype: the activations'): packed
    for oneDNN where the CPU supports it; else kept bf16 for kvflow's bf16w_linear, which widens
    them in registers (half the bytes of a float32 copy); else, without the kernels, widened to
    float32, since torch's unpacked bf16 matmul is several times slower there (BENCHMARKS.md).
    Returns "packed", "bf16w", "float32", or None (no bf16 weight: nothing to do)."""
    if device != "cpu" or not any(m.weight.dtype == torch.bfloat16 for m in linears):
        return None
    if dtype == torch.bfloat16 and bf16_pack_supported():
        how, prepare = "packed", pack_linear
    elif bf16w_available():
        how, prepare = "bf16w", mark_bf16w
    else:
        how, prepare = "float32", upcast_linear
    for m in linears:
        prepare(m)
    return how


def mark_bf16w(m: nn.Linear) -> None:
    """Route a bf16 weight to bf16w_linear as it is. The bias (O values) is held in float32, the
    kernel's summing type, so that no call widens it."""
    m.__dict__["bf16w"] = True
    if m.bias is not None and m.bias.dtype != torch.float32:
        m.bias = nn.Parameter(m.bias.detach().float(), requires_grad=False)


class WideningEmbedding(nn.Embedding):
    """A bf16 table whose lookups come out float32 (exact): a float32 model over bf16 weights."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim,
                         _weight=torch.empty(num_embeddings, embedding_dim, dtype=torch.bfloat16))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight).float()


def keep_bf16_weights(model: nn.Module) -> None:
    """Before loading a bf16 checkpoint into a float32 CPU model: give its Linears and embeddings
    bf16 weights, so that the checkpoint's values are held as they are (2 bytes a weight) while
    the activations stay float32; prepare_linears then routes the Linears to bf16w_linear."""
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if type(child) is nn.Embedding:
                setattr(parent, name, WideningEmbedding(child.num_embeddings, child.embedding_dim))
            elif isinstance(child, nn.Linear):
                child.weight = nn.Parameter(child.weight.new_empty(
                    child.weight.shape, dtype=torch.bfloat16), requires_grad=False)


def pack_linear(m: nn.Linear) -> None:
    """Reorder a bf16 weight once into oneDNN's blocked (AMX/AVX512) layout: a plain matmul
    re-packs it on every call (BENCHMARKS.md, "Design choices measured")."""
    m.__dict__["packed"] = _reorder(m.weight.detach())
    # The packed copy replaces the plain weight, which nothing reads any more: keeping both
    # would double the weights' memory (a 7B bf16 model would need 28 GB).
    m.weight = nn.Parameter(m.weight.new_empty(0), requires_grad=False)


def _reorder(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w, 256)     # 256: the decode batch to tune for


def upcast_linear(m: nn.Linear) -> None:
    """Hold a bf16 weight (and bias) in float32: the values are exact, and the fallback matmul
    then runs at float32 speed, for twice the weights' memory."""
    m.weight = nn.Parameter(m.weight.detach().float(), requires_grad=False)
    if m.bias is not None:
        m.bias = nn.Parameter(m.bias.detach().float(), requires_grad=False)


def use_cpu_kernels(model: nn.Module, dtype: torch.dtype, device: str, enable: bool = True) -> bool:
    """Route RMSNorm, SwiGLU and RoPE through kvflow's native CPU kernels (cpu_ops.py) when they are
    built and the model is a bf16 or float32 CPU model, and mark float32 Linears (and the model,
    for its LM head) for skinny_linear. Returns whether they are in use."""
    on = False
    if enable and device == "cpu" and dtype in (torch.bfloat16, torch.float32):
        from kvflow.model.kernels import cpu_ops
        on = cpu_ops.available()
    skinny = on and dtype == torch.float32
    model.__dict__["skinny"] = skinny
    for m in model.modules():
        if isinstance(m, (RMSNorm, MLP, RotaryEmbedding)):
            m.use_kernels = on
        elif isinstance(m, nn.Linear):
            m.__dict__["skinny"] = skinny
    return on


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.shape = (dim,)

    use_kernels = False     # set per model by use_cpu_kernels()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_kernels and x.dim() == 2 and x.stride(1) == 1:
            return ops.rms_norm(x, self.weight, self.eps)
        # One fused op. It multiplies by the weight before rounding to the model dtype, where HF
        # rounds first: identical in float32, slightly more precise in bf16. (On CPU, bf16
        # F.rms_norm decomposes into ~8 ops over a float32 copy, hence the kernel above.)
        return F.rms_norm(x, self.shape, self.weight, self.eps)


def _inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band in
        # between interpolated smoothly.
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        out = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        return torch.where(medium, smoothed, out)
    raise NotImplementedError(f"rope_scaling type {kind!r} is not supported "
                              f"(supported: linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (rotate_half), with a cos/sin table for positions < max_len."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, max_len: int) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling, self.max_len = head_dim, theta, scaling, max_len
        self.cos = self.sin = None
        self.use_kernels = False    # set by use_cpu_kernels()

    def build(self, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        # Built after the weights are loaded, in the model's dtype and device.
        inv = _inv_freq(self.head_dim, self.theta, self.scaling)
        freqs = torch.arange(self.max_len, dtype=torch.float32)[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(dtype=dtype, device=device)
        # rotate_half(x) * sin == roll(x, half) * [-sin, sin]: the sign lives in the table
        # (negation is exact), which saves the neg and cat ops of every layer.
        sin = emb.sin()
        half = self.head_dim // 2
        sin[:, :half] = -sin[:, :half]
        self.sin = sin.to(dtype=dtype, device=device)

    def lookup(self, positions: torch.Tensor) -> tuple:
        """This step's RoPE inputs, shared by every layer: cos, sin [T, 1, head_dim] for the
        torch path; the positions and the whole tables for the kernel, which indexes them."""
        if self.use_kernels:
            return (positions, self.cos, self.sin)
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def apply_(cos_sin: tuple, x: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, heads, head_dim] in place (q and k heads side by side, one pass)."""
        if len(cos_sin) == 3:
            ops.rotary_(x, *cos_sin)
            return x
        cos, signed_sin = cos_sin
        rolled = x.roll(x.shape[-1] // 2, dims=-1)
        return x.mul_(cos).addcmul_(rolled, signed_sin)


class MLP(nn.Module):
    """SwiGLU with gate and up fused into one matmul."""
    use_kernels = False     # set per model by use_cpu_kernels()

    def __init__(self, hidden: int, intermediate: int, tp=None) -> None:
        super().__init__()
        self.tp = tp    # tensor parallelism: intermediate is this rank's share (parallel.py)
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Returns residual + mlp(x); down_proj and the residual add are one addmm."""
        gate_up = linear(x, self.gate_up_proj)
        if self.use_kernels:
            act = ops.silu_and_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate).mul_(up)
        if self.tp is None:
            return linear(act, self.down_proj, residual)
        return self.tp.reduce_linear(act, self.down_proj, residual)
