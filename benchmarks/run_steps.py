"""Time a whole offline run step by step: 256 prompts of 32 random ids -> 64 tokens (greedy,
ignore_eos) on the 62.9M bench Llama, in-process, after a 4-request warm-up. Prints the total,
output tok/s, the first step times and the median step. Used for the per-change table in
BENCHMARKS.md ("Whole-run effect of each step").

    python benchmarks/run_steps.py [--max-num-batched-tokens N] [--threads T]
"""
import argparse
import random
import statistics
import sys
import time
from pathlib import Path

from kvflow import envs
envs.set_process_defaults()     # first: GOMP_SPINCOUNT must be set before torch loads
from kvflow import SamplingParams  # noqa: E402
from kvflow.engine import EngineArgs, LLMEngine  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None)
    a = ap.parse_args()
    if a.model is None:
        from make_bench_model import ensure_model
        a.model = str(ensure_model())
    e = LLMEngine(EngineArgs(model=a.model, num_threads=a.threads, dtype="bfloat16",
                             max_num_batched_tokens=a.max_num_batched_tokens))
    for i in range(4):
        e.add_request(f"w{i}", [1, 2, 3], SamplingParams(max_tokens=2))
    while e.has_unfinished_requests():
        e.step()
    rng = random.Random(0)
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for i in range(256):
        e.add_request(str(i), [rng.randrange(e.model_config.vocab_size) for _ in range(32)], sp)
    ts = []
    t = time.perf_counter()
    while e.has_unfinished_requests():
        s = time.perf_counter()
        e.step()
        ts.append(time.perf_counter() - s)
    total = time.perf_counter() - t
    print(f"budget {e.scheduler_config.max_num_batched_tokens}: total {total:.2f} s, "
          f"{256 * 64 / total:.0f} output tok/s, {len(ts)} steps, first "
          f"{[round(x, 3) for x in ts[:6]]} s, median step {statistics.median(ts) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
