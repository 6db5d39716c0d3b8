"""Plain PyTorch references for the paged attention kernels (CPU, float32), shared by the
interpreter tests (test_triton_kernels.py) and the compiled-kernel tests (test_gpu.py)."""
from __future__ import annotations

import torch

D = 16


def context(cache: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    """Positions 0..n-1 of one request read through its block table: [n, KVH, D] float32."""
    cache, table = cache.cpu(), table.cpu()
    bs = cache.shape[1]
    pos = torch.arange(n)
    return cache[table[pos // bs].long(), pos % bs].float()


def ref_attention(q, k_cache, v_cache, table, q_lens, seq_lens, scale) -> torch.Tensor:
    """Each request's queries sit at the last q_len positions of its seq_len; causal; GQA."""
    outs, start, q = [], 0, q.cpu()
    for r, (ql, sl) in enumerate(zip(q_lens, seq_lens)):
        qq = q[start:start + ql].float()
        g = qq.shape[1] // k_cache.shape[2]
        k = context(k_cache, table[r], sl).repeat_interleave(g, 1)
        v = context(v_cache, table[r], sl).repeat_interleave(g, 1)
        s = torch.einsum("qhd,khd->hqk", qq, k) * scale
        hidden = torch.arange(sl)[None, :] > torch.arange(sl - ql, sl)[:, None]
        s = s.masked_fill(hidden[None], float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v))
        start += ql
    return torch.cat(outs)


def make_cache(num_blocks, bs, kvh, dtype, seed=0, device="cpu", d=D):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(num_blocks, bs, kvh, d, generator=g).to(dtype).to(device)
            for _ in range(2)]


def shuffled_tables(num_reqs, width, num_blocks, seed=0) -> torch.Tensor:
    """Disjoint, non-contiguous, out-of-order blocks for each request."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(num_blocks, generator=g)[:num_reqs * width].view(num_reqs, width).int()
