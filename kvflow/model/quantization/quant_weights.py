"""Quantized weights executed as they are stored: GGUF blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K), or
HF float weights quantized at load (quantization="int8" | "q4"). A Linear or Embedding whose
weight is quantized holds it in `module.__dict__["quant"]` (a list of QuantTensor parts, row
blocks of the float weight in order: q, k and v of a fused qkv_proj may differ in type) and an
empty `weight`; `linear()` and `embed()` send it to kvflow's native kernels (csrc/cpu_quant.cpp).

Why: a decode step is bound by the bytes of weights it reads. Dequantized to float32, the
default model's weights are ~540 MB per token; as Q4_1/Q8_0 blocks they are ~85 MB.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvflow import envs
from kvflow.model.kernels.cpu_ops import ops
from kvflow.model.quantization.quant import KVFLOW_I8_PC, NAMES, Q4_1

KERNEL_QTYPES = frozenset(NAMES)


@dataclass(slots=True)
class QuantTensor:
    """A 2-D weight as quantized rows: data is uint8 [rows, row_bytes] in the type's block
    layout (GGUF's own for the ggml types), shape the float tensor's (rows, in_features)."""
    data: torch.Tensor
    qtype: int
    shape: tuple[int, int]

    def dequantize(self) -> torch.Tensor:
        return ops.quant_dequantize(self.data, self.qtype, self.shape[1])


def kernels_ready() -> bool:
    from kvflow.model.kernels import cpu_ops
    return cpu_ops.available() and hasattr(torch.ops.kvflow, "quant_linear")


def keep_quantized(device: str, dtype: torch.dtype) -> bool:
    """Whether quantized weights run as stored: CPU, float32 activations, kernels built, and
    not switched off (KVFLOW_CPU_QUANT=0 forces the float32 path on any CPU, for tests; it
    dequantizes GGUF weights to float32 at load, as before the kernels existed)."""
    return (device == "cpu" and dtype == torch.float32 and envs.KVFLOW_CPU_QUANT
            and kernels_ready())


def attach(m: nn.Module, parts: list[QuantTensor]) -> None:
    """Make m (Linear or Embedding) run from parts; its float weight is dropped."""
    rows = sum(p.shape[0] for p in parts)
    want = tuple(m.weight.shape)
    if (rows, parts[0].shape[1]) != want or any(p.shape[1] != want[1] for p in parts):
        raise ValueError(f"quantized weight parts of {[p.shape for p in parts]} do not make "
                         f"the module's {want}")
    if len(parts) > 1 and len({p.qtype for p in parts}) == 1:
        parts = [QuantTensor(torch.cat([p.data for p in parts]), parts[0].qtype, want)]
    set_quant(m, parts)
    m.weight = nn.Parameter(torch.empty(0, dtype=m.weight.dtype), requires_grad=False)


def set_quant(m: nn.Module, parts: list[QuantTensor]) -> None:
    """m runs from parts; one part is also kept as quant_linear's arguments (layers.linear)."""
    m.__dict__["quant"] = parts
    if len(parts) == 1 and isinstance(m, nn.Linear):
        p = parts[0]
        m.__dict__["quant1"] = (p.data, p.qtype, p.shape[1], m.bias)


def quant_linear(x: torch.Tensor, parts: list[QuantTensor], bias: torch.Tensor | None,
                 residual: torch.Tensor | None) -> torch.Tensor:
    """A module of several parts of different types (one part goes straight to the op:
    set_quant's quant1, layers.linear)."""
    op = ops.quant_linear
    y = torch.cat([op(x, p.data, p.qtype, p.shape[1]) for p in parts], dim=1)
    if bias is not None:
        y += bias
    if residual is not None:
        y += residual
    return y


def embed(m: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """The embedding rows of ids: dequantized from the rows' blocks when m is quantized."""
    parts = m.__dict__.get("quant")
    if parts is None:
        return m(ids)
    p = parts[0]
    return ops.quant_dequantize(p.data.index_select(0, ids), p.qtype, p.shape[1])


# HF names of the weights quantization="int8" | "q4" quantizes: every Linear and the embedding
# (and so a tied LM head). q4 keeps the embedding and LM head in int8, as is usual: their
# error reaches every logit.
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TABLES = ("embed_tokens.weight", "lm_head.weight")


def quantize_weights(weights, method: str, run_quantized: bool):
    """(name, tensor) pairs of an HF checkpoint with its Linear and embedding weights quantized
    (QuantTensor). Without the kernels (run_quantized False: KVFLOW_CPU_QUANT=0, no compiler,
    CUDA) they come back dequantized: the same model, run in float32."""
    from kvflow.model.quantization.quant import quantize_int8_pc, quantize_q4_1
    for name, w in weights:
        table = name.endswith(_TABLES)
        if w.dim() != 2 or w.shape[1] % 32 or not (table or any(
                f".{n}.weight" in name for n in _LINEARS)):
            yield name, w
            continue
        if method == "q4" and not table:
            q = QuantTensor(quantize_q4_1(w.float()), Q4_1, tuple(w.shape))
        else:
            q = QuantTensor(quantize_int8_pc(w.float()), KVFLOW_I8_PC, tuple(w.shape))
        yield name, (q if run_quantized else _dequantize_reference(q).to(w.dtype))


def _dequantize_reference(q: QuantTensor) -> torch.Tensor:
    """float32 weights of q without kvflow's kernels (torch and gguf-py only)."""
    if q.qtype == KVFLOW_I8_PC:
        scale = q.data[:, :4].contiguous().view(torch.float32)
        return q.data[:, 4:].contiguous().view(torch.int8).float() * scale
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    w = dequantize(q.data.numpy(), GGMLQuantizationType(q.qtype)).astype(np.float32)
    return torch.from_numpy(w.reshape(q.shape))
