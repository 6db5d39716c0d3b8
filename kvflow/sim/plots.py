"""PNG plots (matplotlib, headless): the timeline of one replay, the TTFT-vs-ITL frontier, and
the capacity of several policies. Every plot is titled as simulated."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from kvflow.sim.simulator import SimResult  # noqa: E402

MAX_POINTS = 4000   # a full-trace replay has ~400k steps; plot per-bin maxima instead


def _wrap(title: str, width: int = 80) -> str:
    import textwrap
    return "\n".join(textwrap.wrap(title, width))


def _binned(t: np.ndarray, ys: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
    if len(t) <= MAX_POINTS:
        return t, ys
    edges = np.linspace(0, len(t), MAX_POINTS + 1).astype(int)[:-1]
    return t[edges], [np.maximum.reduceat(y, edges) for y in ys]


def plot_timeline(r: SimResult, path: str | Path, title: str = "") -> None:
    s = r.steps
    t, (kv, run, wait, tok) = _binned(s["t"], [s["kv_usage"], s["running"], s["waiting"],
                                              s["tokens"]])
    fig, axes = plt.subplots(3, 1, figsize=(9, 7), sharex=True)
    axes[0].plot(t, 100 * kv, color="tab:purple", lw=0.8, drawstyle="steps-post")
    axes[0].set_ylabel("KV cache used (%)")
    axes[0].set_ylim(0, 105)
    axes[1].plot(t, run, label="running", lw=0.8, drawstyle="steps-post")
    axes[1].plot(t, wait, label="waiting", lw=0.8, drawstyle="steps-post")
    axes[1].set_ylabel("requests")
    axes[1].legend(loc="upper right")
    axes[2].plot(t, tok, color="tab:green", lw=0.8, drawstyle="steps-post")
    axes[2].set_ylabel("tokens per step")
    axes[2].set_xlabel("simulated time (s)")
    binned = " (per-bin maxima)" if len(s["t"]) > MAX_POINTS else ""
    fig.suptitle(f"{title or r.workload}: {r.policy}, simulated{binned}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_frontier(points: list[dict], path: str | Path, title: str = "",
                  extra: list[dict] = ()) -> None:
    """x: P99 ITL, y: median TTFT; one line per sweep, each point labelled by its value."""
    fig, ax = plt.subplots(figsize=(7.5, 5.5))
    for sweep, marker, name in (("budget", "o-", "max_num_batched_tokens"),
                                ("threshold", "s--", "long_prefill_token_threshold")):
        pts = sorted((p for p in points if p.get("sweep") == sweep), key=lambda p: p["value"])
        if not pts:
            continue
        x = [p["p99_itl_ms"] for p in pts]
        y = [p["median_ttft_ms"] for p in pts]
        ax.plot(x, y, marker, label=name)
        for p, xi, yi in zip(pts, x, y):
            ax.annotate(str(p["value"]), (xi, yi), textcoords="offset points", xytext=(4, 4),
                        fontsize=8)
    for p in extra:
        ax.plot([p["p99_itl_ms"]], [p["median_ttft_ms"]], "x", ms=9, label=p["label"])
    ax.set_xlabel("P99 inter-token latency (ms)")
    ax.set_ylabel("median TTFT (ms)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(_wrap(title or "TTFT vs ITL frontier (simulated)"), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_capacity(rows: list[dict], path: str | Path, title: str = "") -> None:
    """rows: {"label", "capacity_qps"}, optionally one group per SLO via "slo"."""
    slos = list(dict.fromkeys(r.get("slo", "") for r in rows))
    labels = list(dict.fromkeys(r["label"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(labels) * max(1, len(slos))), 4.5))
    width = 0.8 / max(1, len(slos))
    for k, slo in enumerate(slos):
        vals = {r["label"]: r["capacity_qps"] for r in rows if r.get("slo", "") == slo}
        xs = np.arange(len(labels)) + k * width
        ys = [vals.get(lb, 0.0) for lb in labels]
        bars = ax.bar(xs, ys, width, label=str(slo) if slo != "" else None)
        for b, v in zip(bars, ys):
            ax.annotate(f"{v:.2f}", (b.get_x() + b.get_width() / 2, v), ha="center",
                        va="bottom", fontsize=8)
    ax.set_xticks(np.arange(len(labels)) + width * (len(slos) - 1) / 2)
    ax.set_xticklabels(labels, rotation=15, fontsize=8)
    ax.set_ylabel("capacity (req/s within SLO)")
    if any(s != "" for s in slos):
        ax.legend(fontsize=8)
    ax.set_title(_wrap(title or "Serving capacity (simulated)"), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
