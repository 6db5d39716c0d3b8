"""Triton kernels for paged attention: KV store by slot, varlen prefill, split-K decode.

Cache layout (one layer, K or V): [num_blocks, block_size, num_kv_heads, head_dim], contiguous.
Keys are gathered a token at a time through the block table (physical block of position p is
block_table[r, p // block_size]), so the key tile size is independent of the block size: any
block size works, including ones smaller than tl.dot's 16-wide minimum.

Softmax runs in the exp2 domain (scores pre-multiplied by scale * log2(e)): exp2 is a single
instruction on the GPU, and the log-sum-exps passed between the decode kernels stay base 2.

This module imports triton at the top; kvflow imports it only when the triton backend is chosen.
Under TRITON_INTERPRET=1 (set before this module is imported) the kernels run on CPU tensors.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# The interpreter computes tl.dot with numpy on the raw storage, and bf16 is stored as uint16
# there: a bf16 dot would multiply bit patterns. Interpreted kernels upcast dot operands to
# float32 instead (exact products, float32 sums: what the GPU's bf16 MMA computes too).
INTERPRETED = bool(triton.knobs.runtime.interpret)

_LOG2E = 1.4426950408889634
# Decode split heuristic. Enough programs to cover an H100's 132 SMs a few times over; a split
# shorter than _MIN_SPLIT_TOKENS costs more in the reduce than it saves in parallelism.
_TARGET_PROGRAMS = 512
_MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 16


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, PREC: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _attend_tile(q, k_ptr, v_ptr, off, d, k_ok, d_ok, visible, m, l, acc, scale_log2,
                 UPCAST: tl.constexpr, PREC: tl.constexpr):
    """One online-softmax step over a tile of keys at cache offsets `off` (prefill and decode
    share it): returns the updated running max m, sum l and output accumulator acc."""
    kt = tl.load(k_ptr + off[None, :] + d[:, None], mask=k_ok[None, :] & d_ok[:, None], other=0.0)
    s = _dot(q, kt, UPCAST, PREC) * scale_log2
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    l = l * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + off[:, None] + d[None, :], mask=k_ok[:, None] & d_ok[None, :], other=0.0)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST, PREC)
    return m_new, l, acc


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
                     s_k_tok, s_k_head, s_v_tok, s_v_head, s_c_slot, s_c_head,
                     KVH: tl.constexpr, D: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:        # a padded row (CUDA-graph batches): nothing to write
        return
    h = tl.arange(0, HP)[:, None]
    d = tl.arange(0, DP)[None, :]
    mask = (h < KVH) & (d < D)
    k = tl.load(k_ptr + t * s_k_tok + h * s_k_head + d, mask=mask)
    v = tl.load(v_ptr + t * s_v_tok + h * s_v_head + d, mask=mask)
    dst = slot * s_c_slot + h * s_c_head + d
    tl.store(kc_ptr + dst, k, mask=mask)
    tl.store(vc_ptr + dst, v, mask=mask)


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value [T, KVH, D] (any token/head strides) -> k_cache/v_cache at slot_mapping[t]."""
    t, kvh, d = key.shape
    if t == 0:
        return
    _check_cache(k_cache, kvh, d)
    _check_cache(v_cache, kvh, d)
    assert key.stride(2) == 1 and value.stride(2) == 1 and slot_mapping.shape == (t,)
    _store_kv_kernel[(t,)](key, value, k_cache, v_cache, slot_mapping,
                           key.stride(0), key.stride(1), value.stride(0), value.stride(1),
                           k_cache.stride(1), k_cache.stride(2),
                           KVH=kvh, D=d, HP=triton.next_power_of_2(kvh),
                           DP=triton.next_power_of_2(d))


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, o_ptr, qsl_ptr, lens_ptr, bt_ptr, scale_log2,
                    s_q_tok, s_q_head, s_o_tok, s_o_head, s_c_blk, s_c_tok, s_c_head, s_bt,
                    G: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr,
                    BLOCK_M: tl.constexpr, TOKS: tl.constexpr, TILE_N: tl.constexpr,
                    UPCAST: tl.constexpr, PREC: tl.constexpr):
    r = tl.program_id(0)
    qb = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(qsl_ptr + r)
    q_len = tl.load(qsl_ptr + r + 1) - q_start
    if qb * TOKS >= q_len:
        return
    seq_len = tl.load(lens_ptr + r)
    ctx = seq_len - q_len        # tokens cached before this chunk
    # The G query heads sharing this KV head are folded into the rows: row = token * G + head,
    # so each K/V tile is loaded once for all of them.
    rows = tl.arange(0, BLOCK_M)
    tok = qb * TOKS + rows // G
    head = kvh * G + rows % G
    row_ok = (rows < TOKS * G) & (tok < q_len)
    d = tl.arange(0, DP)
    d_ok = d < D
    q = tl.load(q_ptr + (q_start + tok)[:, None] * s_q_tok + head[:, None] * s_q_head + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = ctx + tok
    # Causal: no row of this program sees past its last query token.
    kv_end = tl.minimum(seq_len, ctx + (qb + 1) * TOKS)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DP], tl.float32)
    n = tl.arange(0, TILE_N)
    for k0 in range(0, kv_end, TILE_N):
        pos = k0 + n
        k_ok = pos < kv_end
        blk = tl.load(bt_ptr + r * s_bt + pos // BS, mask=k_ok, other=0).to(tl.int64)
        off = blk * s_c_blk + (pos % BS) * s_c_tok + kvh * s_c_head
        # Key 0 is visible to every row, so m is finite after the first tile: no NaN rows.
        visible = (pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
        m, l, acc = _attend_tile(q, k_ptr, v_ptr, off, d, k_ok, d_ok, visible, m, l, acc,
                                 scale_log2, UPCAST, PREC)
    out = acc / l[:, None]
    tl.store(o_ptr + (q_start + tok)[:, None] * s_o_tok + head[:, None] * s_o_head + d[None, :],
             out, mask=row_ok[:, None] & d_ok[None, :])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            block_table: torch.Tensor, scale: float, max_query_len: int,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal varlen attention over the paged cache (which already holds this step's K/V).

    Request r owns q rows query_start_loc[r]:query_start_loc[r + 1]; its query i sits at
    position seq_lens[r] - q_len + i and attends to positions 0..itself. query_start_loc may be
    a view into a longer cu_seqlens (rows are absolute in q and out). Returns out [T, H, D].
    """
    _, h, d = q.shape
    kvh = k_cache.shape[2]
    _check_cache(k_cache, kvh, d)
    _check_cache(v_cache, kvh, d)
    g = h // kvh
    num_reqs = seq_lens.shape[0]
    out = torch.empty_like(q) if out is None else out
    assert q.stride(2) == 1 and out.stride(2) == 1 and h == g * kvh
    assert block_table.stride(1) == 1 and query_start_loc.shape[0] >= num_reqs + 1
    if num_reqs == 0 or max_query_len == 0:
        return out
    block_m = max(64, triton.next_power_of_2(g))
    toks = block_m // g
    grid = (num_reqs, triton.cdiv(max_query_len, toks), kvh)
    _prefill_kernel[grid](q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table,
                          scale * _LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                          k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                          block_table.stride(0), G=g, D=d, DP=_dp(d), BS=k_cache.shape[1],
                          BLOCK_M=block_m, TOKS=toks, TILE_N=64, UPCAST=INTERPRETED,
                          PREC=_prec(q.dtype), num_warps=4, num_stages=_stages(q.dtype))
    return out


@triton.jit
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, o_ptr, po_ptr, plse_ptr, lens_ptr, bt_ptr,
                         scale_log2, s_q_b, s_q_head, s_o_b, s_o_head,
                         s_c_blk, s_c_tok, s_c_head, s_bt,
                         H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                         DP: tl.constexpr, BS: tl.constexpr, TILE_N: tl.constexpr,
                         SPLITS: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    # Each request divides its own context evenly (in whole tiles) among the splits, so the
    # grid can be fixed (CUDA graphs) while short and long contexts both use every split.
    part = tl.cdiv(tl.cdiv(seq_len, SPLITS), TILE_N) * TILE_N
    start = sp * part
    end = tl.minimum(start + part, seq_len)
    g = tl.arange(0, GP)
    g_ok = g < G
    head = kvh * G + g
    d = tl.arange(0, DP)
    d_ok = d < D
    # GQA: the G query heads of one KV head are the rows of one [GP, D] tile (padded to 16,
    # tl.dot's minimum), so every K/V tile is read once per KV head.
    q = tl.load(q_ptr + b * s_q_b + head[:, None] * s_q_head + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    m = tl.full([GP], float("-inf"), tl.float32)
    l = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DP], tl.float32)
    n = tl.arange(0, TILE_N)
    for k0 in range(start, end, TILE_N):
        pos = k0 + n
        k_ok = pos < end
        blk = tl.load(bt_ptr + b * s_bt + pos // BS, mask=k_ok, other=0).to(tl.int64)
        off = blk * s_c_blk + (pos % BS) * s_c_tok + kvh * s_c_head
        m, l, acc = _attend_tile(q, k_ptr, v_ptr, off, d, k_ok, d_ok, k_ok[None, :], m, l, acc,
                                 scale_log2, UPCAST, PREC)
    # An empty split (or a padded row with seq_len 0) leaves l == 0: output 0, weight 0.
    nonempty = l > 0
    out = acc / tl.where(nonempty, l, 1.0)[:, None]
    mask = g_ok[:, None] & d_ok[None, :]
    if SPLITS == 1:
        tl.store(o_ptr + b * s_o_b + head[:, None] * s_o_head + d[None, :], out, mask=mask)
    else:
        row = (b * H + head) * SPLITS + sp
        tl.store(po_ptr + row[:, None] * D + d[None, :], out, mask=mask)
        lse = tl.where(nonempty, m + tl.log2(tl.where(nonempty, l, 1.0)), float("-inf"))
        tl.store(plse_ptr + row, lse, mask=g_ok)


@triton.jit
def _decode_reduce_kernel(o_ptr, po_ptr, plse_ptr, s_o_b, s_o_head, H: tl.constexpr,
                          D: tl.constexpr, DP: tl.constexpr, SPLITS: tl.constexpr,
                          SP: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SP)
    s_ok = s < SPLITS
    row = (b * H + h) * SPLITS + s
    lse = tl.load(plse_ptr + row, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top > float("-inf"), top, 0.0)      # all splits empty: every weight is 0
    w = tl.exp2(lse - top)
    d = tl.arange(0, DP)
    po = tl.load(po_ptr + row[:, None] * D + d[None, :], mask=s_ok[:, None] & (d < D)[None, :],
                 other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * po, 0) / tl.where(total > 0, total, 1.0)
    tl.store(o_ptr + b * s_o_b + h * s_o_head + d, out, mask=d < D)


def num_decode_splits(batch: int, num_kv_heads: int, max_seq_len: int) -> int:
    """How many partitions each decode context is cut into (flash-decoding)."""
    by_len = triton.cdiv(max(max_seq_len, 1), _MIN_SPLIT_TOKENS)
    by_occupancy = triton.cdiv(_TARGET_PROGRAMS, max(batch * num_kv_heads, 1))
    return max(1, min(MAX_SPLITS, by_len, by_occupancy))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float,
                           max_seq_len: int | None = None, num_splits: int | None = None,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per request (at position seq_lens[b] - 1) over its paged context.

    q [B, H, D] -> out [B, H, D]. num_splits defaults from max_seq_len (pass it: reading it from
    seq_lens would synchronise). A request with seq_len 0 gets zeros.
    """
    bsz, h, d = q.shape
    kvh = k_cache.shape[2]
    _check_cache(k_cache, kvh, d)
    _check_cache(v_cache, kvh, d)
    g = h // kvh
    out = torch.empty_like(q) if out is None else out
    assert q.stride(2) == 1 and out.stride(2) == 1 and h == g * kvh and block_table.stride(1) == 1
    if bsz == 0:
        return out
    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        num_splits = num_decode_splits(bsz, kvh, max_seq_len)
    if num_splits > 1:
        partial = torch.empty(bsz, h, num_splits, d, dtype=torch.float32, device=q.device)
        lse = torch.empty(bsz, h, num_splits, dtype=torch.float32, device=q.device)
    else:
        partial = lse = out         # unused: the split kernel writes out directly
    _decode_split_kernel[(bsz, kvh, num_splits)](
        q, k_cache, v_cache, out, partial, lse, seq_lens, block_table, scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
        H=h, G=g, GP=max(16, triton.next_power_of_2(g)), D=d, DP=_dp(d), BS=k_cache.shape[1],
        TILE_N=64, SPLITS=num_splits, UPCAST=INTERPRETED, PREC=_prec(q.dtype))
    if num_splits > 1:
        _decode_reduce_kernel[(bsz, h)](out, partial, lse, out.stride(0), out.stride(1), H=h, D=d,
                                        DP=_dp(d), SPLITS=num_splits,
                                        SP=triton.next_power_of_2(num_splits))
    return out


def _dp(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def _stages(dtype: torch.dtype) -> int:
    # float32 K and V tiles of 64 x 128 are 32 KiB each: three stages would not fit in
    # shared memory next to Q.
    return 2 if dtype == torch.float32 else 3


def _prec(dtype: torch.dtype) -> str:
    # float32 inputs would otherwise be rounded to tf32 by the tensor cores.
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_cache(cache: torch.Tensor, kvh: int, d: int) -> None:
    nb, bs, ch, cd = cache.shape
    if (ch, cd) != (kvh, d):
        raise ValueError(f"cache holds {ch} heads of {cd}, the keys {kvh} of {d}")
    if cache.stride() != (bs * kvh * d, kvh * d, d, 1):
        raise ValueError("each K and V cache must be contiguous [blocks, block_size, heads, dim]")


__all__ = ["store_kvcache", "paged_prefill_attention", "paged_decode_attention",
           "num_decode_splits", "INTERPRETED", "MAX_SPLITS"]
