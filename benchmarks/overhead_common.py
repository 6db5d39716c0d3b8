"""The steady-state decode loop shared by scheduler_overhead.py (kvflow) and
vllm_scheduler_overhead.py (vLLM), so both systems see the same prompts and the same timing.
Imports neither system: the vLLM script runs in its own venv without kvflow."""
from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import time
from collections.abc import Callable


def workload(n: int, seed: int) -> tuple[list[list[int]], dict[str, list[int]]]:
    """n prompts of 64..512 random ids (random lengths stagger the block boundaries, as in real
    traffic) and the one token the fake executor samples for each request, keyed by req-{i}."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(32000) for _ in range(rng.randint(64, 512))] for _ in range(n)]
    tokens = {f"req-{i}": [rng.randrange(32000)] for i in range(n)}
    return prompts, tokens


def time_steps(schedule: Callable, update: Callable, n: int, steps: int) -> dict:
    """Median microseconds of schedule() and update(output) over `steps` pure-decode steps."""
    t_sched, t_update = [], []
    gc.collect()
    gc.disable()   # keep collector pauses out of per-step numbers
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            so = schedule()
            t1 = time.perf_counter()
            update(so)
            t2 = time.perf_counter()
            assert so.total_num_scheduled_tokens == n == len(so.num_scheduled_tokens), \
                "not a steady decode state"
            t_sched.append(t1 - t0)
            t_update.append(t2 - t1)
    finally:
        gc.enable()
    s, u = statistics.median(t_sched) * 1e6, statistics.median(t_update) * 1e6
    return {"num_running": n, "schedule_us": s, "update_us": u, "step_us": s + u,
            "per_request_us": (s + u) / n}


def parser(doc: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--num-running", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    return ap


def run(title: str, measure: Callable[[int, int], dict], a: argparse.Namespace) -> list[dict]:
    """measure(n, seed) per N and repeat; print the medians as a table (and JSON if asked)."""
    from tqdm import tqdm
    results = []
    for n in a.num_running:
        runs = [measure(n, a.seed + r) for r in tqdm(range(a.repeats), desc=f"N={n}", leave=False)]
        results.append({k: statistics.median(r[k] for r in runs) for k in runs[0]})
    print(f"{title}, steady-state decode, block_size={a.block_size}, {a.steps} steps x "
          f"{a.repeats} repeats (median), Python {platform.python_version()}, {platform.machine()}")
    print(f"{'N':>6} {'schedule us':>12} {'update us':>10} {'step us':>9} {'us/request':>11}")
    for r in results:
        print(f"{r['num_running']:>6} {r['schedule_us']:>12.0f} {r['update_us']:>10.0f} "
              f"{r['step_us']:>9.0f} {r['per_request_us']:>11.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)
    return results
