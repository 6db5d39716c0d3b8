"""What a request's parameters do to its logits before sampling (vLLM's order): a static bias
(allowed_token_ids, single-token bad_words, logit_bias), then the penalties. Batched: one gather,
a few elementwise ops and one scatter per step, whatever the number of requests.

Token counts for the penalties live in one [slots, vocab] tensor (plus a prompt mask for the
repetition penalty); a request with penalties holds a slot while the runner holds the request,
and each step's sampled tokens are added with one index_put_.
"""
from __future__ import annotations

import torch

from kvflow.sampling_params import SamplingParams


def static_bias(sp: SamplingParams, vocab: int) -> torch.Tensor | None:
    """A [vocab] float32 row added to the logits every step, or None when sp asks for nothing:
    -inf outside allowed_token_ids and on single-token bad words, plus logit_bias."""
    single = [w[0] for w in sp.bad_words_token_ids or () if len(w) == 1]
    if not (sp.logit_bias or sp.allowed_token_ids or single):
        return None
    b = torch.zeros(vocab)
    if sp.allowed_token_ids:
        b.fill_(float("-inf"))
        b[torch.tensor(sp.allowed_token_ids)] = 0.0
    if sp.logit_bias:
        b[torch.tensor(list(sp.logit_bias))] += torch.tensor(list(sp.logit_bias.values()))
    if single:
        b[torch.tensor(single)] = float("-inf")
    return b


def bad_word_bans(sp: SamplingParams, output_ids: list[int]) -> list[int]:
    """Last tokens of multi-token bad words whose other tokens end the output (vLLM's rule)."""
    out = []
    for w in sp.bad_words_token_ids or ():
        n = len(w) - 1
        if n and len(output_ids) >= n and output_ids[len(output_ids) - n:] == w[:-1]:
            out.append(w[-1])
    return out


class TokenCounts:
    """Output token counts and prompt masks of the requests with penalties, by slot."""

    def __init__(self, vocab: int, device: torch.device) -> None:
        self.vocab, self.device = vocab, device
        self.counts = torch.zeros(0, vocab, dtype=torch.int32, device=device)
        self.prompt = torch.zeros(0, vocab, dtype=torch.bool, device=device)
        self.free: list[int] = []

    def add(self, prompt_ids: list[int], output_ids: list[int]) -> int:
        if not self.free:
            self._grow()
        s = self.free.pop()
        self.counts[s].zero_()
        self.prompt[s].zero_()
        dev = self.device
        if prompt_ids:
            self.prompt[s, torch.tensor(prompt_ids, device=dev)] = True
        if output_ids:
            self.counts[s] = torch.bincount(torch.tensor(output_ids, device=dev),
                                            minlength=self.vocab).to(torch.int32)
        return s

    def _grow(self) -> None:
        n = self.counts.shape[0]
        extra = max(8, n)
        self.counts = torch.cat([self.counts, self.counts.new_zeros(extra, self.vocab)])
        self.prompt = torch.cat([self.prompt, self.prompt.new_zeros(extra, self.vocab)])
        self.free.extend(range(n + extra - 1, n - 1, -1))

    def release(self, slot: int) -> None:
        self.free.append(slot)

    def record(self, slots: list[int], tokens: list[int]) -> None:
        """Count sampled tokens (slots[i] sampled tokens[i]), in one op."""
        if slots:
            dev = self.device
            self.counts.index_put_((torch.tensor(slots, device=dev),
                                    torch.tensor(tokens, device=dev)),
                                   torch.ones(len(slots), dtype=torch.int32, device=dev),
                                   accumulate=True)

    def apply(self, logits: torch.Tensor, rows: list[int], slots: list[int],
              params: list[SamplingParams]) -> None:
        """Penalise logits[rows] in place (float32 logits): repetition over prompt and output
        (positive logits divided, negative multiplied), frequency and presence over the output."""
        dev = logits.device
        r = torch.tensor(rows, device=dev)
        s = torch.tensor(slots, device=dev)
        x = logits[r]
        counts = self.counts[s]
        seen_out = counts > 0
        rep = torch.tensor([p.repetition_penalty for p in params], device=dev)[:, None]
        if (rep != 1).any():
            seen = seen_out | self.prompt[s]
            x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        freq = torch.tensor([p.frequency_penalty for p in params], device=dev)[:, None]
        pres = torch.tensor([p.presence_penalty for p in params], device=dev)[:, None]
        x = x - freq * counts - pres * seen_out
        logits[r] = x
