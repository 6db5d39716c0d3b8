"""Per-request sampling and stopping parameters, with vLLM's field names and defaults.

Every field is checked here, where both LLM and the server build them, so a bad value is a
ValueError naming the field before the engine sees it (nothing a client sends may fail a step).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

# As in vLLM: a temperature below this is greedy (dividing by it would overflow the logits).
_SAMPLING_EPS = 1e-5
# What torch.Generator.manual_seed takes; a negative seed wraps modulo 2**64, as in torch.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _finite(x) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:       # an int too large for a float
        return False


def short_repr(x) -> str:
    """repr for messages; a huge int has no str() in Python >= 3.11 (and would flood a reply)."""
    if _is_int(x) and x.bit_length() > 128:
        return f"an int of {x.bit_length()} bits"
    r = repr(x)
    return r if len(r) <= 200 else r[:200] + "..."


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0          # below 1e-5 (e.g. 0) means greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 (or vLLM's -1) means off
    seed: int | None = None
    max_tokens: int | None = 16       # None: until max_model_len
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not _is_num(self.temperature) or not _finite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, "
                             f"got {short_repr(self.temperature)}")
        if not _is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {short_repr(self.top_p)}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= 0 (0 or -1 disables it), "
                             f"got {short_repr(self.top_k)}")
        if self.top_k == -1:
            self.top_k = 0
        self.check_seed()
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an int >= 1 (or None), "
                             f"got {short_repr(self.max_tokens)}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {short_repr(self.min_tokens)}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({short_repr(self.min_tokens)}) must be <= max_tokens "
                             f"({short_repr(self.max_tokens)})")
        self._check_stops()
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {short_repr(self.ignore_eos)}")

    def _check_stops(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if not isinstance(self.stop, (list, tuple)) or not all(
                isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, "
                             f"got {short_repr(self.stop)}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not isinstance(self.stop_token_ids, (list, tuple, set)):
            raise ValueError(f"stop_token_ids must be a list of non-negative ints, "
                             f"got {short_repr(self.stop_token_ids)}")
        bad = [t for t in self.stop_token_ids if not _is_int(t) or t < 0]
        if bad:
            raise ValueError(f"stop_token_ids must be a list of non-negative ints, "
                             f"got {short_repr(bad[0])} in it")
        self.stop_token_ids = list(self.stop_token_ids)

    def check_seed(self) -> None:
        """Also called by the frontend: a seed set after construction must not reach torch."""
        if self.seed is not None and (not _is_int(self.seed)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(f"seed must be an int in [-2**63, 2**64) or None, "
                             f"got {short_repr(self.seed)}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS
