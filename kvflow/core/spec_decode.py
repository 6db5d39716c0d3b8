"""N-gram draft proposer (prompt lookup decoding): the next tokens are guessed by finding the
request's last few tokens earlier in its own prompt and output, and copying what followed.

Each request keeps an index from every n-gram (prompt_lookup_min <= n <= prompt_lookup_max) to
where its latest occurrence ends, extended with the tokens appended since the last proposal, so
a proposal costs O(new tokens), not a scan of the whole sequence.
"""
from __future__ import annotations

from collections.abc import Iterable

from kvflow.core.config import SpeculativeConfig
from kvflow.core.request import Request


class NgramIndex:
    __slots__ = ("first", "latest", "indexed_to")

    def __init__(self) -> None:
        # n-gram -> where its first and its latest occurrence end
        self.first: dict[tuple[int, ...], int] = {}
        self.latest: dict[tuple[int, ...], int] = {}
        self.indexed_to = 0     # the n-grams ending at positions < this are indexed


def draft_room(req: Request, k: int, max_model_len: int) -> int:
    """How many drafts req may verify next step: none unless it is decoding (has sampled a token
    and has nothing but that token left to compute; not one re-running its prefill after a
    preemption), at most k, and few enough that the accepted drafts plus the one token every
    step emits never pass max_tokens or max_model_len."""
    num_tokens = len(req.all_token_ids)
    if not req.output_token_ids or req.num_computed_tokens != num_tokens - 1:
        return 0
    room = min(req.max_tokens - len(req.output_token_ids), max_model_len - num_tokens) - 1
    return max(0, min(k, room))


class NgramProposer:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len

    def propose(self, requests: Iterable[Request], num_running: int) -> dict[str, list[int]]:
        """Drafts for each request with draft_room, from lookup."""
        k = self.config.num_drafts_for(num_running)
        if k == 0:
            return {}
        out = {}
        for req in requests:
            if req.sampling_params.needs_history:   # drafts would be verified without it
                continue
            n = draft_room(req, k, self.max_model_len)
            drafts = self.lookup(req, n) if n else []
            if drafts:
                out[req.request_id] = drafts
        return out

    def lookup(self, req: Request, k: int) -> list[int]:
        """Up to k tokens that followed an earlier occurrence of the longest suffix
        (prompt_lookup_max down to prompt_lookup_min tokens) of req.all_token_ids: the latest
        occurrence, unless it ends too close to the end to give k tokens (a repeating run), then
        the first."""
        c = self.config
        toks = req.all_token_ids
        end = len(toks)
        idx = req.ngram_index
        if idx is None:
            idx = req.ngram_index = NgramIndex()
        # Index the n-grams ending before `end` (the suffix itself must not match itself).
        first, latest = idx.first, idx.latest
        lo, hi = c.prompt_lookup_min, c.prompt_lookup_max
        for j in range(max(idx.indexed_to, lo), end):
            for n in range(lo, min(hi, j) + 1):
                key = tuple(toks[j - n:j])
                latest[key] = j
                first.setdefault(key, j)
        idx.indexed_to = max(idx.indexed_to, end)
        for n in range(min(hi, end - 1), lo - 1, -1):
            key = tuple(toks[end - n:end])
            j = latest.get(key)
            if j is not None:
                if end - j < k:
                    j = first[key]
                return toks[j:j + k]
        return []
