"""Sampling: greedy, temperature, top-k, top-p, and per-request seeds, on CPU or a GPU.

Sampling from softmax(logits) is done as argmax(probs / q) with q ~ Exp(1) (the exponential race,
equivalent to a multinomial draw), so a seeded request only needs its own generator to draw q and
its tokens do not depend on what else is in the batch. Seeded requests draw on CPU generators on
either device, so a seed gives the same tokens on both.

On a GPU the only device->host transfer is the final token ids: host-side values (temperatures,
the greedy mask, banned ids) go up from pinned memory without blocking (h2d.upload).
"""
from __future__ import annotations

import torch

from kvflow.model.runner.h2d import host, upload
from kvflow.sampling_params import SamplingParams


class Sampler:
    def __init__(self, seed: int = 0, device: str | torch.device = "cpu",
                 batch_noise: bool | None = None) -> None:
        """batch_noise (default: on a GPU): draw the noise of the whole batch at once and copy
        seeded rows over it, which needs no host-built index; else draw each row in place."""
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.batch_noise = self.device.type != "cpu" if batch_noise is None else batch_noise
        self._argmax_rows = None
        if self.device.type == "cpu":
            from kvflow.model.kernels import cpu_ops
            # Greedy rows in one pass over the logits (cpu_layers.cpp), cheaper than torch's max.
            self._argmax_rows = cpu_ops.ops.argmax_rows if cpu_ops.available() else None

    def _up(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        return upload(data, dtype, self.device)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None],
                 banned: list[list[int] | None] | None = None) -> list[int]:
        """logits [N, V] (any float dtype) -> one token id per row. banned[i]: token ids row i
        may not produce (EOS and stop tokens below min_tokens)."""
        if banned is not None and any(banned):
            logits = ban_tokens(logits, banned)
        greedy = [p.greedy for p in params]
        if all(greedy):
            return self._greedy(logits).tolist()
        logits = logits.float()
        n = logits.shape[0]
        probs = self._probs(logits, params)
        sampled = _argmax(probs / self._noise(probs, generators))
        if any(greedy):
            sampled = torch.where(self._up(greedy, torch.bool), _argmax(logits), sampled)
        assert sampled.shape[0] == n
        return sampled.tolist()

    def _probs(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """The distribution each row samples from: temperature, min_p, then top-k and top-p."""
        temps = self._up([1.0 if p.greedy else p.temperature for p in params], torch.float32)
        x = logits / temps[:, None]
        min_p = [p.min_p for p in params]
        if any(min_p):      # drop tokens less likely than min_p times the most likely one
            probs = x.softmax(dim=-1)
            thresh = probs.amax(dim=-1, keepdim=True) * self._up(min_p, torch.float32)[:, None]
            x = x.masked_fill(probs < thresh, float("-inf"))
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            x = _apply_top_k_top_p(x, top_k, top_p)
        return x.softmax(dim=-1)

    def verify(self, logits: torch.Tensor, params: list[SamplingParams],
               generators: list[torch.Generator | None], drafts: list[list[int]],
               banned: list[list[int] | None] | None = None) -> list[list[int]]:
        """Check draft tokens against the model: request i owns len(drafts[i]) + 1 consecutive
        logits rows (the rows before each draft, then the bonus row) and gets back its accepted
        drafts plus one token. Greedy rows accept a draft that is the argmax. Sampled rows use
        rejection sampling for a one-hot draft distribution: draft d is accepted with
        probability p(d), else the token is drawn from p with d removed, so every token is
        distributed exactly as without drafts. banned is per row."""
        counts = [len(d) + 1 for d in drafts]
        rows = [p for p, c in zip(params, counts) for _ in range(c)]
        if banned is not None and any(banned):
            logits = ban_tokens(logits, banned)
        if all(p.greedy for p in params):
            return _accept(drafts, counts, self._greedy(logits).tolist(), None)
        logits = logits.float()
        probs = self._probs(logits, rows)
        flat = [t for d in drafts for t in (*d, -1)]
        draft_rows = [i for i, t in enumerate(flat) if t >= 0]
        draft_toks = [flat[i] for i in draft_rows]
        r, t = self._up(draft_rows, torch.long), self._up(draft_toks, torch.long)
        p_draft = torch.zeros(len(flat), device=probs.device)
        p_draft[r] = probs[r, t]
        probs[r, t] = 0.0       # the residual: drawn from only where the draft was rejected
        row_gens = [g for g, c in zip(generators, counts) for _ in range(c)]
        sampled = _argmax(probs / self._noise(probs, row_gens))
        greedy_rows = [p.greedy for p in rows]
        if any(greedy_rows):
            sampled = torch.where(self._up(greedy_rows, torch.bool), _argmax(logits), sampled)
        # A greedy row accepts a draft iff it is the argmax: p = 1 then, 0 otherwise.
        accept_p = p_draft.tolist()
        sampled = sampled.tolist()
        for i, g in enumerate(greedy_rows):
            if g:
                accept_p[i] = 1.0 if flat[i] == sampled[i] else 0.0
        u = self._uniforms(counts, generators, probs.device)
        return _accept(drafts, counts, sampled, [a > x for a, x in zip(accept_p, u)])

    def _uniforms(self, counts: list[int], generators: list[torch.Generator | None],
                  device: torch.device) -> list[float]:
        """One U[0, 1) draw per row; a seeded request's from its own generator."""
        out = torch.rand(sum(counts), device=device, generator=self.generator).tolist()
        o = 0
        for c, g in zip(counts, generators):
            if g is not None:
                out[o:o + c] = torch.rand(c, generator=g).tolist()
            o += c
        return out

    def _greedy(self, logits: torch.Tensor) -> torch.Tensor:
        if (self._argmax_rows is not None and logits.device.type == "cpu" and logits.dim() == 2
                and logits.dtype in (torch.bfloat16, torch.float32) and logits.stride(1) == 1):
            return self._argmax_rows(logits)
        return _argmax(logits)

    def _noise(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        """Exp(1) noise shaped like probs: a seeded row's from its own (CPU) generator, the other
        rows' from the sampler's."""
        if self.batch_noise:
            q = torch.empty_like(probs).exponential_(generator=self.generator)
            for i, g in enumerate(generators):
                if g is not None:       # drawn on the host, copied up without blocking
                    row = torch.empty(probs.shape[1]).exponential_(generator=g)
                    q[i].copy_(host(row, torch.float32, q.device), non_blocking=True)
            return q
        q = torch.empty_like(probs)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if unseeded:
            q[unseeded] = torch.empty(len(unseeded), probs.shape[1]).exponential_(
                generator=self.generator)
        for i, g in enumerate(generators):
            if g is not None:
                q[i].exponential_(generator=g)
        return q


def _accept(drafts: list[list[int]], counts: list[int], sampled: list[int],
            accepted: list[bool] | None) -> list[list[int]]:
    """Each request's accepted drafts, then the sampled token of the first rejected row (or of
    the bonus row). accepted None: greedy, a draft is accepted iff it equals the sampled token."""
    out, o = [], 0
    for d, c in zip(drafts, counts):
        toks = []
        for j, t in enumerate(d):
            if (t == sampled[o + j]) if accepted is None else accepted[o + j]:
                toks.append(t)
            else:
                break
        toks.append(sampled[o + len(toks)])
        out.append(toks)
        o += c
    return out


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """The first maximal index of each row. On CPU max(dim) gives the same index as argmax,
    faster."""
    return x.max(dim=-1).indices if x.device.type == "cpu" else x.argmax(dim=-1)


def ban_tokens(logits: torch.Tensor, banned: list[list[int] | None]) -> torch.Tensor:
    """A copy of logits with banned[i] set to -inf in row i, as vLLM's MinTokensLogitsProcessor
    does: the greedy argmax and the draw then can never pick them."""
    rows = [i for i, b in enumerate(banned) if b for _ in b]
    cols = [t for b in banned if b for t in b]
    out = logits.clone()
    out[upload(rows, torch.long, out.device), upload(cols, torch.long, out.device)] = float("-inf")
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
