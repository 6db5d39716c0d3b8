"""kvflow's native CPU kernels (kvflow/model/kernels/csrc/cpu_kernels.cpp) against plain torch.

The kernels are built with the machine's C++ compiler; where there is one, a build failure fails
these tests (no silent fallback). Tolerances: float32 agrees to ~1e-6 (only summation order
differs); bf16 outputs are rounded once from float32 math in both, so they agree to one bf16 ulp.
"""
from __future__ import annotations

import random
import shutil

import pytest
import torch
import torch.nn.functional as F

from kvflow import LLM, SamplingParams
from kvflow.model.kernels import cpu_ops
from model_fixtures import hf_greedy

if shutil.which("g++") is None and shutil.which("c++") is None:
    pytest.skip("no C++ compiler: kvflow uses its torch fallbacks", allow_module_level=True)


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert cpu_ops.available(), "kvflow's CPU kernels failed to build (see the warning)"


def _ulp_close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    else:       # one bf16 ulp (2^-8 relative) plus a little absolute slack near zero
        torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -7, atol=1e-3)


def _reference_decode(q, cache, table, lens, scale):
    """Gather each request's context through its block table and attend in float32."""
    _, nb, bs, kvh, d = cache.shape
    out = []
    for i, n in enumerate(lens.tolist()):
        slots = torch.tensor([table[i, t // bs] * bs + t % bs for t in range(n)])
        k = cache[0].reshape(-1, kvh, d)[slots].float().transpose(0, 1)     # [kvh, n, d]
        v = cache[1].reshape(-1, kvh, d)[slots].float().transpose(0, 1)
        g = q.shape[1] // kvh
        qi = q[i].float().view(kvh, g, d)
        p = torch.softmax(qi @ k.transpose(1, 2) * scale, dim=-1)
        out.append((p @ v).reshape(kvh * g, d))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,block_size,d", [
    (4, 4, 16, 64), (6, 2, 16, 64), (8, 1, 8, 128), (12, 4, 4, 64),    # the vectorised path
    (4, 2, 16, 32), (6, 3, 8, 40), (10, 1, 16, 32)])                    # the generic paths
def test_paged_decode_matches_gathered_attention(dtype, heads, kv_heads, block_size, d):
    g = torch.Generator().manual_seed(heads * 100 + kv_heads)
    num_blocks = 97
    cache = torch.randn(2, num_blocks, block_size, kv_heads, d, generator=g).to(dtype)
    lens = torch.tensor([1, 2, block_size, block_size + 1, 5 * block_size - 3, 9 * block_size])
    width = -(-int(lens.max()) // block_size)
    # Every request's blocks scattered over the cache, in no order (non-contiguous tables).
    perm = torch.randperm(num_blocks, generator=g)
    table = perm[:len(lens) * width].view(len(lens), width).contiguous()
    # q as the runner passes it: a strided slice of a fused qkv tensor.
    qkv = torch.randn(len(lens), heads + 2 * kv_heads, d, generator=g).to(dtype)
    q = qkv[:, :heads]
    scale = d ** -0.5
    out = torch.ops.kvflow.paged_decode(q, cache, table, lens, scale)
    ref = _reference_decode(q, cache, table, lens, scale)
    _ulp_close(out, ref.to(dtype), dtype)


def test_paged_decode_rejects_bad_inputs():
    cache = torch.zeros(2, 4, 16, 2, 64)
    q = torch.zeros(1, 4, 64)
    table, lens = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        torch.ops.kvflow.paged_decode(q.bfloat16(), cache, table, lens, 1.0)
    with pytest.raises(RuntimeError, match="int64"):
        torch.ops.kvflow.paged_decode(q, cache, table.int(), lens, 1.0)
    with pytest.raises(RuntimeError, match="do not match"):
        torch.ops.kvflow.paged_decode(torch.zeros(1, 3, 64), cache, table, lens, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_hf_formula(dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(37, 200, generator=g) * 3).to(dtype)
    w = torch.randn(200, generator=g).to(dtype)
    eps = 1e-6
    x32 = x.float()
    ref = w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    _ulp_close(torch.ops.kvflow.rms_norm(x, w, eps), ref, dtype)
    # A strided row view (the runner never passes one today, the kernel must still be right).
    wide = torch.randn(37, 400, generator=g).to(dtype)
    x2 = wide[:, :200]
    ref2 = w * (x2.float() * torch.rsqrt(x2.float().pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    _ulp_close(torch.ops.kvflow.rms_norm(x2, w, eps), ref2, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_torch(dtype):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(29, 2 * 300, generator=g) * 4).to(dtype)
    x[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])        # exp overflow, zeros
    gate, up = x.chunk(2, dim=-1)
    _ulp_close(torch.ops.kvflow.silu_and_mul(x), F.silu(gate) * up, dtype)


def test_engine_with_and_without_kernels_matches_hf(tiny_qwen3, monkeypatch):
    """The whole engine on the kernels and on the torch fallbacks: both must equal HF greedy,
    through a chunked prefill (budget 7) that continues cached prefixes and through decodes."""
    rng = random.Random(3)
    shared = [rng.randrange(3, 500) for _ in range(20)]
    prompts = [shared + [rng.randrange(3, 500) for _ in range(n)] for n in (1, 5, 30)]
    ref = hf_greedy(tiny_qwen3, prompts, 10)
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for on in (True, False):
        monkeypatch.setitem(cpu_ops._state, "ok", on)
        llm = LLM(tiny_qwen3, dtype="float32", max_num_batched_tokens=7, block_size=4)
        runner = llm.llm_engine.runner
        assert runner.backend.use_kernels is on
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref, f"kernels={on}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 40])      # vectorised halves, and a scalar tail
def test_rotary_matches_the_torch_path(dtype, head_dim):
    from kvflow.model.models.layers import RotaryEmbedding
    rope = RotaryEmbedding(head_dim, 10000.0, None, max_len=300)
    rope.build(dtype)
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(23, 6 + 2 * 2, head_dim, generator=g).to(dtype)
    positions = torch.randint(0, 300, (23,), generator=g)
    qk = qkv[:, :8]                     # q and k heads, a strided view as in llama.py
    # Reference: the torch path's formula in float32 on the same (model-dtype) tables, rounded
    # once, as the kernel rounds. (The torch path itself rounds x * cos first in bf16.)
    cos, sin = (t.float() for t in rope.lookup(positions))
    x = qk.float()
    ref = (x * cos + x.roll(head_dim // 2, dims=-1) * sin).to(dtype)
    if dtype == torch.float32:
        torch_path = qk.clone()
        RotaryEmbedding.apply_(rope.lookup(positions), torch_path)
        _ulp_close(torch_path, ref, dtype)
    rope.use_kernels = True
    RotaryEmbedding.apply_(rope.lookup(positions), qk)
    _ulp_close(qkv[:, :8], ref, dtype)
    with pytest.raises(RuntimeError, match="outside the table"):
        torch.ops.kvflow.rotary_(qk, torch.full((23,), 300), rope.cos, rope.sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_rows_by_slot_like_index_copy(dtype):
    g = torch.Generator().manual_seed(5)
    nb, bs, kvh, d, t = 11, 4, 2, 64, 9
    cache = torch.randn(2, nb, bs, kvh, d, generator=g).to(dtype)
    qkv = torch.randn(t, 6 + 2 * kvh, d, generator=g).to(dtype)
    kv = qkv[:, 6:].view(t, 2, kvh, d)             # strided, as the runner passes it
    slots = torch.randperm(nb * bs, generator=g)[:t]
    slots[3] = -1                                   # a padded row: not written
    want = cache.clone()
    keep = slots >= 0
    want[0].view(-1, kvh, d).index_copy_(0, slots[keep], kv[keep, 0])
    want[1].view(-1, kvh, d).index_copy_(0, slots[keep], kv[keep, 1])
    torch.ops.kvflow.store_kv_(cache, kv, slots)
    assert torch.equal(cache, want)


def test_store_kv_rejects_bad_inputs():
    cache = torch.zeros(2, 4, 4, 2, 64)
    kv = torch.zeros(3, 2, 2, 64)
    with pytest.raises(RuntimeError, match="outside the cache of 16 slots"):
        torch.ops.kvflow.store_kv_(cache, kv, torch.tensor([0, 16, 1]))
    with pytest.raises(RuntimeError, match="dtypes differ"):
        torch.ops.kvflow.store_kv_(cache, kv.bfloat16(), torch.tensor([0, 1, 2]))
    with pytest.raises(RuntimeError, match="at most one per token"):
        torch.ops.kvflow.store_kv_(cache, kv, torch.arange(4))


# (q_lens, seq_lens, the runs of whole prompts: (first request, length, count)). A request
# whose q_len < seq_len continues a cached prefix; the rest are whole prompts.
_STEP_LAYOUTS = [
    # 2 decodes, three 5-token prompts (one batched call), a 3-token prompt, a continued chunk
    ([1, 1, 5, 5, 5, 3, 6], [13, 3, 5, 5, 5, 3, 16], [(2, 5, 3), (5, 3, 1)]),
    # a continued chunk between two prompts of one length: two runs, not one (the second
    # prompt's rows were left unwritten once: NaN logits on CI)
    ([1, 3, 2, 3], [9, 3, 6, 3], [(1, 3, 1), (3, 3, 1)]),
    ([3, 3, 6, 3, 3], [3, 3, 10, 3, 3], [(0, 3, 2), (3, 3, 2)]),
]


@pytest.mark.parametrize("layout", _STEP_LAYOUTS)
@pytest.mark.parametrize("use_kernels", [True, False])
def test_torch_backend_step_of_decodes_fresh_prompts_and_continued_chunks(use_kernels, layout):
    """One step mixing decodes, runs of whole prompts and chunks continuing a cached prefix:
    each request's output equals causal attention over its whole context, read back from the
    cache after the step's writes."""
    from kvflow.model.attention.backend import AttentionMetadata, TorchAttentionBackend
    g = torch.Generator().manual_seed(2)
    nb, bs, kvh, h, d = 40, 4, 2, 6, 64
    q_lens, seq_lens, runs = layout
    width = -(-max(seq_lens) // bs)
    table = torch.randperm(nb, generator=g)[:len(q_lens) * width].view(len(q_lens), width)
    slots, qsl = [], [0]
    for r, (ql, sl) in enumerate(zip(q_lens, seq_lens)):
        slots += [int(table[r, p // bs]) * bs + p % bs for p in range(sl - ql, sl)]
        qsl.append(qsl[-1] + ql)
    t = qsl[-1]
    cache = torch.randn(2, nb, bs, kvh, d, generator=g)
    qkv = torch.randn(t, h + 2 * kvh, d, generator=g)
    q, kv = qkv[:, :h], qkv[:, h:].view(t, 2, kvh, d)
    meta = AttentionMetadata(num_tokens=t, slot_mapping=torch.tensor(slots), query_start_loc=qsl,
                             seq_lens=seq_lens, block_table=table.contiguous(),
                             num_decodes=sum(ql == 1 < sl for ql, sl in zip(q_lens, seq_lens)),
                             block_size=bs, num_blocks=nb)
    backend = TorchAttentionBackend(use_kernels=use_kernels)
    backend.prepare(meta)
    assert meta.extra["p_fresh"] == [[qsl[r], n, c] for r, n, c in runs]
    out = backend.forward(q, kv, cache, meta, d ** -0.5)
    for r, (ql, sl) in enumerate(zip(q_lens, seq_lens)):
        ctx = torch.tensor([int(table[r, p // bs]) * bs + p % bs for p in range(sl)])
        k = cache[0].reshape(-1, kvh, d)[ctx].repeat_interleave(h // kvh, 1).transpose(0, 1)
        v = cache[1].reshape(-1, kvh, d)[ctx].repeat_interleave(h // kvh, 1).transpose(0, 1)
        qr = q[qsl[r]:qsl[r + 1]].transpose(0, 1)
        mask = torch.arange(sl)[None, :] <= torch.arange(sl - ql, sl)[:, None]
        ref = F.scaled_dot_product_attention(qr, k, v, attn_mask=mask, scale=d ** -0.5)
        torch.testing.assert_close(out[qsl[r]:qsl[r + 1]], ref.transpose(0, 1),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [7, 16, 8192 + 5])
def test_argmax_rows_matches_torch_max_indices(dtype, vocab):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab + 3, generator=g).to(dtype)[:, 2:vocab + 2]   # strided rows
    x[1] = float("-inf")                            # all -inf: index 0
    x[2, :] = 0
    x[2, [vocab // 2, vocab - 1]] = 3.0             # a tie: the first wins
    x[3, vocab - 1] = float("nan")                  # NaN wins, wherever it is
    x[4, [vocab // 3, vocab - 1]] = float("nan")    # the first NaN
    x[5, 0] = float("inf")
    x[6] = 1.0                                      # all equal: index 0
    got = torch.ops.kvflow.argmax_rows(x)
    assert got.tolist() == x.max(dim=-1).indices.tolist()


def test_argmax_rows_rejects_bad_inputs():
    with pytest.raises(RuntimeError, match="non-empty"):
        torch.ops.kvflow.argmax_rows(torch.zeros(2, 0))
    with pytest.raises(RuntimeError, match="unit stride"):
        torch.ops.kvflow.argmax_rows(torch.zeros(4, 3).t())
    with pytest.raises(RuntimeError, match="supports bfloat16 and float32"):
        torch.ops.kvflow.argmax_rows(torch.zeros(2, 3, dtype=torch.float16))


def _skinny_ref(x, w, bias=None, residual=None):
    y = (x.double() @ w.double().t())
    if bias is not None:
        y = y + bias.double()
    if residual is not None:
        y = y + residual.double()
    return y


def _assert_skinny_close(got, ref, x, w):
    # Error relative to the magnitude of the products summed, not of the (possibly cancelling) sum.
    scale = (x.double().abs() @ w.double().abs().t()).max().item() + 1.0
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert (got.double() - ref).abs().max().item() <= 1e-5 * scale


@pytest.mark.parametrize("T", range(1, 17))
@pytest.mark.parametrize("I,O", [(77, 130), (64, 96), (576, 31)])
def test_skinny_linear_matches_f_linear(T, I, O):
    g = torch.Generator().manual_seed(T * 1000 + I + O)
    x, w = torch.randn(T, I, generator=g), torch.randn(O, I, generator=g)
    b, r = torch.randn(O, generator=g), torch.randn(T, O, generator=g)
    for bias, res in [(None, None), (b, None), (None, r), (b, r)]:
        got = torch.ops.kvflow.skinny_linear(x, w, bias, res)
        _assert_skinny_close(got, _skinny_ref(x, w, bias, res), x, w)
    torch.testing.assert_close(torch.ops.kvflow.skinny_linear(x, w, b), F.linear(x, w, b),
                               rtol=1e-5, atol=1e-5 * I ** 0.5)


def test_skinny_linear_strided_inputs():
    g = torch.Generator().manual_seed(3)
    big = torch.randn(5, 200, generator=g)
    x = big[:, 3:80]                                # row-strided
    xt = torch.randn(77, 5, generator=g).t()        # column-major: copied
    wbig = torch.randn(130, 90, generator=g)
    w = wbig[:, :77]                                # row-strided weight
    res = torch.randn(5, 140, generator=g)[:, :130]
    for xx in (x, xt):
        got = torch.ops.kvflow.skinny_linear(xx, w, None, res)
        _assert_skinny_close(got, _skinny_ref(xx, w, None, res), xx, w)


def test_skinny_linear_rejects_bad_inputs():
    x, w = torch.zeros(3, 8), torch.zeros(5, 8)
    op = torch.ops.kvflow.skinny_linear
    with pytest.raises(RuntimeError, match="float32"):
        op(x.double(), w)
    with pytest.raises(RuntimeError, match="float32"):
        op(x, w.bfloat16())
    with pytest.raises(RuntimeError, match="features"):
        op(torch.zeros(3, 7), w)
    with pytest.raises(RuntimeError, match=r"\[T, I\]"):
        op(torch.zeros(2, 3, 8), w)
    with pytest.raises(RuntimeError, match="unit stride"):
        op(x, torch.zeros(8, 5).t())
    with pytest.raises(RuntimeError, match="bias"):
        op(x, w, torch.zeros(4))
    with pytest.raises(RuntimeError, match="residual"):
        op(x, w, None, torch.zeros(3, 4))
    with pytest.raises(RuntimeError, match="residual"):
        op(x, w, None, torch.zeros(5, 3).t())
    assert op(torch.zeros(0, 8), w).shape == (0, 5)


def _marked_linear(I, O, bias):
    m = torch.nn.Linear(I, O, bias=bias)
    m.__dict__["skinny"] = True
    return m


@pytest.mark.parametrize("flag", [True, False])
def test_linear_routing_equals_f_linear(flag, monkeypatch):
    from kvflow.model.models import layers
    monkeypatch.setattr(layers, "_SKINNY_GEMM", flag)
    m = _marked_linear(77, 130, bias=True)
    with torch.no_grad():
        for T in (1, 2, 5, layers.SKINNY_MAX_ROWS, layers.SKINNY_MAX_ROWS + 1):
            x, r = torch.randn(T, 77), torch.randn(T, 130)
            routed = layers.SKINNY_MIN_ROWS <= T <= layers.SKINNY_MAX_ROWS
            assert layers.use_skinny(x, True, layers.SKINNY_MAX_ROWS) == (flag and routed)
            torch.testing.assert_close(layers.linear(x, m), F.linear(x, m.weight, m.bias))
            torch.testing.assert_close(layers.linear(x, m, r), F.linear(x, m.weight, m.bias) + r)
    assert not layers.use_skinny(torch.randn(3, 77).bfloat16(), True, 8)
    assert not layers.use_skinny(torch.randn(3, 77), False, 8)


def test_skinny_env_switch_forces_the_torch_path():
    import os
    import subprocess
    import sys
    code = ("import torch, torch.nn.functional as F\n"
            "from kvflow.model.models import layers\n"
            "assert layers._SKINNY_GEMM is False\n"
            "assert not layers.use_skinny(torch.zeros(3, 8), True, 8)\n"
            "m = torch.nn.Linear(77, 130); m.__dict__['skinny'] = True\n"
            "x = torch.randn(4, 77)\n"
            "with torch.no_grad(): torch.testing.assert_close(layers.linear(x, m),"
            " F.linear(x, m.weight, m.bias), rtol=0, atol=0)\n")
    env = dict(os.environ, KVFLOW_CPU_SKINNY_GEMM="0")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("wx", [True, False])
@pytest.mark.parametrize("skinny", [True, False])
def test_every_lm_head_path_equals_x_times_w_transposed(wx, skinny, monkeypatch):
    """The float32 CPU LM head: skinny_linear (1-16 rows, kernels built), W @ x.T (other
    small batches), x @ W.T (KVFLOW_LM_HEAD_WX=0): the same logits whichever runs."""
    from types import SimpleNamespace

    from kvflow.model.kernels import cpu_ops
    from kvflow.model.models import llama
    monkeypatch.setattr(llama, "_LM_HEAD_WX", wx)
    w = torch.randn(300, 64)
    head = SimpleNamespace(skinny=skinny and cpu_ops.available(), lm_weight=lambda: w)
    for rows in (1, 3, 16, 20):
        h = torch.randn(rows, 64)
        got = llama.LlamaForCausalLM._logits(head, h)     # compute_logits less TP's gather
        assert got.is_contiguous()
        torch.testing.assert_close(got, F.linear(h, w), rtol=1e-5, atol=1e-5)
