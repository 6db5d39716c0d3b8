"""Quantized weights for kvflow's CPU kernels (csrc/cpu_quant.cpp): the qtype ids, row sizes,
the KVFLOW_CPU_QUANT_ISA switch and fast torch quantizers for float checkpoints.

A quantized weight is a uint8 tensor [O, row_bytes(qtype, I)]: each row its I / block_size blocks
in GGUF's exact byte layout, so a GGUF tensor's raw bytes reshaped to [O, row_bytes] are used as
they are. torch.ops.kvflow.quant_linear(x, qweight, qtype, I, bias, residual) multiplies with it
and torch.ops.kvflow.quant_dequantize(qweight, qtype, I) expands rows of it to float32.
"""
from __future__ import annotations

import torch

from kvflow import envs

# ggml type ids (gguf.GGMLQuantizationType values) plus kvflow's own int8 per-row format.
Q4_0 = 2
Q4_1 = 3
Q8_0 = 8
Q4_K = 12
Q6_K = 14
KVFLOW_I8_PC = 1000     # row = float32 scale, then I int8 values; w = scale * q

# qtype -> (elements per block, bytes per block). KVFLOW_I8_PC's rows are 4 + I bytes instead.
BLOCKS = {Q4_0: (32, 18), Q4_1: (32, 20), Q8_0: (32, 34), Q4_K: (256, 144), Q6_K: (256, 210)}
NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0", Q4_K: "Q4_K", Q6_K: "Q6_K",
         KVFLOW_I8_PC: "KVFLOW_I8_PC"}


def row_bytes(qtype: int, in_features: int) -> int:
    """Bytes of one quantized row of in_features weights."""
    if qtype == KVFLOW_I8_PC:
        return 4 + in_features
    if qtype not in BLOCKS:
        raise ValueError(f"unsupported qtype {qtype} (supported: {NAMES})")
    size, nbytes = BLOCKS[qtype]
    if in_features % size:
        raise ValueError(f"{NAMES[qtype]} needs in_features divisible by {size}, got {in_features}")
    return in_features // size * nbytes


def set_isa_from_env() -> str:
    """Apply KVFLOW_CPU_QUANT_ISA (auto | avx2 | scalar; the kernels must be loaded) and return
    the ISA in use. "scalar" forces the portable path, so tests cover it on any CPU."""
    torch.ops.kvflow.quant_set_isa(envs.KVFLOW_CPU_QUANT_ISA)     # ValueError names a bad value
    return torch.ops.kvflow.quant_isa()


# Rows quantized per step: bounds the float temporaries (an LM head is ~50k rows).
_CHUNK_ELEMS = 1 << 22


def _row_chunks(w: torch.Tensor):
    rows = max(1, _CHUNK_ELEMS // max(1, w.shape[1]))
    for r in range(0, w.shape[0], rows):
        yield w[r:r + rows].to(torch.float32)


def quantize_int8_pc(w: torch.Tensor) -> torch.Tensor:
    """float [O, I] -> KVFLOW_I8_PC uint8 [O, 4 + I]: per row scale = max|w| / 127 (float32) and
    q = round(w / scale) (|error| <= scale / 2 per weight)."""
    assert w.dim() == 2, "quantize_int8_pc expects [O, I]"
    out = []
    for c in _row_chunks(w):
        scale = c.abs().amax(dim=1, keepdim=True) / 127
        inv = torch.where(scale == 0, torch.zeros_like(scale), 1.0 / scale)
        q = (c * inv).round_().clamp_(-127, 127).to(torch.int8)
        out.append(torch.cat([scale.view(torch.uint8), q.view(torch.uint8)], dim=1))
    return torch.cat(out) if out else torch.empty(0, 4 + w.shape[1], dtype=torch.uint8)


def quantize_q4_1(w: torch.Tensor) -> torch.Tensor:
    """float [O, I] (I % 32 == 0) -> Q4_1 uint8 [O, I / 32 * 20], byte for byte what
    gguf.quants.quantize(w, Q4_1) writes: per block of 32, d = (max - min) / 15 and
    m = min as fp16, q = trunc((w - min) / d + 0.5) clipped to 0..15, element j in the low
    nibble of byte j and element j + 16 in its high nibble."""
    assert w.dim() == 2 and w.shape[1] % 32 == 0, "quantize_q4_1 expects [O, I] with I % 32 == 0"
    out = []
    for c in _row_chunks(w):
        b = c.reshape(c.shape[0], -1, 32)
        mn, mx = torch.aminmax(b, dim=-1, keepdim=True)
        d = (mx - mn) / 15
        inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
        # Separate float32 ops in gguf's order (no fused multiply-add) for identical rounding;
        # in place after the first, since this runs over every weight of a checkpoint.
        q = (b - mn).mul_(inv).add_(0.5).trunc_().clamp_(0, 15).to(torch.uint8)
        qs = q[..., :16] | (q[..., 16:] << 4)
        blocks = torch.cat([d.half().view(torch.uint8), mn.half().view(torch.uint8), qs], dim=-1)
        out.append(blocks.reshape(c.shape[0], -1))
    return torch.cat(out) if out else torch.empty(0, row_bytes(Q4_1, w.shape[1]),
                                                  dtype=torch.uint8)
