"""Many replays at once: serving capacity under an SLO (by bisection) and the TTFT-vs-ITL
frontier across token budgets and long-prefill thresholds.

Capacity follows Sarathi-Serve: the highest request rate (Poisson arrivals) at which P99 TBT
stays within the SLO and the median scheduling delay stays within 2 s, plus a guard for finite
trials (metrics.meets_slo: the server must keep up with arrivals). The same requests (the first
`num_requests` of the workload, same seed) are replayed at every rate, so only the rate changes
between trials.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvflow.sim.cost_model import CostModel
from kvflow.sim.metrics import meets_slo, summarize
from kvflow.sim.policies import scheduler_config
from kvflow.sim.simulator import simulate
from kvflow.sim.workload import Workload, with_arrivals, with_priorities


@dataclass(slots=True)
class Variant:
    """One scheduler setup to compare: a policy plus SchedulerConfig overrides."""
    label: str
    policy: str
    overrides: dict = field(default_factory=dict)


# nano-vllm style with its own defaults whatever the shared flags say: a budget that fits any
# prompt whole, and no chunking.
NANO = Variant("nano (no chunking)", "nano", {"max_num_batched_tokens": None,
                                              "enable_chunked_prefill": None})


@dataclass(slots=True)
class SweepSetup:
    workload: Workload          # lengths (and priorities); arrivals are replaced per trial
    cost: CostModel
    sched_fields: dict          # SchedulerConfig fields shared by every variant
    num_requests: int = 1000
    seed: int = 0
    arrival: str = "poisson"
    burstiness: float = 1.0
    priority_threshold: int | None = None
    spec_acceptance: float = 0.7    # used only with a speculative_config in sched_fields

    def run(self, variant: Variant, rate: float) -> dict:
        wl = self.workload.head(self.num_requests)
        if self.arrival == "trace":
            raise ValueError("sweeps set the rate; use poisson, gamma or scaled arrivals")
        wl = with_arrivals(wl, self.arrival, rate, self.seed, self.burstiness)
        if variant.policy == "priority" and wl.priorities is None:
            wl = with_priorities(wl, self.priority_threshold)
        cfg = scheduler_config(variant.policy, **(self.sched_fields | variant.overrides))
        s = summarize(simulate(wl, self.cost, cfg, variant.policy,
                               spec_acceptance=self.spec_acceptance, spec_seed=self.seed))
        s["label"] = variant.label
        s["request_rate"] = rate
        return s


@dataclass(slots=True)
class Trial:
    rate: float
    ok: bool
    p99_itl_ms: float
    median_queue_ms: float


def find_capacity(setup: SweepSetup, variant: Variant, slo_p99_itl_s: float,
                  max_median_queue_s: float = 2.0, start_rate: float = 1.0,
                  rel_tol: float = 0.02, max_trials: int = 24,
                  on_trial: Callable[[Trial], None] | None = None) -> tuple[float, list[Trial]]:
    """Bisect for the highest rate that meets the SLO. Returns (capacity, trials); capacity is 0
    if even start_rate / 2**8 fails."""
    trials: list[Trial] = []

    def ok(rate: float) -> bool:
        s = setup.run(variant, rate)
        good = meets_slo(s, slo_p99_itl_s, max_median_queue_s)
        trials.append(Trial(rate, good, s["p99_itl_ms"], s["median_queue_ms"]))
        if on_trial is not None:
            on_trial(trials[-1])
        return good

    lo, hi = 0.0, start_rate
    if ok(hi):
        while len(trials) < max_trials:             # grow until a rate fails
            lo, hi = hi, hi * 2
            if not ok(hi):
                break
        else:
            return hi, trials                       # never failed within max_trials
    else:
        for _ in range(8):                          # shrink until a rate passes
            hi, lo = hi, hi / 2
            if ok(lo):
                break
            hi = lo
        else:
            return 0.0, trials
    while (hi - lo) > rel_tol * lo and len(trials) < max_trials:
        mid = (lo + hi) / 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo, trials


def frontier(setup: SweepSetup, rate: float, budgets: list[int], thresholds: list[int],
             threshold_budget: int = 8192, policy: str = "vllm",
             on_point: Callable[[dict], None] | None = None) -> list[dict]:
    """Replay at `rate` once per token budget (chunked prefill, no threshold) and once per
    long_prefill_token_threshold (at `threshold_budget`). Each point: its summary plus `sweep`
    ("budget" or "threshold") and `value`."""
    points = []
    runs = [("budget", b, {"max_num_batched_tokens": b, "long_prefill_token_threshold": 0})
            for b in budgets]
    runs += [("threshold", t, {"max_num_batched_tokens": threshold_budget,
                               "long_prefill_token_threshold": t}) for t in thresholds]
    for sweep, value, ov in runs:
        s = setup.run(Variant(f"{sweep}={value}", policy, ov | {"enable_chunked_prefill": True}),
                      rate)
        s["sweep"], s["value"] = sweep, value
        points.append(s)
        if on_point is not None:
            on_point(s)
    return points
