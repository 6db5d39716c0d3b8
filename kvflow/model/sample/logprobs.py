"""Logprobs of chosen tokens, with their rank and the top-k alternatives, from the model's raw
logits (log-softmax before any penalty, bias, temperature or top-k/top-p: vLLM's default).

One entry per token: ([token, top-1, ..., top-k], [its logprob, theirs...], rank), rank being
1 + the number of tokens strictly more likely (vLLM's). A plain tuple: it crosses the process
boundary as msgpack as it is.
"""
from __future__ import annotations

import torch

LogprobEntry = tuple[list[int], list[float], int]

# Rows per log-softmax: a 2048-token prefill chunk's prompt logprobs would otherwise hold two
# [2048, vocab] float32 copies at once (~800 MB at a 49k vocab).
_ROWS = 256


def token_logprobs(logits: torch.Tensor, tokens: list[int], k: list[int]) -> list[LogprobEntry]:
    """logits [m, V] (any float dtype), tokens[i] the token chosen after row i, k[i] how many
    top alternatives row i reports."""
    out: list[LogprobEntry] = []
    for a in range(0, len(tokens), _ROWS):
        b = min(a + _ROWS, len(tokens))
        out += _block(logits[a:b], tokens[a:b], k[a:b])
    return out


def _block(logits: torch.Tensor, tokens: list[int], k: list[int]) -> list[LogprobEntry]:
    lp = logits.float().log_softmax(dim=-1)
    t = torch.tensor(tokens, device=lp.device)[:, None]
    tok_lp = lp.gather(1, t)
    ranks = ((lp > tok_lp).sum(dim=-1) + 1).tolist()
    tok_lp = tok_lp[:, 0].tolist()
    kmax = max(k)
    if kmax:
        top_v, top_i = lp.topk(kmax, dim=-1)
        top_v, top_i = top_v.tolist(), top_i.tolist()
    out = []
    for i, (tok, n) in enumerate(zip(tokens, k)):
        ids, vals = [tok], [tok_lp[i]]
        if n:
            ids += top_i[i][:n]
            vals += top_v[i][:n]
        out.append((ids, vals, ranks[i]))
    return out
