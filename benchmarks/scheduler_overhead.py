"""Scheduler CPU overhead in steady-state decode.

N requests are prefilled, then every step each one decodes one token with a fake executor (the
sampled ids are precomputed, so only schedule() and update_from_output() are timed). Prints
microseconds per step and per running request, median over repeats.

    python benchmarks/scheduler_overhead.py [--num-running 256 512 1024] [--steps 200]
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import time

from tqdm import tqdm

from kvflow import SamplingParams
from kvflow.core import Request, Scheduler, SchedulerConfig


def build(n: int, seed: int, block_size: int) -> tuple[Scheduler, dict[str, list[int]]]:
    rng = random.Random(seed)
    cfg = SchedulerConfig(block_size=block_size, num_blocks=1 << 17, max_num_seqs=n,
                          max_num_batched_tokens=8192, max_model_len=8192)
    sched = Scheduler(cfg)
    sp = SamplingParams(max_tokens=4096, ignore_eos=True)
    for i in range(n):
        # Random prompt lengths stagger the block boundaries, as in real traffic.
        prompt = [rng.randrange(32000) for _ in range(rng.randint(64, 512))]
        sched.add_request(Request(f"req-{i}", prompt, sp, eos_token_id=2))
    tokens = {f"req-{i}": [rng.randrange(32000)] for i in range(n)}
    # Prefill until every request is one token behind: a pure decode state.
    while sched.waiting or any(r.num_tokens - r.num_computed_tokens != 1 for r in sched.running):
        sched.update_from_output(sched.schedule(), tokens)
    return sched, tokens


def measure(n: int, steps: int, seed: int, block_size: int) -> dict:
    sched, tokens = build(n, seed, block_size)
    t_sched, t_update = [], []
    gc.collect()
    gc.disable()   # keep collector pauses out of per-step numbers; reported as-is otherwise
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            so = sched.schedule()
            t1 = time.perf_counter()
            sched.update_from_output(so, tokens)
            t2 = time.perf_counter()
            assert len(so.num_scheduled_tokens) == n, "not a steady decode state"
            t_sched.append(t1 - t0)
            t_update.append(t2 - t1)
    finally:
        gc.enable()
    s, u = statistics.median(t_sched) * 1e6, statistics.median(t_update) * 1e6
    return {"num_running": n, "schedule_us": s, "update_us": u, "step_us": s + u,
            "per_request_us": (s + u) / n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-running", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    results = []
    for n in a.num_running:
        runs = [measure(n, a.steps, a.seed + r, a.block_size)
                for r in tqdm(range(a.repeats), desc=f"N={n}", leave=False)]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        results.append(med)
    print(f"kvflow scheduler overhead, steady-state decode, block_size={a.block_size}, "
          f"{a.steps} steps x {a.repeats} repeats (median), Python {platform.python_version()}, "
          f"{platform.machine()}")
    print(f"{'N':>6} {'schedule us':>12} {'update us':>10} {'step us':>9} {'us/request':>11}")
    for r in results:
        print(f"{r['num_running']:>6} {r['schedule_us']:>12.0f} {r['update_us']:>10.0f} "
              f"{r['step_us']:>9.0f} {r['per_request_us']:>11.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
