"""The Triton attention backend: the CUDA path's attention, also runnable on CPU tensors under
TRITON_INTERPRET=1 (that is how it is tested without a GPU).

prepare() moves the step's index tensors to the cache's device once (int32, from pinned host
memory without blocking on CUDA); forward() per layer stores the new K/V by slot, then runs the
split-K decode kernel on the leading decodes and the varlen prefill kernel on the rest, both
writing into one output tensor.
"""
from __future__ import annotations

import torch

from kvflow.model.attention.backend import AttentionBackend, AttentionMetadata
from kvflow.model.runner.h2d import upload


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self, device: str | torch.device = "cpu") -> None:
        from kvflow.model.attention import triton_attention       # triton is an optional dependency
        self.ops = triton_attention
        self.device = torch.device(device)
        if self.device.type == "cpu" and not triton_attention.INTERPRETED:
            raise ValueError("attention_backend='triton' on device 'cpu' runs only under the "
                             "Triton interpreter: set TRITON_INTERPRET=1 before kvflow imports "
                             "triton (slow; meant for tests)")

    def prepare(self, meta: AttentionMetadata) -> None:
        ex = meta.extra
        ex.clear()
        n_req, d = len(meta.seq_lens), meta.num_decodes
        ints = upload(meta.query_start_loc + meta.seq_lens, torch.int32, self.device)
        qsl, lens = ints[:n_req + 1], ints[n_req + 1:]
        bt = upload(meta.block_table, torch.int32, self.device)
        ex["slots"] = upload(meta.slot_mapping, torch.int64, self.device)
        ex["decode"] = (lens[:d], bt[:d], max(meta.seq_lens[:d])) if d else None
        ex["prefill"] = None
        if d < n_req:
            qs = meta.query_start_loc
            max_q = max(qs[i + 1] - qs[i] for i in range(d, n_req))
            ex["prefill"] = (qsl[d:], lens[d:], bt[d:], max_q)

    def bind_decode(self, meta: AttentionMetadata, slot_mapping: torch.Tensor,
                    block_table: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int) -> None:
        """A decode-only step over device tensors the caller owns (CUDA graphs' static inputs).
        max_seq_len bounds every context; it fixes the number of decode splits."""
        meta.extra.clear()
        meta.extra.update(slots=slot_mapping, decode=(seq_lens, block_table, max_seq_len),
                          prefill=None)

    def forward(self, q, kv, kv_cache, meta, scale):
        ops, ex = self.ops, meta.extra
        n = meta.num_tokens
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        ops.store_kvcache(kv[:n, 0], kv[:n, 1], k_cache, v_cache, ex["slots"])
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if ex["decode"] is not None:
            lens, bt, max_len = ex["decode"]
            d = lens.shape[0]
            ops.paged_decode_attention(q[:d], k_cache, v_cache, lens, bt, scale,
                                       max_seq_len=max_len, out=out[:d])
        if ex["prefill"] is not None:
            qsl, lens, bt, max_q = ex["prefill"]
            ops.paged_prefill_attention(q, k_cache, v_cache, qsl, lens, bt, scale, max_q, out=out)
        return out
