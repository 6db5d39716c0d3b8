"""Prompts for `kvflow bench serve`: random lengths, or the Azure traces' lengths and arrivals.

Prompt text is made the way vLLM's RandomDataset makes it: random token ids decoded to text, then
re-encoded and trimmed until the text is `prompt_len` tokens long under the client's tokenizer
(the server's count can differ by a token or two, e.g. a BOS; the benchmark reports the server's
usage.prompt_tokens where it returns usage). Arrival offsets come from the trace or from a gamma
process at --request-rate with shape --burstiness (1 = Poisson), as in `vllm bench serve`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

AZURE_TRACES = {"azure-conv": "splitwise_conv.csv", "azure-code": "splitwise_code.csv"}
DATASETS = ("random", *AZURE_TRACES)


@dataclass(slots=True)
class SampleRequest:
    prompt: str
    prompt_len: int             # tokens under the client's tokenizer
    expected_output_len: int    # sent as max_tokens
    arrival: float = 0.0        # seconds after the start of the run


def random_lengths(n: int, mean: int, range_ratio: float, rng: np.random.Generator) -> np.ndarray:
    """Uniform integers in [mean * (1 - r), mean * (1 + r)], at least 1 (vLLM's semantics)."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"random range ratio must be in [0, 1), got {range_ratio}")
    lo = max(1, math.floor(mean * (1 - range_ratio)))
    hi = max(lo, math.ceil(mean * (1 + range_ratio)))
    return rng.integers(lo, hi + 1, n)


def make_prompt(tokenizer, length: int, rng: np.random.Generator) -> tuple[str, int]:
    """Text of about `length` tokens from random ids; returns (text, its token count)."""
    vocab = tokenizer.vocab_size
    lo = min(256, vocab // 4)       # past the special and byte tokens at the start of the vocab
    ids = [int(x) for x in rng.integers(lo, vocab, length)]
    text = tokenizer.decode(ids)
    for _ in range(10):
        got = tokenizer.encode(text, add_special_tokens=False)
        if len(got) == length:
            break
        if len(got) > length:
            got = got[:length]
        else:
            got = got + [int(x) for x in rng.integers(lo, vocab, length - len(got))]
        text = tokenizer.decode(got)
    return text, len(tokenizer.encode(text, add_special_tokens=False))


def gamma_arrivals(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Offsets of n requests at `rate` req/s with gamma(shape=burstiness) gaps; inf: all at 0."""
    if rate == math.inf:
        return np.zeros(n)
    if not rate > 0 or not burstiness > 0:
        raise ValueError("request rate and burstiness must be > 0")
    gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def trace_lengths(name: str, n: int, max_model_len: int, length_scale: float | None,
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """The first n rows of an Azure trace: (arrivals, prompt_lens, output_lens, scale).

    Lengths are multiplied by `length_scale`; None ("auto") picks the largest scale <= 1 at
    which every selected request fits in max_model_len. Anything still too long is clipped.
    """
    from dataclasses import replace

    from kvflow.sim.workload import clip_to_model_len, load_trace
    wl = load_trace(AZURE_TRACES[name]).head(n)
    if len(wl) < n:
        raise ValueError(f"{name} has only {len(wl)} requests; asked for {n}")
    total = int((wl.prompt_lens + wl.output_lens).max())
    scale = length_scale if length_scale is not None else min(1.0, (max_model_len - 1) / total)
    if not scale > 0:
        raise ValueError(f"length scale must be > 0, got {scale}")
    prompt = np.maximum(np.rint(wl.prompt_lens * scale), 1).astype(np.int64)
    out = np.maximum(np.rint(wl.output_lens * scale), 1).astype(np.int64)
    wl = replace(wl, prompt_lens=prompt, output_lens=out)
    wl = clip_to_model_len(wl, max_model_len - 1)
    return wl.arrivals.astype(float), wl.prompt_lens, wl.output_lens, scale


def sample_requests(tokenizer, dataset: str, num_prompts: int, *, input_len: int = 1024,
                    output_len: int = 128, range_ratio: float = 0.0,
                    request_rate: float | str = math.inf, burstiness: float = 1.0,
                    max_model_len: int = 2048, length_scale: float | None = None,
                    seed: int = 0) -> tuple[list[SampleRequest], dict]:
    """The requests of a run, with their arrival offsets; and a dict describing the workload."""
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; one of {DATASETS}")
    if num_prompts < 1:
        raise ValueError("num_prompts must be >= 1")
    rng = np.random.default_rng(seed)
    info: dict = {"dataset": dataset}
    if dataset == "random":
        prompt_lens = random_lengths(num_prompts, input_len, range_ratio, rng)
        output_lens = random_lengths(num_prompts, output_len, range_ratio, rng)
        trace_arr = None
        info.update(random_input_len=input_len, random_output_len=output_len,
                    random_range_ratio=range_ratio)
    else:
        trace_arr, prompt_lens, output_lens, scale = trace_lengths(
            dataset, num_prompts, max_model_len, length_scale)
        info.update(length_scale=scale, max_model_len=max_model_len)
    if request_rate == "trace":
        if trace_arr is None:
            raise ValueError("--request-rate trace needs a trace dataset (azure-conv, azure-code)")
        arrivals = trace_arr
    else:
        arrivals = gamma_arrivals(num_prompts, float(request_rate), burstiness, rng)
    reqs = []
    for p, o, a in zip(prompt_lens, output_lens, arrivals):
        text, n = make_prompt(tokenizer, int(p), rng)
        reqs.append(SampleRequest(text, n, int(o), float(a)))
    info.update(mean_prompt_len=float(np.mean([r.prompt_len for r in reqs])),
                mean_output_len=float(np.mean(output_lens)))
    return reqs, info


def load_tokenizer(path: str | None):
    """kvflow's tokenizer for an HF directory or a .gguf (None: the embedded SmolLM2)."""
    from kvflow.engine.tokenizer import Tokenizer
    from kvflow.model.loader.model_loader import open_checkpoint
    return Tokenizer.from_checkpoint(open_checkpoint(path))
