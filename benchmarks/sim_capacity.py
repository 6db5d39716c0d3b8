"""Simulated serving capacity and the TTFT-vs-ITL frontier, Llama-3-8B on one H100.

    python benchmarks/sim_capacity.py [--requests 1500] [--out docs/sim]

Capacity = the highest Poisson request rate at which P99 TBT stays within the SLO and the median
scheduling delay within 2 s (Sarathi-Serve's definition), found by bisection, for each policy:
vLLM V1 (chunked prefill) at token budgets 512 / 2048 / 8192, priority (short prompts first,
budget 2048), nano-vllm style (prefill-only or decode-only steps, no chunking: the
prefill-prioritising schedule of vLLM before chunked prefill, Sarathi-Serve's baseline), and
static batching. Two SLOs: strict = 5x and relaxed = 25x a decode step of 32 requests at 4k
context. Requests: the first N of the Azure conversation trace (lengths only), same seed at
every rate. Everything here is simulated; nothing ran on a GPU.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from kvflow.sim import CostModel, get_gpu, get_model, load_trace
from kvflow.sim.hardware import num_gpu_blocks
from kvflow.sim.plots import plot_capacity, plot_frontier
from kvflow.sim.experiment import default_slo_s
from kvflow.sim.sweeps import NANO, SweepSetup, Variant, find_capacity, frontier

VARIANTS = [
    Variant("vllm (budget 512)", "vllm", {"max_num_batched_tokens": 512}),
    Variant("vllm (budget 2048)", "vllm", {"max_num_batched_tokens": 2048}),
    Variant("vllm (budget 8192)", "vllm", {"max_num_batched_tokens": 8192}),
    Variant("priority (budget 2048)", "priority", {"max_num_batched_tokens": 2048}),
    NANO,
    Variant("static", "static", {"max_num_batched_tokens": 8192}),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default="splitwise_conv.csv")
    p.add_argument("--requests", type=int, default=1500, help="requests per trial")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--frontier-rate", type=float,
                   help="req/s for the frontier (default: 80%% of vllm-2048's strict capacity)")
    p.add_argument("--only", help="comma list of variant labels' policies to run")
    p.add_argument("--out", default="docs/sim")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    shape, gpu = get_model("Llama-3-8B"), get_gpu("h100")
    cost = CostModel(shape, gpu)
    fields = {"num_blocks": num_gpu_blocks(shape, gpu, 16, 0.9, 8192, 256),
              "max_model_len": shape.max_model_len, "max_num_seqs": 256}
    setup = SweepSetup(load_trace(a.trace), cost, fields, num_requests=a.requests, seed=a.seed)
    strict = default_slo_s(cost)
    slos = {"strict": strict, "relaxed": 5 * strict}
    variants = [v for v in VARIANTS if not a.only or v.policy in a.only.split(",")]
    print(f"{shape.name} on {gpu.name}, {fields['num_blocks']} KV blocks; "
          f"{a.requests} requests/trial from {a.trace}; SLOs P99 TBT: "
          + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in slos.items())
          + "; median scheduling delay <= 2 s")
    rows = []
    t0 = time.perf_counter()
    for slo_name, slo in slos.items():
        for v in variants:
            t1 = time.perf_counter()
            qps, trials = find_capacity(setup, v, slo, start_rate=4.0)
            rows.append({"slo": f"{slo_name} ({slo * 1e3:.0f} ms)", "label": v.label,
                         "capacity_qps": qps, "trials": len(trials)})
            print(f"  {slo_name:8s} {v.label:24s} {qps:7.2f} req/s  ({len(trials)} trials, "
                  f"{time.perf_counter() - t1:.0f} s)", flush=True)
    print(f"capacity sweeps: {time.perf_counter() - t0:.0f} s wall")
    plot_capacity(rows, out / "capacity_llama3_8b_h100.png",
                  f"Simulated capacity, {shape.name} on {gpu.name}, Azure conv lengths, Poisson "
                  f"(P99 TBT SLO, median delay <= 2 s)")
    (out / "capacity_llama3_8b_h100.json").write_text(json.dumps(
        {"simulated": True, "model": shape.name, "gpu": gpu.name, "requests_per_trial": a.requests,
         "slos_ms": {k: v * 1e3 for k, v in slos.items()}, "rows": rows}, indent=2))

    by = {(r["slo"].split()[0], r["label"]): r["capacity_qps"] for r in rows}
    rate = a.frontier_rate or 0.8 * by.get(("strict", "vllm (budget 2048)"), 10.0)
    t1 = time.perf_counter()
    pts = frontier(setup, rate, [256, 512, 1024, 2048, 4096, 8192], [128, 256, 512, 1024])
    nano = setup.run(NANO, rate)
    plot_frontier(pts, out / "frontier_llama3_8b_h100.png",
                  f"TTFT vs ITL frontier (simulated): {shape.name} on {gpu.name}, Azure conv "
                  f"lengths, Poisson {rate:.1f} req/s", extra=[nano])
    print(f"frontier at {rate:.2f} req/s ({time.perf_counter() - t1:.0f} s wall):")
    for pt in pts + [nano]:
        print(f"  {pt['label']:22s} median TTFT {pt['median_ttft_ms']:8.1f} ms  P99 TTFT "
              f"{pt['p99_ttft_ms']:8.1f} ms  P99 ITL {pt['p99_itl_ms']:7.1f} ms")


if __name__ == "__main__":
    main()
