"""Per-request and per-step metrics, summarised the way vLLM's `bench serve` prints them.

TTFT: arrival -> first token. TPOT: (E2E - TTFT) / (output tokens - 1), per request. ITL: every
gap between consecutive tokens of a request (what Sarathi-Serve calls TBT). E2E: arrival ->
last token. Queueing (scheduling) delay: arrival -> first scheduled. All reported in ms except
throughputs (per second of simulated time) and the step/KV figures.
"""
from __future__ import annotations

from dataclasses import asdict

import numpy as np

from kvflow.sim.simulator import SimResult

MAX_BACKLOG = 0.05      # capacity guard, see meets_slo


def _stats(prefix: str, x: np.ndarray, scale: float = 1e3) -> dict[str, float]:
    x = x[~np.isnan(x)]
    if not len(x):
        return {f"mean_{prefix}": float("nan"), f"median_{prefix}": float("nan"),
                f"p99_{prefix}": float("nan")}
    return {f"mean_{prefix}": float(np.mean(x) * scale),
            f"median_{prefix}": float(np.median(x) * scale),
            f"p99_{prefix}": float(np.percentile(x, 99) * scale)}


def request_metrics(r: SimResult) -> dict[str, np.ndarray]:
    ttft = r.first_token - r.arrival
    e2e = r.finish - r.arrival
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(r.num_output > 1, (e2e - ttft) / (r.num_output - 1), np.nan)
    return {"ttft": ttft, "tpot": tpot, "e2e": e2e, "queue": r.first_scheduled - r.arrival}


def summarize(r: SimResult) -> dict:
    m = request_metrics(r)
    done = ~np.isnan(r.finish)
    n_done = int(done.sum())
    start = float(r.arrival.min()) if len(r.arrival) else 0.0
    duration = (float(np.nanmax(r.finish)) - start) if n_done else 0.0
    out_tokens = int(r.num_output[done].sum())
    in_tokens = int(r.prompt_lens[done].sum())
    s = r.steps
    busy = float(s["dt"].sum())
    c = r.config
    summary = {
        "policy": r.policy,
        "workload": r.workload,
        "num_requests": len(r.arrival),
        "completed": n_done,
        "num_clipped_to_max_model_len": r.num_clipped,
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": n_done / duration if duration else float("nan"),
        "output_throughput": out_tokens / duration if duration else float("nan"),
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else float("nan"),
    }
    summary |= _stats("ttft_ms", m["ttft"])
    summary |= _stats("tpot_ms", m["tpot"])
    summary |= _stats("itl_ms", r.itl)
    summary |= _stats("e2el_ms", m["e2e"])
    summary |= _stats("queue_ms", m["queue"])
    summary |= {
        # Requests not yet scheduled when the last one arrives: ~0 if the server keeps up.
        "backlog_at_last_arrival": int(np.count_nonzero(
            ~(r.first_scheduled <= r.arrival.max()))) if len(r.arrival) else 0,
        "num_preemptions": int(r.preemptions.sum()),
        "num_preempted_requests": int(np.count_nonzero(r.preemptions)),
        "num_steps": r.num_steps,
        "gpu_busy_fraction": busy / duration if duration else float("nan"),
        "mean_batch_tokens": float(s["tokens"].mean()) if r.num_steps else 0.0,
        "mean_batch_requests": float(s["reqs"].mean()) if r.num_steps else 0.0,
        "mean_kv_usage": float(s["kv_usage"].mean()) if r.num_steps else 0.0,
        "max_kv_usage": float(s["kv_usage"].max()) if r.num_steps else 0.0,
        "max_waiting": int(s["waiting"].max()) if r.num_steps else 0,
        "simulated_time_s": r.sim_time,
        "wall_time_s": r.wall_time,
        "scheduler_config": asdict(c),
    }
    return summary | r.spec_summary()


def meets_slo(summary: dict, p99_itl_s: float, median_queue_s: float = 2.0,
              max_backlog: float = MAX_BACKLOG) -> bool:
    """Sarathi-Serve's capacity criterion: P99 TBT within the SLO and median scheduling delay at
    most 2 s. Plus one guard of ours, because a trial has a finite number of requests: the
    server must keep up, i.e. when the last request arrives at most `max_backlog` of them are
    still unscheduled. Without it a policy that serves short prompts first can keep the *median*
    delay low while long prompts pile up without bound."""
    n = summary["num_requests"]
    if summary["completed"] < n or summary["backlog_at_last_arrival"] > max_backlog * n:
        return False
    itl = summary["p99_itl_ms"]
    return (not np.isnan(itl) and itl <= p99_itl_s * 1e3
            and summary["median_queue_ms"] <= median_queue_s * 1e3)


def format_summary(s: dict) -> str:
    """A bench-serve-like text block."""
    rows = [("Policy", s["policy"]), ("Successful requests", s["completed"]),
            ("Simulated duration (s)", f"{s['duration_s']:.2f}"),
            ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{s['output_throughput']:.1f}"),
            ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.1f}")]
    for name, key in (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2E latency", "e2el"),
                      ("Queueing delay", "queue")):
        for stat in ("mean", "median", "p99"):
            rows.append((f"{stat.capitalize()} {name} (ms)", f"{s[f'{stat}_{key}_ms']:.2f}"))
    if "spec_acceptance_rate" in s:
        rows += [("Draft acceptance rate", f"{s['spec_acceptance_rate']:.1%}"),
                 ("Mean tokens per verification", f"{s['spec_mean_tokens_per_verification']:.2f}")]
    rows += [("Preemptions", s["num_preemptions"]), ("Steps", s["num_steps"]),
             ("Mean KV usage", f"{s['mean_kv_usage']:.1%}"),
             ("Replay wall time (s)", f"{s['wall_time_s']:.2f}")]
    width = max(len(k) for k, _ in rows) + 2
    return "\n".join(f"{k + ':':<{width}}{v}" for k, v in rows)
