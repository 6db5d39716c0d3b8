"""kvflow's skinny_linear kernel (csrc/cpu_gemm.cpp) against torch at speculative-verification
row counts, on this CPU, float32:

    python benchmarks/skinny_gemm.py [micro|model|all] [ROUNDS]

micro: SmolLM2-135M's matmul shapes, one call at a time; candidates alternate call by call,
       median ms per call. model: runner.forward_logits(T tokens) of the default model, median
       ms, in one process per setting (KVFLOW_CPU_SKINNY_GEMM=0 is "old"), settings alternating.
"""
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from cpu_info import cpu_line

SHAPES = {"gate_up [3072,576]": (3072, 576), "down [576,1536]": (576, 1536),
          "lm_head [49152,576]": (49152, 576)}
ROWS = (1, 2, 3, 5, 8, 16)
MODEL_ROWS = (1, 2, 3, 5, 8)


def medians(fns: dict, calls: int) -> dict:
    for f in fns.values():
        f(), f()
    times = {k: [] for k in fns}
    for _ in range(calls):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[k].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def micro(rounds: int) -> None:
    from kvflow.model.kernels import cpu_ops
    assert cpu_ops.available(), "kvflow's CPU kernels are not built"
    print("| shape | T | F.linear | W @ x.T | skinny | F.linear / skinny |\n|---|---|---|---|---|---|")
    for name, (o, i) in SHAPES.items():
        w = torch.randn(o, i)
        for t in ROWS:
            x = torch.randn(t, i)
            m = medians({"F.linear": lambda: F.linear(x, w),
                         "wx": lambda: torch.mm(w, x.t()).t().contiguous(),
                         "skinny": lambda: torch.ops.kvflow.skinny_linear(x, w)},
                        rounds * (1 if o > 10000 else 20))
            print(f"| {name} | {t} | {m['F.linear']:.3f} | {m['wx']:.3f} | {m['skinny']:.3f} "
                  f"| {m['F.linear'] / m['skinny']:.2f}x |", flush=True)


def model_worker(rounds: int) -> None:
    from kvflow import LLM
    llm = LLM(max_model_len=4096)
    r = llm.llm_engine.engine_core.runner
    with torch.inference_mode():
        for t in MODEL_ROWS:
            ids = list(range(100, 100 + t))
            fns = {t: lambda: r.forward_logits(ids)}
            print(t, medians(fns, rounds * 5)[t], flush=True)


def model(rounds: int) -> None:
    res = {"old": {t: [] for t in MODEL_ROWS}, "new": {t: [] for t in MODEL_ROWS}}
    for _ in range(2):
        for name, flag in (("old", "0"), ("new", "1")):
            env = dict(os.environ, KVFLOW_CPU_SKINNY_GEMM=flag)
            out = subprocess.run([sys.executable, __file__, "model-worker", str(rounds)], env=env,
                                 capture_output=True, text=True, check=True).stdout
            for line in out.strip().splitlines():
                t, ms = line.split()
                res[name][int(t)].append(float(ms))
    print("| T | old (KVFLOW_CPU_SKINNY_GEMM=0) | new | old / new |\n|---|---|---|---|")
    for t in MODEL_ROWS:
        old, new = statistics.median(res["old"][t]), statistics.median(res["new"][t])
        print(f"| {t} | {old:.1f} ms | {new:.1f} ms | {old / new:.2f}x |")


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    if what == "model-worker":
        model_worker(n)
        sys.exit()
    print(f"{cpu_line()}; {os.cpu_count()} cpus; {torch.get_num_threads()} threads")
    if what in ("micro", "all"):
        micro(n)
    if what in ("model", "all"):
        model(n)
