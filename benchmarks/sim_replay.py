"""How long the simulator takes to replay a whole trace through the real scheduler.

    python benchmarks/sim_replay.py [--trace splitwise_conv.csv] [--policy vllm] [--repeats 1]

Replays every request at the trace's own arrival times (Llama-3-8B on H100, default cost model
and scheduler config, KV blocks sized from GPU memory) and prints the host wall time, steps per
second, and what the simulated server did. Deterministic: the simulated numbers repeat exactly.
"""
from __future__ import annotations

import argparse
import gc
import platform
import statistics

from kvflow.sim import CostModel, get_gpu, get_model, load_trace, scheduler_config, simulate
from kvflow.sim.hardware import num_gpu_blocks
from kvflow.sim.metrics import summarize
from kvflow.sim.workload import with_priorities


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default="splitwise_conv.csv")
    p.add_argument("--policy", default="vllm")
    p.add_argument("--model", default="Llama-3-8B")
    p.add_argument("--gpu", default="h100")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--num-requests", type=int)
    a = p.parse_args()
    shape, gpu = get_model(a.model), get_gpu(a.gpu)
    cost = CostModel(shape, gpu)
    wl = load_trace(a.trace)
    if a.num_requests:
        wl = wl.head(a.num_requests)
    if a.policy == "priority":
        wl = with_priorities(wl)
    blocks = num_gpu_blocks(shape, gpu, 16, 0.9, a.max_num_batched_tokens, 256)
    budget = None if a.policy == "nano" else a.max_num_batched_tokens
    cfg = scheduler_config(a.policy, num_blocks=blocks, max_model_len=shape.max_model_len,
                           max_num_batched_tokens=budget)
    print(f"{wl.name}: {len(wl)} requests over {wl.duration:.0f} s of trace "
          f"({wl.rate:.2f} req/s); {shape.name} on {gpu.name}, policy {a.policy}, "
          f"{blocks} KV blocks; python {platform.python_version()}")
    walls = []
    for i in range(a.repeats):
        gc.collect()
        r = simulate(wl, cost, cfg, a.policy)
        s = summarize(r)
        walls.append(r.wall_time)
        print(f"run {i + 1}: wall {r.wall_time:.1f} s, {r.num_steps} steps "
              f"({r.num_steps / r.wall_time:,.0f} steps/s, {len(wl) / r.wall_time:,.0f} "
              f"requests/s replayed), simulated {r.sim_time:.0f} s")
    print(f"median wall time: {statistics.median(walls):.1f} s")
    print(f"simulated: {s['completed']} requests completed, {s['request_throughput']:.2f} req/s, "
          f"{s['output_throughput']:.0f} output tok/s; TTFT mean/median/P99 "
          f"{s['mean_ttft_ms']:.1f}/{s['median_ttft_ms']:.1f}/{s['p99_ttft_ms']:.1f} ms; ITL "
          f"mean/median/P99 {s['mean_itl_ms']:.2f}/{s['median_itl_ms']:.2f}/"
          f"{s['p99_itl_ms']:.2f} ms; preemptions {s['num_preemptions']}; "
          f"{s['num_clipped_to_max_model_len']} requests clipped to max_model_len; "
          f"max KV usage {s['max_kv_usage']:.1%}")


if __name__ == "__main__":
    main()
