"""Incremental detokenization and stop strings.

Decoding one token at a time is wrong for byte-level BPE (a character can span tokens) and for
SentencePiece (a token's leading space depends on its neighbours), so, as vLLM does, each step
decodes a short window twice, with and without the new tokens, and emits the difference once it
no longer ends in an incomplete character (U+FFFD).
"""
from __future__ import annotations

from kvflow.engine.tokenizer import Tokenizer

# Tokens of context kept before the unread ones; enough for any merge to settle.
_CONTEXT = 6


class IncrementalDetokenizer:
    __slots__ = ("tokenizer", "ids", "prefix_offset", "read_offset", "text", "stop",
                 "max_stop_len", "stop_reason", "min_tokens", "num_out")

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop: list[str],
                 min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_token_ids[-_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.stop = stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.stop_reason: str | None = None
        # As in vLLM, stop strings only count once min_tokens tokens are out (like EOS does).
        self.min_tokens = min_tokens
        self.num_out = 0

    def update(self, new_token_ids: list[int]) -> bool:
        """Append tokens; returns True when a stop string matched (text is then cut before it)."""
        dec = self.tokenizer.decode
        for t in new_token_ids:
            self.ids.append(t)
            self.num_out += 1
            prefix = dec(self.ids[self.prefix_offset:self.read_offset])
            full = dec(self.ids[self.prefix_offset:])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                start = len(self.text)
                self.text += full[len(prefix):]
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.ids)
                if self.stop and self.num_out >= self.min_tokens and self._check_stop(start):
                    return True
        return False

    def _check_stop(self, new_from: int) -> bool:
        # A stop string may straddle the previous text and the new piece.
        lo = max(0, new_from - self.max_stop_len + 1)
        best = None
        for s in self.stop:
            i = self.text.find(s, lo)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        self.text = self.text[:best[0]]
        self.stop_reason = best[1]
        return True
