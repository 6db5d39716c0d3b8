"""The sampler of the CUDA runner: the same draws as Sampler (exponential race, per-request seeds)
on GPU tensors, with one device->host transfer per step: the final token ids.

Host-side values (temperatures, top-k/top-p, the greedy mask) go up from pinned memory without
blocking. A seeded request draws its noise on the CPU with its own generator, as on the CPU path,
so its tokens do not depend on what else is in the batch.
"""
from __future__ import annotations

import torch

from kvflow.model.h2d import host, upload
from kvflow.model.sampler import _apply_top_k_top_p, ban_tokens
from kvflow.sampling_params import SamplingParams


class CudaSampler:
    def __init__(self, seed: int, device: str | torch.device) -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    def _up(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        return upload(data, dtype, self.device)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None],
                 banned: list[list[int] | None] | None = None) -> list[int]:
        if banned is not None and any(banned):     # min_tokens: see Sampler
            logits = ban_tokens(logits, banned, lambda ids: self._up(ids, torch.long))
        greedy = [p.greedy for p in params]
        if all(greedy):
            return logits.argmax(dim=-1).tolist()
        x = logits.float()
        temps = self._up([1.0 if p.greedy else p.temperature for p in params],
                         torch.float32)
        x = x / temps[:, None]
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            x = _apply_top_k_top_p(x, top_k, top_p)
        probs = x.softmax(dim=-1)
        q = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, g in enumerate(generators):
            if g is not None:
                row = torch.empty(probs.shape[1]).exponential_(generator=g)
                q[i].copy_(host(row, torch.float32, self.device), non_blocking=True)
        sampled = (probs / q).argmax(dim=-1)
        if any(greedy):
            sampled = torch.where(self._up(greedy, torch.bool), logits.argmax(dim=-1), sampled)
        return sampled.tolist()
