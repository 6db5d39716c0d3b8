"""kvflow's quantized-weight CPU kernels (csrc/cpu_quant.cpp, kvflow/model/quantization/quant.py)
against gguf's own dequantization.

The reference is gguf.quants.dequantize of the same bytes, multiplied in float64. Tolerance: the
few-token path quantizes each block of 32 activations to int16 with step d = max|x_b| / 32767, so
x is off by at most d / 2 per element and, the weight side being exact integers times its
scales, |y - y_ref| <= sum over blocks of d_b / 2 * sum_b |w| (the bound `_bound` computes),
plus float32 rounding (1e-5 of sum |w||x|). The many-token path only has the rounding. The bound
is a few tenths of a percent of sum |w||x|: test_tolerance_catches_wrong_nibble_order_and_scale
shows that a wrong nibble order or a dropped min breaks it in most rows of a single token.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from kvflow.model.kernels import cpu_ops
from kvflow.model.quantization import quant

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402

if shutil.which("g++") is None and shutil.which("c++") is None:
    pytest.skip("no C++ compiler: kvflow uses its torch fallbacks", allow_module_level=True)

QTYPES = [quant.Q4_0, quant.Q4_1, quant.Q8_0, quant.Q4_K, quant.Q6_K, quant.KVFLOW_I8_PC]
TOKENS = [1, 2, 3, 5, 7, 8, 16, 17, 64]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert cpu_ops.available(), "kvflow's CPU kernels failed to build (see the warning)"
    yield
    torch.ops.kvflow.quant_set_isa("auto")


def _has_avx2() -> bool:
    flags = cpu_ops._cpu_flags().split()
    return all(f in flags for f in ("avx2", "fma", "f16c"))


ISAS = ["scalar", pytest.param("avx2", marks=pytest.mark.skipif(
    not _has_avx2(), reason="this CPU lacks AVX2/FMA/F16C"))]


@pytest.fixture(params=ISAS)
def isa(request):
    torch.ops.kvflow.quant_set_isa(request.param)
    assert torch.ops.kvflow.quant_isa() == request.param
    yield request.param
    torch.ops.kvflow.quant_set_isa("auto")


def _fp16_bytes(rng, shape, lo, hi) -> np.ndarray:
    v = rng.uniform(lo, hi, size=shape).astype(np.float16)
    return v.view(np.uint8).reshape(*shape, 2)


def make_weight(qtype: int, o: int, i: int, seed: int = 0) -> np.ndarray:
    """Valid uint8 [O, row_bytes]: gguf's quantizer where it has one; random bytes with sane fp16
    scales for the K-quants (every bit pattern of their other bytes is a valid block)."""
    rng = np.random.default_rng(seed)
    if qtype == quant.KVFLOW_I8_PC:
        w = torch.from_numpy(rng.standard_normal((o, i)).astype(np.float32))
        return quant.quantize_int8_pc(w).numpy()
    if qtype in (quant.Q4_0, quant.Q4_1, quant.Q8_0):
        w = rng.standard_normal((o, i)).astype(np.float32) * 0.1
        return gguf_quantize(w, qtype)
    size, nbytes = quant.BLOCKS[qtype]
    raw = rng.integers(0, 256, size=(o, i // size, nbytes), dtype=np.uint8)
    if qtype == quant.Q4_K:          # d, dmin: both signs occur in real files' dmin
        raw[..., 0:2] = _fp16_bytes(rng, (o, i // size), 1e-3, 4e-3)
        raw[..., 2:4] = _fp16_bytes(rng, (o, i // size), -1e-3, 4e-3)
    else:                            # Q6_K: d is the last two bytes
        raw[..., 208:210] = _fp16_bytes(rng, (o, i // size), -4e-3, 4e-3)
    return raw.reshape(o, -1)


def reference_dequantize(qw: np.ndarray, qtype: int, i: int) -> np.ndarray:
    if qtype == quant.KVFLOW_I8_PC:
        scale = qw[:, :4].copy().view(np.float32)
        return scale * qw[:, 4:].view(np.int8).astype(np.float32)
    return gguf_dequantize(qw, qtype)


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[T, O] bound on |quant_linear - exact| (module docstring)."""
    t, i = x.shape
    xd = x.double()
    wa = w.abs()
    rounding = 1e-5 * (xd.abs() @ wa.T)
    if i % 32:
        return rounding
    step = xd.view(t, i // 32, 32).abs().amax(-1) / 32767        # [T, blocks]
    wsum = wa.view(w.shape[0], i // 32, 32).sum(-1)               # [O, blocks]
    return 0.5 * 1.001 * step @ wsum.T + rounding


def _check_linear(qtype, t, i, o, with_bias, with_res, seed=0):
    qw = make_weight(qtype, o, i, seed)
    w = torch.from_numpy(reference_dequantize(qw, qtype, i)).double()
    g = torch.Generator().manual_seed(seed + t)
    x = torch.randn(t, i + 3, generator=g)[:, :i]               # a row stride != I
    bias = torch.randn(o, generator=g) if with_bias else None
    res = torch.randn(t, o + 5, generator=g)[:, :o] if with_res else None
    y = torch.ops.kvflow.quant_linear(x, torch.from_numpy(qw), qtype, i, bias, res)
    ref = x.double() @ w.T
    if bias is not None:
        ref = ref + bias.double()
    if res is not None:
        ref = ref + res.double()
    assert y.shape == (t, o) and y.dtype == torch.float32
    err = (y.double() - ref).abs()
    bound = _bound(x, w) + 1e-6 * ref.abs() + 1e-6
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"error {worst:.3g}x the bound"
    return y


def _shape(qtype: int) -> tuple[int, int]:
    # O = 37: not a multiple of the 4-row register tile.
    return (512 if qtype in (quant.Q4_K, quant.Q6_K) else 96), 37


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: quant.NAMES[q])
def test_quant_linear_matches_dequantize_then_matmul(isa, qtype, t):
    i, o = _shape(qtype)
    _check_linear(qtype, t, i, o, with_bias=t % 2 == 1, with_res=t % 3 != 0, seed=t)


@pytest.mark.parametrize("t", [1, 4, 9, 40])
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: quant.NAMES[q])
def test_quant_linear_model_shapes_with_bias_and_residual(isa, qtype, t):
    i = 512 if qtype in (quant.Q4_K, quant.Q6_K) else 576
    _check_linear(qtype, t, i, 130, with_bias=True, with_res=True, seed=100 + t)


@pytest.mark.parametrize("qtype", [quant.Q4_1, quant.Q8_0, quant.Q4_0], ids=lambda q: quant.NAMES[q])
def test_every_token_count_to_70_matches_reference_and_is_batch_invariant(isa, qtype):
    """Every T from 1 to 70 (each token tile split, the few-token / tile threshold, odd O):
    within the bound of the reference, and each token's row bit for bit what the same token
    gives alone on the few-token path, or alone on the tile path, whichever its T takes."""
    i, o = 96, 37
    qw_np = make_weight(qtype, o, i, seed=7)
    qw = torch.from_numpy(qw_np)
    w = torch.from_numpy(reference_dequantize(qw_np, qtype, i)).double()
    x = torch.randn(70, i, generator=torch.Generator().manual_seed(7))
    alone = torch.cat([torch.ops.kvflow.quant_linear(x[k:k + 1], qw, qtype, i) for k in range(70)])
    big = torch.ops.kvflow.quant_linear(x, qw, qtype, i)     # 70 tokens: the tile path
    bound = _bound(x, w) + 1e-6 * (x.double() @ w.T).abs() + 1e-6
    assert ((alone.double() - x.double() @ w.T).abs() <= bound).all()
    assert ((big.double() - x.double() @ w.T).abs() <= bound).all()
    small_t = None
    for t in range(1, 71):
        y = torch.ops.kvflow.quant_linear(x[:t], qw, qtype, i)
        if torch.equal(y, alone[:t]):
            assert small_t is None or small_t == t - 1, f"T={t} took the few-token path again"
            small_t = t
        else:     # past the threshold: the tile path, whose rows agree to float rounding
            assert small_t is not None and t > small_t
            err = (y.double() - alone[:t].double()).abs()
            assert (err <= 1e-5 * (x[:t].double().abs() @ w.abs().T) + 1e-6).all(), f"T={t}"
    assert small_t is not None and small_t >= 4


@pytest.mark.parametrize("qtype", [quant.Q4_0, quant.Q4_1, quant.Q8_0, quant.KVFLOW_I8_PC],
                         ids=lambda q: quant.NAMES[q])
def test_each_path_is_batch_invariant_bitwise(isa, qtype):
    """A token's row is bit for bit the same whichever T in 13..24 (AVX2: the token-lanes path,
    8 tokens a vector; scalar: the tiles) or in 1..12 (few-token path) it is computed with,
    with a bias and a residual, and O not a multiple of the 2-row tile."""
    i, o = 96, 37
    qw = torch.from_numpy(make_weight(qtype, o, i, seed=11))
    g = torch.Generator().manual_seed(11)
    x, bias, res = torch.randn(24, i, generator=g), torch.randn(o, generator=g), torch.randn(24, o, generator=g)
    for lo, hi in ((1, 12), (13, 24)):
        full = torch.ops.kvflow.quant_linear(x[:hi], qw, qtype, i, bias, res[:hi])
        for t in range(lo, hi):
            y = torch.ops.kvflow.quant_linear(x[:t], qw, qtype, i, bias, res[:t])
            if isa == "avx2" or hi == 12:
                assert torch.equal(y, full[:t]), f"T={t}"


@pytest.mark.skipif(not _has_avx2(), reason="this CPU lacks AVX2/FMA/F16C")
@pytest.mark.parametrize("qtype", [quant.Q4_0, quant.Q4_1, quant.Q8_0, quant.KVFLOW_I8_PC],
                         ids=lambda q: quant.NAMES[q])
def test_prefetch_past_the_last_row_is_harmless(qtype):
    """The few-token path prefetches ahead of the block it reads: a weight that ends at the
    end of a page-aligned mapping (the last rows of the tensor) must still compute right."""
    i, o = 64, 3
    qw = torch.from_numpy(make_weight(qtype, o, i, seed=9))
    x = torch.randn(2, i, generator=torch.Generator().manual_seed(9))
    torch.ops.kvflow.quant_set_isa("avx2")
    try:
        y = torch.ops.kvflow.quant_linear(x, qw, qtype, i)
    finally:
        torch.ops.kvflow.quant_set_isa("auto")
    ref = x.double() @ torch.from_numpy(reference_dequantize(qw.numpy(), qtype, i)).double().T
    assert ((y.double() - ref).abs() <= _bound(x, torch.from_numpy(
        reference_dequantize(qw.numpy(), qtype, i)).double()) + 1e-6).all()


@pytest.mark.parametrize("t", [1, 3, 20])
def test_int8_rows_of_any_length(isa, t):
    """KVFLOW_I8_PC has no 32-blocks of its own: an I that is not a multiple of 32 still works."""
    _check_linear(quant.KVFLOW_I8_PC, t, 40, 9, with_bias=True, with_res=False)


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: quant.NAMES[q])
def test_quant_dequantize_equals_gguf_bitwise(isa, qtype):
    i = 512 if qtype in (quant.Q4_K, quant.Q6_K) else 160
    qw = make_weight(qtype, 23, i, seed=7)
    ref = reference_dequantize(qw, qtype, i)
    got = torch.ops.kvflow.quant_dequantize(torch.from_numpy(qw), qtype, i).numpy()
    assert got.shape == ref.shape and got.dtype == np.float32
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))     # down to -0.0
    rows = torch.tensor([5, 0, 22, 5])                   # the embedding lookup: rows, then expand
    sub = torch.ops.kvflow.quant_dequantize(torch.from_numpy(qw).index_select(0, rows), qtype, i)
    assert torch.equal(sub, torch.from_numpy(ref)[rows])


@pytest.mark.skipif(not _has_avx2(), reason="this CPU lacks AVX2/FMA/F16C")
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: quant.NAMES[q])
def test_scalar_and_avx2_agree(qtype):
    i, o = _shape(qtype)
    qw = torch.from_numpy(make_weight(qtype, o, i, seed=3))
    x = torch.randn(5, i, generator=torch.Generator().manual_seed(3))
    out = {}
    for name in ("scalar", "avx2"):
        torch.ops.kvflow.quant_set_isa(name)
        out[name] = (torch.ops.kvflow.quant_linear(x, qw, qtype, i),
                     torch.ops.kvflow.quant_dequantize(qw, qtype, i))
    torch.ops.kvflow.quant_set_isa("auto")
    # Same integer sums and scales, only the float summation order differs.
    scale = x.abs() @ out["scalar"][1].abs().T
    assert ((out["scalar"][0] - out["avx2"][0]).abs() <= 1e-5 * scale).all()
    assert torch.equal(out["scalar"][1], out["avx2"][1])


def test_env_switch_selects_isa(monkeypatch):
    monkeypatch.setenv("KVFLOW_CPU_QUANT_ISA", "scalar")
    assert quant.set_isa_from_env() == "scalar"
    assert torch.ops.kvflow.quant_isa() == "scalar"
    monkeypatch.setenv("KVFLOW_CPU_QUANT_ISA", "auto")
    assert quant.set_isa_from_env() == ("avx2" if _has_avx2() else "scalar")
    monkeypatch.setenv("KVFLOW_CPU_QUANT_ISA", "sse9")
    with pytest.raises(ValueError, match="KVFLOW_CPU_QUANT_ISA"):
        quant.set_isa_from_env()
    with pytest.raises(RuntimeError, match="unknown ISA"):
        torch.ops.kvflow.quant_set_isa("sse9")


def test_env_switch_applies_when_the_kernels_load():
    """cpu_ops.available() applies KVFLOW_CPU_QUANT_ISA itself: a CI job forces the scalar path
    for a whole run by the environment alone."""
    code = ("import torch; from kvflow.model.kernels import cpu_ops; assert cpu_ops.available(); "
            "print(torch.ops.kvflow.quant_isa())")
    env = dict(os.environ, KVFLOW_CPU_QUANT_ISA="scalar")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, timeout=300).stdout
    assert out.strip().splitlines()[-1] == "scalar"


def test_tolerance_catches_wrong_nibble_order_and_scale():
    """The bound is tight enough to fail the kernels' classic bugs: nibbles read interleaved
    (element 2j low, 2j+1 high) instead of low half / high half, or Q4_1's min m dropped."""
    i, o = 576, 64
    qw = make_weight(quant.Q4_1, o, i, seed=11)
    w = torch.from_numpy(gguf_dequantize(qw, quant.Q4_1)).double()
    blocks = qw.reshape(o, -1, 20)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float64)
    m = blocks[..., 2:4].copy().view(np.float16).astype(np.float64)
    qs = blocks[..., 4:]
    interleaved = np.stack([qs & 15, qs >> 4], axis=-1).reshape(o, -1, 32)
    w_swapped = torch.from_numpy((d * interleaved + m).reshape(o, i))
    halves = np.concatenate([qs & 15, qs >> 4], axis=-1)
    w_no_min = torch.from_numpy((d * halves).reshape(o, i))
    x = torch.randn(1, i, generator=torch.Generator().manual_seed(0))
    ref = x.double() @ w.T
    bound = _bound(x, w)
    for wrong in (w_swapped, w_no_min):
        over = (x.double() @ wrong.T - ref).abs() > bound
        assert over.double().mean() > 0.75, over.double().mean()


def test_quantize_q4_1_equals_gguf_bytes():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(67, 576, generator=g) * torch.rand(67, 1, generator=g)
    w[3, :32] = 0.5                                   # a constant block: d = 0
    ours = quant.quantize_q4_1(w)
    assert ours.dtype == torch.uint8 and ours.shape == (67, quant.row_bytes(quant.Q4_1, 576))
    assert np.array_equal(ours.numpy(), gguf_quantize(w.numpy(), quant.Q4_1))


def test_quantize_q4_1_round_trip_within_half_a_step():
    w = torch.randn(40, 256, generator=torch.Generator().manual_seed(1))
    back = torch.ops.kvflow.quant_dequantize(quant.quantize_q4_1(w), quant.Q4_1, 256)
    b = w.view(40, -1, 32)
    step = (b.amax(-1, keepdim=True) - b.amin(-1, keepdim=True)) / 15
    # Half a step, plus fp16's rounding of d (15 steps of it) and of the min.
    slack = step * (0.5 + 15 * 2 ** -11) + b.abs().amax(-1, keepdim=True) * 2 ** -11
    assert ((back.view(40, -1, 32) - b).abs() <= slack).all()


def test_quantize_int8_pc_round_trip_within_half_a_step():
    w = torch.randn(33, 100, generator=torch.Generator().manual_seed(2)) * 3
    w[4] = 0                                          # an all-zero row: scale 0, no NaN
    q = quant.quantize_int8_pc(w)
    assert q.dtype == torch.uint8 and q.shape == (33, 104)
    back = torch.ops.kvflow.quant_dequantize(q, quant.KVFLOW_I8_PC, 100)
    step = w.abs().amax(1, keepdim=True) / 127
    assert ((back - w).abs() <= step * 0.5001 + 1e-7).all()
    assert torch.equal(back[4], torch.zeros(100))


def test_row_bytes():
    assert quant.row_bytes(quant.Q4_1, 576) == 18 * 20
    assert quant.row_bytes(quant.Q8_0, 576) == 18 * 34
    assert quant.row_bytes(quant.Q4_K, 512) == 2 * 144
    assert quant.row_bytes(quant.Q6_K, 256) == 210
    assert quant.row_bytes(quant.KVFLOW_I8_PC, 10) == 14
    with pytest.raises(ValueError):
        quant.row_bytes(quant.Q4_K, 576)
    with pytest.raises(ValueError):
        quant.row_bytes(99, 64)


def test_bad_inputs_raise():
    qw = torch.from_numpy(make_weight(quant.Q4_1, 8, 64))
    x = torch.randn(2, 64)
    ql = torch.ops.kvflow.quant_linear
    with pytest.raises(RuntimeError, match="float32"):
        ql(x.double(), qw, quant.Q4_1, 64)
    with pytest.raises(RuntimeError, match="uint8"):
        ql(x, qw.to(torch.int8), quant.Q4_1, 64)
    with pytest.raises(RuntimeError, match="bytes"):
        ql(x, qw[:, :-1].contiguous(), quant.Q4_1, 64)
    with pytest.raises(RuntimeError, match="bytes"):
        ql(x, qw, quant.Q8_0, 64)                     # right rows for Q4_1, wrong for Q8_0
    with pytest.raises(RuntimeError, match="unsupported qtype"):
        ql(x, qw, 7, 64)
    with pytest.raises(RuntimeError, match="features"):
        ql(torch.randn(2, 32), qw, quant.Q4_1, 64)
    with pytest.raises(RuntimeError, match="multiple"):
        ql(torch.randn(2, 48), qw, quant.Q4_1, 48)
    with pytest.raises(RuntimeError, match="bias"):
        ql(x, qw, quant.Q4_1, 64, torch.randn(7))
    with pytest.raises(RuntimeError, match="residual"):
        ql(x, qw, quant.Q4_1, 64, None, torch.randn(3, 8))
    with pytest.raises(RuntimeError, match="unsupported qtype"):
        torch.ops.kvflow.quant_dequantize(qw, 1001, 64)


def test_zero_tokens():
    qw = torch.from_numpy(make_weight(quant.Q8_0, 8, 64))
    assert torch.ops.kvflow.quant_linear(torch.empty(0, 64), qw, quant.Q8_0, 64).shape == (0, 8)
