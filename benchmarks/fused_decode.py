"""Decode steps of the default model with the layer stack in one op (decode_layers) against
layer by layer in Python (KVFLOW_CPU_FUSED_DECODE=0): two engines in one process, alternating
rounds, medians. Same greedy tokens either way (tests/test_quantized_models.py checks logprobs).

    python benchmarks/fused_decode.py [--rounds 7] [--streams 1,32] [--threads 2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from cpu_info import cpu_line

from kvflow import envs
envs.set_process_defaults()     # first: GOMP_SPINCOUNT must be set before torch loads
from kvflow import LLM, SamplingParams  # noqa: E402
from kvflow.model.loader.gguf_loader import default_model_path  # noqa: E402

PROMPT = "The capital of France is"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--streams", default="1,32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    a = ap.parse_args()
    engines = {}
    for name, env in (("one op", "1"), ("python layers", "0")):
        os.environ["KVFLOW_CPU_FUSED_DECODE"] = env
        engines[name] = LLM(default_model_path(), max_model_len=1024, num_threads=a.threads)
    sp = SamplingParams(temperature=0, max_tokens=a.tokens, ignore_eos=True)
    print(cpu_line())
    for n in map(int, a.streams.split(",")):
        rates = {k: [] for k in engines}
        for r in range(a.rounds + 1):           # round 0 warms up
            for k, llm in engines.items():
                t = time.perf_counter()
                llm.generate([PROMPT] * n, sp, use_tqdm=False)
                if r:
                    rates[k].append(n * a.tokens / (time.perf_counter() - t))
        med = {k: statistics.median(v) for k, v in rates.items()}
        for k, v in rates.items():
            print(f"{n:>3} streams  {k:<14} {med[k]:7.1f} tok/s  ({', '.join(f'{x:.1f}' for x in v)})")
        print(f"{n:>3} streams  one op / python layers: {med['one op'] / med['python layers']:.2f}x")


if __name__ == "__main__":
    main()
