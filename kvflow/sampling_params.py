"""Per-request sampling and stopping parameters, with vLLM's field names and defaults.

Processing order in the sampler (as vLLM's): allowed_token_ids, bad_words, min_tokens and
logit_bias; then the penalties (repetition over prompt and output, frequency and presence over
the output); greedy takes the argmax there; else temperature, min_p, top-k and top-p. Logprobs
are the model's own log-softmax, before any of it.

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
# vLLM's default max_logprobs: more top logprobs per token than this is refused.
MAX_LOGPROBS = 20


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
class StructuredOutputsParams:
    """Constrain the output to a grammar (vLLM's names); exactly one field is set."""
    json: str | dict | None = None      # a JSON schema (a dict or its JSON text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None          # EBNF (GBNF)
    json_object: bool | None = None     # any JSON object

    def __post_init__(self) -> None:
        set_ = [k for k in ("json", "regex", "choice", "grammar", "json_object")
                if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ValueError(f"structured_outputs needs exactly one of json, regex, choice, "
                             f"grammar, json_object; got {set_ or 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object or its "
                             f"text), got {short_repr(self.json)}")
        for k in ("regex", "grammar"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{k} must be a non-empty string, "
                                 f"got {short_repr(v)}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or
                                        not self.choice or
                                        not all(isinstance(c, str) for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, "
                             f"got {short_repr(self.choice)}")
        if self.json_object not in (None, True, False):
            raise ValueError(f"structured_outputs.json_object must be a bool, "
                             f"got {short_repr(self.json_object)}")


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
    n: int = 1                        # completions per prompt (parallel sampling)
    presence_penalty: float = 0.0     # in [-2, 2], over the output
    frequency_penalty: float = 0.0    # in [-2, 2], over the output
    repetition_penalty: float = 1.0   # > 0, over prompt and output; 1 is off
    min_p: float = 0.0                # in [0, 1]; relative to the most likely token
    logit_bias: dict[int, float] | None = None     # token id -> bias, clamped to [-100, 100]
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    logprobs: int | None = None       # top logprobs per sampled token (0: the token's only)
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # Set by the frontend from bad_words (each word with and without a leading space).
    bad_words_token_ids: list[list[int]] | None = None

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
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {short_repr(self.n)}")
        self._check_penalties()
        self._check_token_lists()
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an int in [0, {MAX_LOGPROBS}] (or None), "
                                 f"got {short_repr(v)}")
        so = self.structured_outputs
        if isinstance(so, dict):
            self.structured_outputs = so = StructuredOutputsParams(**so)
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, "
                             f"got {short_repr(so)}")

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_num(v) or not _finite(v) or not -2 <= v <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2], got {short_repr(v)}")
        v = self.repetition_penalty
        if not _is_num(v) or not _finite(v) or not v > 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0, "
                             f"got {short_repr(v)}")
        if not _is_num(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {short_repr(self.min_p)}")

    def _check_token_lists(self) -> None:
        lb = self.logit_bias
        if lb is not None:
            if not isinstance(lb, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, "
                                 f"got {short_repr(lb)}")
            clean = {}
            for k, v in lb.items():
                if isinstance(k, str) and k.strip().lstrip("-").isdigit() and len(k) < 20:
                    k = int(k)      # JSON keys are strings
                if not _is_int(k) or k < 0 or not _is_num(v) or not _finite(v):
                    raise ValueError(f"logit_bias must map token ids to finite numbers, got "
                                     f"{short_repr(k)}: {short_repr(v)}")
                clean[k] = float(min(100.0, max(-100.0, v)))
            self.logit_bias = clean or None
        a = self.allowed_token_ids
        if a is not None and (not isinstance(a, (list, tuple)) or not a or
                              not all(_is_int(t) and t >= 0 for t in a)):
            raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, "
                             f"got {short_repr(a)}")
        if a is not None:
            self.allowed_token_ids = list(a)
        b = self.bad_words
        if b is not None and (not isinstance(b, (list, tuple)) or
                              not all(isinstance(w, str) and w for w in b)):
            raise ValueError(f"bad_words must be a list of non-empty strings, got {short_repr(b)}")

    def check_vocab(self, vocab: int) -> None:
        """Token ids index the logits: each must be in [0, vocab) (the frontend checks)."""
        for name in ("stop_token_ids", "logit_bias", "allowed_token_ids"):
            bad = next((t for t in getattr(self, name) or () if t >= vocab), None)
            if bad is not None:
                raise ValueError(f"{name} must hold token ids in [0, {vocab}), "
                                 f"got {short_repr(bad)}")

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

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    @property
    def needs_history(self) -> bool:
        """Whether a token's distribution depends on the tokens before it beyond the model's
        (penalties, multi-token bad words, a grammar): such requests get no draft tokens."""
        return (self.has_penalties or self.structured_outputs is not None
                or bool(self.bad_words_token_ids))
