"""Paged attention behind a small backend interface.

The runner builds one AttentionMetadata per step; the backend's prepare() turns it into whatever
index tensors it wants (once per step, shared by every layer), then forward() runs per layer:
write the new K/V into the paged cache by slot, then attend each request's query tokens to its
whole context read through its block table. Writing before reading is required: a request may
hit prefix blocks whose K/V are computed in this same step (see SchedulerOutput).

Batch order: the runner puts decodes (one query token) first, then prefill chunks.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvflow.model.kernels.cpu_ops import ops


@dataclass(slots=True)
class AttentionMetadata:
    num_tokens: int
    slot_mapping: torch.Tensor          # [num_tokens] flat slot = block_id * block_size + offset
    query_start_loc: list[int]          # cu_seqlens_q, len num_reqs + 1
    seq_lens: list[int]                 # context length of each request after this step
    block_table: torch.Tensor           # [num_reqs, max_blocks], padded with 0
    num_decodes: int                    # the first num_decodes requests have 1 query token
    block_size: int
    num_blocks: int                     # blocks in the cache (K blocks, then V blocks, per layer)
    extra: dict = field(default_factory=dict)   # the backend's per-step precomputation


class AttentionBackend:
    """Interface. kv_cache for a layer is [2, num_blocks, block_size, num_kv_heads, head_dim]:
    its K cache and its V cache, each laid out [num_blocks, block_size, num_kv_heads, head_dim]."""
    name = "abstract"

    def prepare(self, meta: AttentionMetadata) -> None:
        raise NotImplementedError

    def forward(self, q: torch.Tensor, kv: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [T, H, D] and the new keys and values kv [T, 2, KVH, D] -> [T, H, D]."""
        raise NotImplementedError


# A padded batch of prefills is used while its padding wastes at most this factor of work;
# beyond it (one long prompt among short ones) each prefill runs on its own.
_MAX_PAD_WASTE = 2.0
_KERNEL_DTYPES = (torch.bfloat16, torch.float32)


class TorchAttentionBackend(AttentionBackend):
    """CPU (and fallback) backend on torch's scaled_dot_product_attention.

    Every SDPA call is 4-D: with 3-D inputs torch takes its unfused "math" path (8x slower).
    Contexts are gathered a whole block at a time (index_select over the block axis is several
    times faster on CPU than gathering single slots). GQA without copying K/V: the query heads
    that share a KV head are folded into the query-length axis, [B, KVH, G*Lq, D].
    """
    name = "torch"

    def __init__(self, use_kernels: bool | None = None) -> None:
        # Decodes go to kvflow's native paged-decode kernel when it is built (cpu_ops.py): it
        # reads K/V through the block table instead of gathering a dense copy for SDPA.
        if use_kernels is None:
            from kvflow.model.kernels import cpu_ops
            use_kernels = cpu_ops.available()
        self.use_kernels = use_kernels

    def prepare(self, meta: AttentionMetadata) -> None:
        ex = meta.extra
        ex.clear()
        bt, bs = meta.block_table, meta.block_size
        # Reads see the layer's cache as one [2 * num_blocks, ...] tensor: V block b is row
        # num_blocks + b, so one index_select gathers K and V together.
        d = meta.num_decodes
        if d and self.use_kernels:
            ex["d_table"] = bt[:d]
            ex["d_lens"] = torch.tensor(meta.seq_lens[:d], dtype=torch.long)
        elif d:
            self._prepare_gather(meta, ex)
        qsl, lens = meta.query_start_loc, meta.seq_lens
        pre, fresh = [], []
        for i in range(d, len(lens)):
            q_len = qsl[i + 1] - qsl[i]
            if q_len != lens[i]:
                pre.append((i, qsl[i], q_len, lens[i]))
            elif fresh and fresh[-1][1] == q_len and fresh[-1][0] + q_len * fresh[-1][2] == qsl[i]:
                fresh[-1][2] += 1     # same length as the run just before it (a chunk between
                                      # them would leave this prompt's rows unwritten)
            else:
                fresh.append([qsl[i], q_len, 1])
        # Whole prompts (no cached prefix) attend to their own fresh K/V straight from the step's
        # qkv: no gather from the cache, no mask; a run of equal-length prompts is one call.
        ex["p_fresh"] = fresh
        if not pre:
            ex["p_batched"] = None
            ex["p_single"] = []
            return
        max_q = max(p[2] for p in pre)
        max_ctx = max(p[3] for p in pre)
        useful = sum(p[2] * p[3] for p in pre)
        if len(pre) > 1 and len(pre) * max_q * max_ctx <= _MAX_PAD_WASTE * useful:
            ex["p_batched"] = self._prepare_batched(meta, pre, max_q, max_ctx)
            ex["p_single"] = []
        else:
            ex["p_batched"] = None
            ex["p_single"] = [self._prepare_one(meta, p) for p in pre]

    def _prepare_gather(self, meta: AttentionMetadata, ex: dict) -> None:
        d, bs = meta.num_decodes, meta.block_size
        lens = meta.seq_lens[:d]
        nb = -(-max(lens) // bs)
        ex["d_blocks"] = self._kv_rows(meta.block_table[:d, :nb].reshape(-1), meta)
        key_pos = torch.arange(nb * bs)
        ex["d_mask"] = (key_pos[None, :] < torch.tensor(lens)[:, None])[:, None, None, :]

    @staticmethod
    def _kv_rows(blocks: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return torch.cat((blocks, blocks + meta.num_blocks))

    @staticmethod
    def _causal_mask(q_len: int, ctx: int, n_keys: int) -> torch.Tensor:
        # Query i sits at position ctx - q_len + i and sees keys up to and including itself.
        q_pos = torch.arange(ctx - q_len, ctx)[:, None]
        return torch.arange(n_keys)[None, :] <= q_pos

    def _prepare_one(self, meta: AttentionMetadata, p) -> tuple:
        i, start, q_len, ctx = p
        nb = -(-ctx // meta.block_size)
        return (start, q_len, self._kv_rows(meta.block_table[i, :nb], meta),
                self._causal_mask(q_len, ctx, nb * meta.block_size))

    def _prepare_batched(self, meta: AttentionMetadata, pre, max_q: int, max_ctx: int) -> tuple:
        bs = meta.block_size
        nb = -(-max_ctx // bs)
        n_keys = nb * bs
        rows = torch.tensor([p[0] for p in pre])
        q_idx = torch.zeros(len(pre), max_q, dtype=torch.long)
        mask = torch.zeros(len(pre), max_q, n_keys, dtype=torch.bool)
        for j, (_, start, q_len, ctx) in enumerate(pre):
            q_idx[j, :q_len] = torch.arange(start, start + q_len)
            mask[j, :q_len] = self._causal_mask(q_len, ctx, n_keys)
            mask[j, q_len:, 0] = True       # padded query rows need one key or SDPA gives NaN
        q_lens = [p[2] for p in pre]
        valid = torch.cat([torch.arange(j * max_q, j * max_q + n) for j, n in enumerate(q_lens)])
        out_idx = torch.cat([torch.arange(p[1], p[1] + p[2]) for p in pre])
        blocks = self._kv_rows(meta.block_table[rows, :nb].reshape(-1), meta)
        return q_idx, mask[:, None], blocks, nb, valid, out_idx

    def forward(self, q, kv, kv_cache, meta, scale):
        _, _, bs, kvh, hd = kv_cache.shape
        n = meta.num_tokens
        ex = meta.extra
        slots = meta.slot_mapping
        if self.use_kernels and kv_cache.dtype in _KERNEL_DTYPES and not kv_cache.is_cuda:
            ops.store_kv_(kv_cache, kv, slots)
        else:   # two index_copy_ calls: index_put_ with a [T, 2] index is ~50x slower on CPU
            kv_cache[0].view(-1, kvh, hd).index_copy_(0, slots, kv[:n, 0])
            kv_cache[1].view(-1, kvh, hd).index_copy_(0, slots, kv[:n, 1])
        cache = kv_cache.view(-1, bs, kvh, hd)      # [2 * num_blocks, bs, kvh, hd]
        g = q.shape[1] // kvh
        d = meta.num_decodes
        out = torch.empty_like(q) if d < n else None
        if d and "d_table" in ex and kv_cache.dtype in _KERNEL_DTYPES and not kv_cache.is_cuda:
            o = ops.paged_decode(q[:d], kv_cache, ex["d_table"], ex["d_lens"], scale)
            if d == n:
                return o
            out[:d] = o
        elif d:
            if "d_blocks" not in ex:     # kernels on, but not for this dtype: once per step
                self._prepare_gather(meta, ex)
            keys, vals = cache.index_select(0, ex["d_blocks"]).view(2, d, -1, kvh, hd).transpose(2, 3)
            qd = q[:d].view(d, kvh, g, hd)
            o = F.scaled_dot_product_attention(qd, keys, vals, attn_mask=ex["d_mask"],
                                               scale=scale)
            if d == n:
                return o.view(d, kvh * g, hd)       # decodes only: no copy into `out`
            out[:d] = o.reshape(d, kvh * g, hd)
        for start, q_len, count in ex["p_fresh"]:
            end = start + q_len * count
            qs = q[start:end].view(count, q_len, kvh * g, hd).transpose(1, 2)
            new = kv[start:end].view(count, q_len, 2, kvh, hd)
            o = F.scaled_dot_product_attention(
                qs, new[:, :, 0].transpose(1, 2), new[:, :, 1].transpose(1, 2), is_causal=True,
                scale=scale, enable_gqa=True)
            out[start:end] = o.transpose(1, 2).reshape(end - start, kvh * g, hd)
        if ex["p_batched"] is not None:
            self._forward_batched(q, out, cache, ex["p_batched"], kvh, g, hd, scale)
        for start, q_len, blocks, mask in ex["p_single"]:
            qs = q[start:start + q_len].transpose(0, 1)        # [H, q_len, hd]
            keys, vals = cache.index_select(0, blocks).view(2, -1, kvh, hd).transpose(1, 2)
            o = F.scaled_dot_product_attention(qs.reshape(1, kvh, g * q_len, hd), keys[None],
                                               vals[None], attn_mask=mask.repeat(g, 1),
                                               scale=scale)
            out[start:start + q_len] = o.view(kvh, g, q_len, hd).permute(2, 0, 1, 3).reshape(
                q_len, kvh * g, hd)
        return out

    @staticmethod
    def _forward_batched(q, out, cache, prep, kvh, g, hd, scale):
        q_idx, mask, blocks, nb, valid, out_idx = prep
        p, max_q = q_idx.shape
        qp = q[q_idx.view(-1)].view(p, max_q, kvh, g, hd).permute(0, 2, 3, 1, 4)
        keys, vals = cache.index_select(0, blocks).view(2, p, -1, kvh, hd).transpose(2, 3)
        o = F.scaled_dot_product_attention(qp.reshape(p, kvh, g * max_q, hd), keys, vals,
                                           attn_mask=mask.repeat(1, 1, g, 1), scale=scale)
        o = o.view(p, kvh, g, max_q, hd).permute(0, 3, 1, 2, 4).reshape(p * max_q, kvh * g, hd)
        out[out_idx] = o[valid]
