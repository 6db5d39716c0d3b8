"""What `kvflow simulate` does with its parsed arguments: build the workload and the scheduler
config, replay, then write summary.json, the plots and the step viewer."""
from __future__ import annotations

import json
import math
from pathlib import Path

from kvflow.sim.cost_model import CostModel
from kvflow.sim.hardware import GPUSpec, ModelShape, num_gpu_blocks
from kvflow.sim.html_view import GRID_MAX_BLOCKS, StepRecorder, write_html
from kvflow.sim.metrics import MAX_BACKLOG, format_summary, summarize
from kvflow.sim.policies import scheduler_config
from kvflow.sim.simulator import simulate
from kvflow.sim.sweeps import NANO, SweepSetup, Variant, find_capacity, frontier
from kvflow.sim.workload import (SCENARIOS, Workload, clip_to_model_len, load_trace, synthetic,
                                 with_arrivals, with_priorities, with_shared_prefix)

DEFAULT_BUDGET = 8192
FRONTIER_KEYS = ("label", "sweep", "value", "request_rate", "median_ttft_ms", "p99_ttft_ms",
                 "mean_itl_ms", "p99_itl_ms", "request_throughput", "num_preemptions")


def default_slo_s(cost: CostModel) -> float:
    """5x an interference-free decode step of 32 requests at 4k context: our reading of how
    Sarathi-Serve sets its strict P99 TBT SLO (relaxed: 25x)."""
    return 5 * cost.decode_step_time(32, 4096)


def base_workload(args) -> Workload:
    """Lengths (and the trace's own arrival times) before any re-timing."""
    if args.trace:
        wl = load_trace(args.trace)
    elif args.scenario:
        wl = SCENARIOS[args.scenario]()
    elif args.synthetic:
        wl = synthetic(args.num_requests or 1000, args.prompt_len, args.output_len,
                       args.synthetic, args.seed)
    else:
        raise ValueError("give a workload: --trace PATH.csv, --scenario or --synthetic")
    if args.num_requests:
        wl = wl.head(args.num_requests)
    if args.shared_prefix_len:
        wl = with_shared_prefix(wl, args.shared_prefix_len, args.num_shared_prefixes)
    return wl


def arrival_process(args) -> str:
    return args.arrival or ("poisson" if args.request_rate else "trace")


def sched_fields(args, shape: ModelShape, gpu: GPUSpec) -> dict:
    max_model_len = args.max_model_len or shape.max_model_len
    budget = args.max_num_batched_tokens
    blocks = args.num_gpu_blocks or num_gpu_blocks(
        shape, gpu, args.block_size, args.gpu_memory_utilization,
        budget or max(DEFAULT_BUDGET, max_model_len if args.policy == "nano" else 0),
        args.max_num_seqs)
    return {"block_size": args.block_size, "num_blocks": blocks,
            "max_num_batched_tokens": budget, "max_num_seqs": args.max_num_seqs,
            "max_model_len": max_model_len, "enable_prefix_caching": args.enable_prefix_caching,
            "enable_chunked_prefill": args.enable_chunked_prefill,
            "long_prefill_token_threshold": args.long_prefill_token_threshold,
            "watermark": args.watermark, "reserve_full_sequence": args.reserve_full_sequence,
            "speculative_config": args.speculative_config}


def capacity_variants(args) -> list[Variant]:
    out = []
    for p in args.capacity_policies:
        if p == "nano":
            out.append(NANO)
        else:
            b = args.max_num_batched_tokens or DEFAULT_BUDGET
            out.append(Variant(f"{p} (budget {b})" if p in ("vllm", "priority") else p, p))
    return out


def _bar(enabled: bool, total: int, desc: str):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, disable=not enabled, unit="run")


def run(args, shape: ModelShape, gpu: GPUSpec, cost: CostModel, out: Path) -> dict:
    fields = sched_fields(args, shape, gpu)
    base = clip_to_model_len(base_workload(args), fields["max_model_len"])
    process = arrival_process(args)
    wl = with_arrivals(base, process, args.request_rate, args.seed, args.burstiness)
    if args.policy == "priority":
        wl = with_priorities(wl, args.priority_threshold)
    cfg = scheduler_config(args.policy, **fields)
    recorder = StepRecorder(args.trace_steps_max) if args.trace_steps else None
    progress = not args.no_progress
    result = simulate(wl, cost, cfg, args.policy, progress=progress, step_hook=recorder,
                      include_scheduler_time=args.include_scheduler_time,
                      spec_acceptance=args.spec_acceptance, spec_seed=args.seed)
    summary = {"simulated": True,
               "note": "latencies come from a roofline cost model driving the real kvflow "
                       "Scheduler; nothing ran on a GPU",
               "model": shape.name, "gpu": gpu.name, "arrival": process,
               "request_rate_arg": args.request_rate, "seed": args.seed}
    if cfg.speculative_config is not None:
        summary["spec_acceptance_arg"] = args.spec_acceptance
    summary |= summarize(result)
    summary["cost_model"] = cost.describe()
    files = []
    plots = set(args.plots)
    if unknown := plots - {"timeline", "frontier", "capacity"}:
        raise ValueError(f"unknown plots {sorted(unknown)}")
    if plots:
        from kvflow.sim import plots as P
    if "timeline" in plots and result.num_steps:
        P.plot_timeline(result, out / "timeline.png", f"{wl.name} ({shape.name} on {gpu.name})")
        files.append("timeline.png")

    setup = SweepSetup(base, cost, fields, num_requests=min(args.sweep_requests, len(base)),
                       seed=args.seed, arrival="poisson" if process == "trace" else process,
                       burstiness=args.burstiness, priority_threshold=args.priority_threshold,
                       spec_acceptance=args.spec_acceptance)
    if "frontier" in plots:
        rate = args.frontier_rate or args.request_rate
        if rate is None:
            rate = base.rate if math.isfinite(base.rate) and base.rate > 0 else 2.0
        budgets, thresholds = args.frontier_budgets, args.frontier_thresholds
        with _bar(progress, len(budgets) + len(thresholds), "frontier") as bar:
            pts = frontier(setup, rate, budgets, thresholds, on_point=lambda p: bar.update())
        nano = setup.run(NANO, rate)
        P.plot_frontier(pts, out / "frontier.png",
                        f"TTFT vs ITL, {shape.name} on {gpu.name}, {base.name} at {rate:.2f} "
                        f"req/s (simulated)", extra=[nano])
        summary["frontier"] = [{k: p.get(k) for k in FRONTIER_KEYS} for p in pts + [nano]]
        files.append("frontier.png")
    if "capacity" in plots:
        slo = args.slo_itl_ms / 1e3 if args.slo_itl_ms else default_slo_s(cost)
        rows = []
        variants = capacity_variants(args)
        for v in variants:
            with _bar(progress, args.capacity_max_trials, f"capacity {v.label}") as bar:
                qps, trials = find_capacity(setup, v, slo, args.max_median_queue_s,
                                            start_rate=args.capacity_start_rate,
                                            max_trials=args.capacity_max_trials,
                                            on_trial=lambda tr: bar.update())
            rows.append({"label": v.label, "policy": v.policy, "capacity_qps": qps,
                         "trials": [[tr.rate, tr.ok, tr.p99_itl_ms, tr.median_queue_ms]
                                    for tr in trials]})
        summary["capacity"] = {"slo_p99_itl_ms": slo * 1e3,
                               "max_median_queue_s": args.max_median_queue_s,
                               "max_backlog_at_last_arrival": MAX_BACKLOG,
                               "requests_per_trial": setup.num_requests,
                               "arrival": setup.arrival, "results": rows}
        P.plot_capacity(rows, out / "capacity.png",
                        f"Capacity at P99 TBT <= {slo * 1e3:.0f} ms, median queueing <= "
                        f"{args.max_median_queue_s:g} s: {shape.name} on {gpu.name}, {base.name} "
                        f"(simulated)")
        files.append("capacity.png")
    if recorder is not None:
        meta = {"title": f"{wl.name}, first {len(recorder.frames)} steps", "model": shape.name,
                "gpu": gpu.name, "policy": args.policy, "num_blocks": cfg.num_blocks,
                "block_size": cfg.block_size, "max_num_batched_tokens": cfg.max_num_batched_tokens,
                "max_num_seqs": cfg.max_num_seqs, "grid_max": GRID_MAX_BLOCKS}
        write_html(out / "steps.html", recorder, meta)
        files.append("steps.html")
    summary["files"] = files
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


def format_report(summary: dict) -> str:
    text = format_summary(summary)
    cap = summary.get("capacity")
    if cap:
        text += (f"\nCapacity (simulated; P99 TBT <= {cap['slo_p99_itl_ms']:.1f} ms, median "
                 f"queueing <= {cap['max_median_queue_s']:g} s):")
        for r in cap["results"]:
            text += f"\n  {r['label']:<24}{r['capacity_qps']:8.2f} req/s"
    return text
