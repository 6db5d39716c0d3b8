"""Simulated routing across data-parallel replicas: round-robin vs least-load vs prefix-aware.

    python benchmarks/sim_routing.py [--replicas 4,16] [--sessions-per-replica 5] [--out docs/sim]

N replicas of kvflow's real Scheduler (Llama-3-8B on an H100 cost model each, budget 2048,
KV cache sized from 90% of 80 GB) behind kvflow.core.routing, the code the HTTP router runs
(kvflow/sim/replicas.py). Workload (kvflow/sim/conversations.py): 4 system prompts of ~2,048
tokens, users tied to one each, 6-turn conversations (questions ~128 tokens, answers ~128),
sessions starting as a Poisson process at `--sessions-per-replica` x N per second for
`--window` seconds, next turn 1 s + Exp(5 s) after the previous one arrived. The load per
replica is the same at every N. Writes docs/sim/routing_<N>x_<load>.json per replica count and
docs/sim/routing.png. Everything is simulated; nothing ran on a GPU.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from kvflow.core.routing import POLICIES  # noqa: E402
from kvflow.sim import CostModel, get_gpu, get_model, scheduler_config  # noqa: E402
from kvflow.sim.conversations import multi_turn  # noqa: E402
from kvflow.sim.hardware import num_gpu_blocks  # noqa: E402
from kvflow.sim.replicas import simulate_replicas, summarize_replicas  # noqa: E402

KEYS = ("prefix_cache_hit_rate", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
        "p99_tpot_ms", "request_throughput", "output_throughput", "gpu_busy_fraction",
        "max_kv_usage", "num_preemptions", "max_over_mean_requests", "completed",
        "num_requests", "duration_s", "prefix_cache_queries", "prefix_cache_hits",
        "wall_time_s")


def _csv(s, typ):
    return [typ(x) for x in s.split(",") if x.strip()]


def plot(results: dict[int, list[dict]], path: Path, title: str) -> None:
    ns = sorted(results)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    width = 0.8 / len(POLICIES)
    for k, pol in enumerate(POLICIES):
        xs = np.arange(len(ns)) + k * width
        rows = [next(r for r in results[n] if r["routing"] == pol) for n in ns]
        for ax, key, scale, fmt in ((axes[0], "prefix_cache_hit_rate", 100, "{:.0f}%"),
                                    (axes[1], "p99_ttft_ms", 1, "{:.0f}")):
            ys = [r[key] * scale for r in rows]
            bars = ax.bar(xs, ys, width, label=pol)
            for b, v in zip(bars, ys):
                ax.annotate(fmt.format(v), (b.get_x() + b.get_width() / 2, v), ha="center",
                            va="bottom", fontsize=8)
    for ax, label in ((axes[0], "prefix-cache hit rate (% of prompt tokens)"),
                      (axes[1], "P99 TTFT (ms, log scale)")):
        ax.set_xticks(np.arange(len(ns)) + width * (len(POLICIES) - 1) / 2)
        ax.set_xticklabels([f"{n} replicas" for n in ns])
        ax.set_ylabel(label)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].set_ylim(0, 105)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=8, loc="lower right")
    import textwrap
    fig.suptitle("\n".join(textwrap.wrap(title, 110)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=lambda s: _csv(s, int), default=[4, 16])
    p.add_argument("--sessions-per-replica", type=float, default=5.0,
                   help="new conversations per second per replica (6 turns each)")
    p.add_argument("--window", type=float, default=60.0, help="seconds of session starts")
    p.add_argument("--policies", type=lambda s: _csv(s, str), default=list(POLICIES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="docs/sim")
    p.add_argument("--plot", default="routing.png", help="file name under --out; '' for none")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    shape, gpu = get_model("Llama-3-8B"), get_gpu("h100")
    cost = CostModel(shape, gpu)
    blocks = num_gpu_blocks(shape, gpu, 16, 0.9, 8192, 256)
    cfg = scheduler_config("vllm", num_blocks=blocks, max_num_batched_tokens=2048,
                           max_model_len=shape.max_model_len, max_num_seqs=256)
    results: dict[int, list[dict]] = {}
    for n in a.replicas:
        rate = a.sessions_per_replica * n
        wl = multi_turn(num_users=int(round(rate * a.window)), num_system_prompts=4,
                        system_prompt_len=2048, turns=6, question_len=128, answer_len=128,
                        session_rate=rate, think_time=5.0, min_gap=1.0, seed=a.seed)
        print(f"{n} replicas: {len(wl)} requests ({wl.name}) over {wl.duration:.0f} s, "
              f"{wl.rate:.1f} req/s mean, mean prompt {wl.prompt_lens.mean():.0f} tokens; "
              f"{shape.name} on {gpu.name}, {blocks} KV blocks per replica", flush=True)
        rows = []
        for pol in a.policies:
            t0 = time.perf_counter()
            s = summarize_replicas(simulate_replicas(wl, cost, cfg, pol, n))
            row = {"routing": pol, "num_replicas": n} | {k: s[k] for k in KEYS}
            row["per_replica"] = s["per_replica"]
            rows.append(row)
            print(f"  {pol:12s} hit {s['prefix_cache_hit_rate']:6.1%}  TTFT p50/p90/p99 "
                  f"{s['median_ttft_ms']:7.1f} / {s['p90_ttft_ms']:7.1f} / "
                  f"{s['p99_ttft_ms']:8.1f} ms  TPOT p50 {s['median_tpot_ms']:5.1f} ms  "
                  f"{s['output_throughput']:7.0f} out tok/s  busy {s['gpu_busy_fraction']:.2f}  "
                  f"max/mean requests {s['max_over_mean_requests']:.2f}  "
                  f"({time.perf_counter() - t0:.0f} s wall)", flush=True)
        results[n] = rows
        (out / f"routing_{n}x_{a.sessions_per_replica:g}.json").write_text(json.dumps(
            {"simulated": True, "model": shape.name, "gpu": gpu.name, "num_blocks": blocks,
             "num_replicas": n, "sessions_per_replica_per_s": a.sessions_per_replica,
             "window_s": a.window, "seed": a.seed, "workload": wl.name,
             "num_requests": len(wl), "mean_prompt_tokens": float(wl.prompt_lens.mean()),
             "mean_rate_req_s": wl.rate, "rows": rows}, indent=2))
    if a.plot and len(a.policies) == len(POLICIES):
        plot(results, out / a.plot,
             f"Simulated routing, {shape.name} on {gpu.name} per replica: 6-turn conversations "
             f"on 4 shared ~2k-token system prompts, {a.sessions_per_replica:g} new "
             f"conversations/s per replica")


if __name__ == "__main__":
    main()
