"""Workloads: who arrives when, with how many prompt tokens, wanting how many output tokens.

Traces carry lengths only (see kvflow/sim/data/README.md); prompts are synthetic token ids of
those lengths, unique per request unless a shared prefix is asked for, so prefix caching only
hits where the workload says requests share a prefix.
"""
from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from kvflow import envs

ARRIVALS = ("trace", "poisson", "gamma", "scaled")


@dataclass(slots=True)
class Workload:
    name: str
    arrivals: np.ndarray        # seconds, non-decreasing, float64
    prompt_lens: np.ndarray     # int64, >= 1
    output_lens: np.ndarray     # int64, >= 1 (requests stop by max_tokens, EOS ignored)
    priorities: np.ndarray | None = None    # int64; lower runs first under policy "priority"
    shared_prefix_len: int = 0  # the first tokens of every prompt come from one of ...
    num_shared_prefixes: int = 1            # ... this many distinct "system prompts"
    num_clipped: int = 0        # requests shortened to fit max_model_len
    # Explicit prompts (e.g. conversations.multi_turn): prompts[i] is request i's token ids, of
    # length prompt_lens[i]; it may be a lazy sequence. None: synthetic ids (see prompt_ids).
    prompts: Sequence[Sequence[int]] | None = None

    def __post_init__(self) -> None:
        n = len(self.prompt_lens)
        if len(self.arrivals) != n or len(self.output_lens) != n:
            raise ValueError("arrivals, prompt_lens and output_lens must have the same length")
        if self.prompts is not None and len(self.prompts) < n:
            raise ValueError("prompts must give every request's token ids")
        if n and (self.prompt_lens.min() < 1 or self.output_lens.min() < 1):
            raise ValueError("every request needs >= 1 prompt token and >= 1 output token")
        if n > 1 and np.any(np.diff(self.arrivals) < 0):
            raise ValueError("arrivals must be sorted")

    def __len__(self) -> int:
        return len(self.prompt_lens)

    @property
    def duration(self) -> float:
        return float(self.arrivals[-1] - self.arrivals[0]) if len(self) > 1 else 0.0

    @property
    def rate(self) -> float:
        return (len(self) - 1) / self.duration if self.duration > 0 else float("inf")

    def head(self, n: int) -> "Workload":
        sl = slice(0, n)
        pr = None if self.priorities is None else self.priorities[sl]
        return replace(self, arrivals=self.arrivals[sl], prompt_lens=self.prompt_lens[sl],
                       output_lens=self.output_lens[sl], priorities=pr)

    def prompt_ids(self, i: int, length: int) -> list[int]:
        """Token ids of request i's prompt. With explicit prompts: its first `length` tokens
        (a prompt clipped to max_model_len keeps its head). Otherwise synthetic: a unique id right
        after the shared prefix makes every later block hash unique (block hashes chain on their
        parent)."""
        if self.prompts is not None:
            return list(self.prompts[i][:length])
        k = min(self.shared_prefix_len, length - 1)
        head = _prefix(i % self.num_shared_prefixes, k) if k > 0 else []
        return head + [_UNIQUE_BASE + i] + _FILL[:length - k - 1]


_UNIQUE_BASE = 1 << 24          # above any prefix or filler id
_FILL_LEN = 1 << 17
_FILL = [int(x) for x in (np.arange(_FILL_LEN) % 30_000 + 1000)]
_prefix_cache: dict[tuple[int, int], list[int]] = {}


def _prefix(g: int, k: int) -> list[int]:
    key = (g, k)
    if key not in _prefix_cache:
        _prefix_cache[key] = [int(x) for x in (np.arange(k) * 7 + g * 100_003) % 900_000 + 50_000]
    return _prefix_cache[key]


# ---- sources of lengths -------------------------------------------------------------------
def data_dir() -> Path:
    """$KVFLOW_DATA_DIR, or the traces shipped in the package (kvflow/sim/data)."""
    env = envs.KVFLOW_DATA_DIR
    if env:
        return Path(env)
    return Path(__file__).resolve().parent / "data"


def load_trace(path: str | Path) -> Workload:
    """A CSV with num_prefill_tokens, num_decode_tokens and optionally arrived_at (seconds).
    Without arrival times every request arrives at 0 until with_arrivals() gives it some."""
    p = Path(path)
    if not p.exists() and (data_dir() / p.name).exists():
        p = data_dir() / p.name
    with open(p, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise ValueError(f"{p}: no rows")
    for col in ("num_prefill_tokens", "num_decode_tokens"):
        if col not in rows[0]:
            raise ValueError(f"{p}: missing column {col!r} (have {list(rows[0])})")
    prompt = np.array([int(float(r["num_prefill_tokens"])) for r in rows], dtype=np.int64)
    out = np.array([int(float(r["num_decode_tokens"])) for r in rows], dtype=np.int64)
    if "arrived_at" in rows[0]:
        arr = np.array([float(r["arrived_at"]) for r in rows])
        order = np.argsort(arr, kind="stable")
        arr, prompt, out = arr[order] - arr[order][0], prompt[order], out[order]
    else:
        arr = np.zeros(len(rows))
    return Workload(p.stem, arr, np.maximum(prompt, 1), np.maximum(out, 1))


def synthetic(n: int, prompt_len: int, output_len: int, dist: str = "fixed",
              seed: int = 0) -> Workload:
    """n requests with lengths drawn around the given means: fixed, uniform (0.5x..1.5x),
    exponential, or lognormal (sigma 1, like chat prompts' long tail)."""
    rng = np.random.default_rng(seed)

    def draw(mean: int) -> np.ndarray:
        if dist == "fixed":
            x = np.full(n, float(mean))
        elif dist == "uniform":
            x = rng.uniform(0.5 * mean, 1.5 * mean, n)
        elif dist == "exponential":
            x = rng.exponential(mean, n)
        elif dist == "lognormal":
            x = rng.lognormal(np.log(mean) - 0.5, 1.0, n)
        else:
            raise ValueError(f"unknown distribution {dist!r}")
        return np.maximum(np.rint(x), 1).astype(np.int64)

    return Workload(f"synthetic-{dist}", np.zeros(n), draw(prompt_len), draw(output_len))


def long_and_shorts(num_groups: int = 1, extra_shorts: int = 0, prompt_len: int = 16,
                    long_out: int = 500, short_out: int = 10) -> Workload:
    """Reference doc 000's example: 8 requests, 1 long (500 output tokens) + 7 short (10 each),
    repeated num_groups times, then extra_shorts more short ones; all arrive at t=0."""
    outs = ([long_out] + [short_out] * 7) * num_groups + [short_out] * extra_shorts
    n = len(outs)
    return Workload("doc000-long-and-shorts", np.zeros(n), np.full(n, prompt_len, np.int64),
                    np.array(outs, np.int64))


def long_prefill_among_decodes(num_decodes: int = 8, long_prompt: int = 30_000,
                               decode_prompt: int = 512, decode_out: int = 400,
                               long_arrival: float = 0.5, long_out: int = 16) -> Workload:
    """Reference doc 004's scenario: decodes are running when a 30,000-token prompt arrives."""
    arr = np.array([0.0] * num_decodes + [long_arrival])
    prompt = np.array([decode_prompt] * num_decodes + [long_prompt], np.int64)
    out = np.array([decode_out] * num_decodes + [long_out], np.int64)
    return Workload("doc004-long-prefill", arr, prompt, out)


SCENARIOS = {"long-short": lambda: long_and_shorts(1, 14),
             "long-prefill": long_prefill_among_decodes}


# ---- arrival processes, priorities, limits ------------------------------------------------
def with_arrivals(wl: Workload, process: str, rate: float | None = None, seed: int = 0,
                  burstiness: float = 1.0) -> Workload:
    """Re-time a workload. poisson: exponential gaps at `rate` req/s; gamma: gaps with shape
    `burstiness` (< 1 burstier than Poisson, as vLLM's bench serve); scaled: the trace's own gaps
    scaled so the mean rate is `rate`; trace: unchanged."""
    if process not in ARRIVALS:
        raise ValueError(f"arrival process must be one of {ARRIVALS}, got {process!r}")
    if process == "trace":
        return wl
    if rate is None or rate <= 0:
        raise ValueError(f"arrival process {process!r} needs a request rate > 0")
    n = len(wl)
    if process == "scaled":
        if wl.duration <= 0:
            raise ValueError("the trace has no arrival times to scale; use poisson or gamma")
        arr = (wl.arrivals - wl.arrivals[0]) * (wl.rate / rate)
    else:
        rng = np.random.default_rng(seed)
        shape = 1.0 if process == "poisson" else burstiness
        gaps = rng.gamma(shape, 1.0 / (rate * shape), n)
        gaps[0] = 0.0
        arr = np.cumsum(gaps)
    return replace(wl, arrivals=arr)


def with_priorities(wl: Workload, threshold: int | None = None) -> Workload:
    """Priority 0 (served first) for prompts up to `threshold` tokens, 1 for longer ones: short
    interactive prompts jump the queue. Default threshold: the workload's median prompt."""
    t = int(np.median(wl.prompt_lens)) if threshold is None else threshold
    return replace(wl, priorities=(wl.prompt_lens > t).astype(np.int64))


def with_shared_prefix(wl: Workload, length: int, num_prefixes: int = 1) -> Workload:
    if length < 0 or num_prefixes < 1:
        raise ValueError("shared prefix length must be >= 0 and num_prefixes >= 1")
    return replace(wl, shared_prefix_len=length, num_shared_prefixes=num_prefixes)


def clip_to_model_len(wl: Workload, max_model_len: int) -> Workload:
    """Shorten requests that could not run in max_model_len tokens: keep the output length (up to
    half the window) and cut the prompt, as a client truncating its history would."""
    out = np.minimum(wl.output_lens, max_model_len // 2)
    prompt = np.minimum(wl.prompt_lens, max_model_len - out)
    clipped = int(np.count_nonzero((prompt != wl.prompt_lens) | (out != wl.output_lens)))
    if not clipped:
        return wl
    return replace(wl, prompt_lens=prompt, output_lens=out, num_clipped=wl.num_clipped + clipped)
