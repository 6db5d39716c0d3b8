"""Sampling: greedy, temperature, top-k, top-p, and per-request seeds.

Sampling from softmax(logits) is done as argmax(probs / q) with q ~ Exp(1) (the exponential race,
equivalent to a multinomial draw), so a seeded request only needs its own generator to draw q and
its tokens do not depend on what else is in the batch.
"""
from __future__ import annotations

import torch

from kvflow.sampling_params import SamplingParams


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        from kvflow.model import cpu_ops
        # Greedy rows in one pass over the logits (cpu_layers.cpp), cheaper than torch's max.
        self._argmax = torch.ops.kvflow.argmax_rows if cpu_ops.available() else None

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None],
                 banned: list[list[int] | None] | None = None) -> list[int]:
        """logits [N, V] (any float dtype) -> one token id per row. banned[i]: token ids row i
        may not produce (EOS and stop tokens below min_tokens)."""
        if banned is not None and any(banned):
            logits = ban_tokens(logits, banned)
        greedy = [p.greedy for p in params]
        if all(greedy):
            if (self._argmax is not None and logits.device.type == "cpu" and logits.dim() == 2
                    and logits.dtype in (torch.bfloat16, torch.float32) and logits.stride(1) == 1):
                return self._argmax(logits).tolist()
            # max(dim) returns the first maximal index like argmax, and is faster on CPU.
            return logits.max(dim=-1).indices.tolist()
        logits = logits.float()
        n = logits.shape[0]
        temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params],
                             dtype=logits.dtype)
        x = logits / temps[:, None]
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            x = _apply_top_k_top_p(x, top_k, top_p)
        probs = x.softmax(dim=-1)
        q = torch.empty_like(probs)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if unseeded:
            q[unseeded] = torch.empty(len(unseeded), probs.shape[1]).exponential_(
                generator=self.generator)
        for i, g in enumerate(generators):
            if g is not None:
                q[i].exponential_(generator=g)
        sampled = (probs / q).max(dim=-1).indices
        if any(greedy):
            sampled = torch.where(torch.tensor(greedy), logits.max(dim=-1).indices, sampled)
        assert sampled.shape[0] == n
        return sampled.tolist()


def _cpu_index(ids: list[int]) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long)


def ban_tokens(logits: torch.Tensor, banned: list[list[int] | None],
               index=_cpu_index) -> torch.Tensor:
    """A copy of logits with banned[i] set to -inf in row i, as vLLM's MinTokensLogitsProcessor
    does: the greedy argmax and the draw then can never pick them. `index` builds the index
    tensors (the CUDA sampler uploads them from pinned memory)."""
    rows = [i for i, b in enumerate(banned) if b for _ in b]
    cols = [t for b in banned if b for t in b]
    out = logits.clone()
    out[index(rows), index(cols)] = float("-inf")
    return out


def _apply_top_k_top_p(x: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    vocab = x.shape[1]
    sorted_x, idx = x.sort(dim=-1, descending=False)
    if any(k > 0 for k in top_k):
        k = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=x.device)
        kth = sorted_x.gather(1, (vocab - k)[:, None])      # the k-th largest value
        sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    if any(p < 1.0 for p in top_p):
        p = torch.tensor(top_p, dtype=x.dtype, device=x.device)
        cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
        # Drop the low tail whose mass is at most 1 - p; the top token always stays.
        drop = cum <= (1 - p)[:, None]
        drop[:, -1] = False
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(1, idx, sorted_x)
