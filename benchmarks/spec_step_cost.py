"""What verifying drafts costs: the median engine step of B decoding requests, each with m draft
tokens (garbage, so all rejected: the step's cost, not its yield), on the default model.

From these the batch rule of SpeculativeConfig.num_drafts_for is read off: a step of B requests
with m drafts each pays off when its expected tokens per request, 1 + a(m) (a: accepted drafts),
beat its cost relative to the plain step, cost(B, m) / cost(B, 0).

    python benchmarks/spec_step_cost.py --batches 1 2 4 8 16 32 --drafts 0 1 2 4 8
"""
from __future__ import annotations

import argparse
import statistics
import time

from kvflow import envs
envs.set_process_defaults()     # first: GOMP_SPINCOUNT must be set before torch loads
from kvflow import LLM, SamplingParams  # noqa: E402

SPEC = {"method": "ngram", "num_speculative_tokens": 16, "max_batch_tokens": 1 << 20}


class FixedDrafts:
    """m draft tokens for every decoding request (the n-gram proposer's call signature)."""

    def __init__(self, m: int) -> None:
        self.m = m

    def propose(self, requests, num_running):
        return {r.request_id: [0] * self.m for r in requests
                if r.output_token_ids and r.num_computed_tokens == r.num_tokens - 1} \
            if self.m else {}


def step_cost(llm: LLM, batch: int, m: int, prompt_len: int, steps: int) -> float:
    eng = llm.llm_engine
    core = eng.engine_core
    core.proposer = FixedDrafts(m)
    sp = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"b{batch}m{m}r{i}", [100 + (i * 7 + j) % 5000 for j in range(prompt_len)],
                        sp)
    eng.step()                      # the prefills (one step: the budget holds them)
    eng.step()                      # the first decode; drafts proposed after it
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    while eng.has_unfinished_requests():
        eng.step()
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--drafts", type=int, nargs="+", default=[0, 1, 2, 4, 8])
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=12)
    a = p.parse_args()
    llm = LLM(dtype="float32", max_model_len=4096, max_num_batched_tokens=16384,
              speculative_config=SPEC)
    print("| running | " + " | ".join(f"m={m}" for m in a.drafts) + " |")
    print("|---|" + "---|" * len(a.drafts))
    for b in a.batches:
        costs = {m: step_cost(llm, b, m, a.prompt_len, a.steps) for m in a.drafts}
        base = costs[a.drafts[0]]
        cells = [f"{costs[m] * 1e3:.0f} ms ({costs[m] / base:.2f}x)" for m in a.drafts]
        print(f"| {b} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
