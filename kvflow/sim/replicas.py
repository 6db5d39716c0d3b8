"""N data-parallel replicas of the real Scheduler behind one router, on one simulated clock.

Each replica is a simulator.Replica: its own Scheduler (so its own KV cache and prefix cache),
its own clock, the same step code as simulate(). One global loop walks the arrivals in order; at
each arrival time T it

1. advances every replica to T (a busy replica runs steps while its clock is before T, so its
   last step may end past T; an idle one jumps to T),
2. tells the router about every request that finished at or before T (`policy.finish(r)`; a
   request that finishes in a step ending after T is still in flight at T),
3. routes the request with kvflow.core.routing (the code the HTTP router runs; key = the
   prompt's token ids as a tuple, load = the policy's in-flight count) and adds it to the chosen
   replica, where it joins that replica's next step.

After the last arrival every replica runs until it has no work. With one replica this is
exactly simulate() (same steps, same floats). Replies are bit-for-bit repeatable under the same
conditions as simulate() (include_scheduler_time off).
"""
from __future__ import annotations

import heapq
import time
from itertools import zip_longest
from dataclasses import dataclass, field

import numpy as np

from kvflow import SamplingParams
from kvflow.core import Scheduler, SchedulerConfig
from kvflow.core.routing import RoutingPolicy, make_policy
from kvflow.sim.cost_model import CostModel
from kvflow.sim.metrics import request_metrics, summarize
from kvflow.sim.simulator import (INF, STEP_FIELDS, Records, Replica, SimResult, SyntheticSpec,
                                  _make_request, make_result, step_arrays)
from kvflow.sim.workload import Workload, clip_to_model_len


@dataclass(slots=True)
class ReplicasResult:
    routing: str
    num_replicas: int
    result: SimResult           # every request; steps: all replicas', ordered by start time
    replica: np.ndarray         # int64: the replica that served request i
    replica_steps: list[dict[str, np.ndarray]]
    prefix_cache_queries: list[int]     # per replica, cumulative, in tokens
    prefix_cache_hits: list[int]
    schedulers: list[Scheduler] = field(repr=False)
    policy: RoutingPolicy = field(repr=False)

    @property
    def hit_rate(self) -> float:
        """Prefix-cache hit rate over every replica: hit tokens / looked-up tokens."""
        q = sum(self.prefix_cache_queries)
        return sum(self.prefix_cache_hits) / q if q else float("nan")

    def replica_hit_rate(self, r: int) -> float:
        q = self.prefix_cache_queries[r]
        return self.prefix_cache_hits[r] / q if q else float("nan")


def simulate_replicas(wl: Workload, cost: CostModel, config: SchedulerConfig,
                      routing: str = "round_robin", num_replicas: int = 1, policy: str = "vllm",
                      *, routing_kwargs: dict | None = None, include_scheduler_time: bool = False,
                      progress: bool = False, spec_acceptance: float = 0.7,
                      spec_seed: int = 0) -> ReplicasResult:
    """Replay `wl` through `num_replicas` Scheduler(config)s, each driven as `policy` (see
    kvflow/sim/policies.py), behind the `routing` policy of kvflow.core.routing (constructor
    arguments in routing_kwargs). Replica r's synthetic speculation draws from spec_seed + r."""
    wall0 = time.perf_counter()
    wl = clip_to_model_len(wl, config.max_model_len)
    n = len(wl)
    rec = Records(n)
    router = make_policy(routing, num_replicas, **(routing_kwargs or {}))
    finished: list[tuple[float, int, int]] = []     # (time, request, replica), a heap
    push = heapq.heappush

    def on_finish(r: int):
        return lambda i, t: push(finished, (t, i, r))

    pbar = None
    if progress:
        from tqdm import tqdm
        pbar = tqdm(total=n, unit="req", desc=f"{routing} x{num_replicas}", mininterval=0.5)
    reps = [Replica(config, cost, policy, rec,
                    spec=(SyntheticSpec(config, spec_acceptance, spec_seed + r)
                          if config.speculative_config is not None else None),
                    include_scheduler_time=include_scheduler_time, on_finish=on_finish(r),
                    pbar=pbar)
            for r in range(num_replicas)]
    served = np.full(n, -1, dtype=np.int64)
    sp_cache: dict[int, SamplingParams] = {}
    arrivals = wl.arrivals.tolist()
    for i in range(n):
        t = arrivals[i]
        for rep in reps:
            rep.advance(t)
        while finished and finished[0][0] <= t:
            router.finish(heapq.heappop(finished)[2])
        req = _make_request(wl, i, sp_cache)
        r = router.choose(tuple(req.prompt_token_ids))
        served[i] = r
        reps[r].add(i, req)
    sim_time = max((rep.advance(INF) for rep in reps), default=0.0)
    while finished:
        router.finish(heapq.heappop(finished)[2])
    if pbar is not None:
        pbar.close()

    per = [step_arrays(rep.steps) for rep in reps]
    order = np.argsort(np.concatenate([s["t"] for s in per]), kind="stable")
    steps = {k: np.concatenate([s[k] for s in per])[order] for k in STEP_FIELDS}
    spec = None
    if config.speculative_config is not None:
        spec = reps[0].scheduler.spec_stats.copy()
        for rep in reps[1:]:
            s = rep.scheduler.spec_stats
            spec.num_drafts += s.num_drafts
            spec.num_draft_tokens += s.num_draft_tokens
            spec.num_accepted_tokens += s.num_accepted_tokens
            spec.num_accepted_tokens_per_pos = [
                a + b for a, b in zip_longest(spec.num_accepted_tokens_per_pos,
                                             s.num_accepted_tokens_per_pos, fillvalue=0)]
    res = make_result(policy, wl, config, rec, steps, sim_time, wall0, spec)
    scheds = [rep.scheduler for rep in reps]
    return ReplicasResult(
        routing=routing, num_replicas=num_replicas, result=res, replica=served,
        replica_steps=per, prefix_cache_queries=[s.prefix_cache_queries for s in scheds],
        prefix_cache_hits=[s.prefix_cache_hits for s in scheds], schedulers=scheds,
        policy=router)


def summarize_replicas(rr: ReplicasResult) -> dict:
    """summarize() over every request, plus routing figures: the prefix-cache hit rate (tokens
    found cached / tokens looked up at admission, over all replicas), each replica's requests,
    hit rate and busy fraction. gpu_busy_fraction becomes the replicas' mean."""
    s = summarize(rr.result)
    r = rr.result
    dur = s["duration_s"]
    ttft = request_metrics(r)["ttft"]
    per = []
    for k in range(rr.num_replicas):
        mine = rr.replica == k
        t = ttft[mine]
        t = t[~np.isnan(t)]
        per.append({"requests": int(mine.sum()),
                    "prompt_tokens": int(r.prompt_lens[mine].sum()),
                    "prefix_cache_hit_rate": rr.replica_hit_rate(k),
                    "busy_fraction": float(rr.replica_steps[k]["dt"].sum()) / dur if dur
                    else float("nan"),
                    "p99_ttft_ms": float(np.percentile(t, 99) * 1e3) if len(t)
                    else float("nan")})
    counts = np.array([p["requests"] for p in per])
    s.update({
        "routing": rr.routing,
        "num_replicas": rr.num_replicas,
        "prefix_cache_hit_rate": rr.hit_rate,
        "prefix_cache_queries": int(sum(rr.prefix_cache_queries)),
        "prefix_cache_hits": int(sum(rr.prefix_cache_hits)),
        "gpu_busy_fraction": float(np.mean([p["busy_fraction"] for p in per])),
        "p90_ttft_ms": float(np.nanpercentile(ttft, 90) * 1e3) if len(ttft) else float("nan"),
        "max_over_mean_requests": float(counts.max() / counts.mean()) if counts.sum()
        else float("nan"),
        "per_replica": per,
    })
    return s
