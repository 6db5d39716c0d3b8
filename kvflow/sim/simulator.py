"""The discrete-event loop: the real Scheduler, a cost model for a clock, fake sampled tokens.

Each step: requests that have arrived by now join (through the policy's driver), schedule()
plans the step, the cost model says how long the GPU would take, the clock moves on by that
much, and update_from_output() receives one sampled token per request, stamped with the step's
end time. When nothing is left to run the clock jumps to the next arrival, so idle time costs
nothing to simulate. With include_scheduler_time off (the default) the clock depends only on the
workload, the config and the cost model: replays are bit-for-bit repeatable.

Speculative decoding (config.speculative_config): after each step a synthetic proposer gives
every decoding request num_drafts_for(len(running)) fake drafts (the n-gram proposer needs real
token ids), capped like NgramProposer's so that a step never emits past max_tokens or
max_model_len. Each draft is accepted with probability spec_acceptance if all before it were
(a seeded generator, so replays stay repeatable); a verified request then receives its accepted
drafts plus one token. ITL records one gap per step that emitted tokens (vLLM's bench serve
records one per streamed chunk); TPOT stays per token.
"""
from __future__ import annotations

import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvflow import SamplingParams
from kvflow.core import Request, SchedulerConfig
from kvflow.core.outputs import SpecDecodingStats
from kvflow.core.spec_decode import draft_room
from kvflow.sim.cost_model import CostModel
from kvflow.sim.policies import make_driver
from kvflow.sim.workload import Workload, clip_to_model_len

# Any id works: requests stop by max_tokens (the trace's output length) and ignore EOS.
SAMPLED_TOKEN = 7
DRAFT_TOKEN = 7
STEP_FIELDS = ("t", "dt", "tokens", "prefill_tokens", "reqs", "kv_usage", "running", "waiting",
               "draft_tokens", "accepted_tokens")


@dataclass(slots=True)
class SimResult:
    policy: str
    workload: str
    config: SchedulerConfig
    arrival: np.ndarray
    prompt_lens: np.ndarray
    output_lens: np.ndarray
    first_scheduled: np.ndarray     # NaN where never scheduled
    first_token: np.ndarray
    finish: np.ndarray
    num_output: np.ndarray          # tokens actually produced
    preemptions: np.ndarray
    itl: np.ndarray                 # every gap between two consecutive tokens of a request
    steps: dict[str, np.ndarray]    # per step, STEP_FIELDS
    sim_time: float                 # simulated clock at the end
    wall_time: float                # seconds this replay took on the host
    num_clipped: int = 0
    spec: SpecDecodingStats | None = None   # cumulative; None without speculation

    @property
    def num_steps(self) -> int:
        return len(self.steps["t"])

    def spec_summary(self) -> dict:
        """Acceptance rate (accepted / drafted tokens) and mean tokens emitted per verification
        (1 + accepted / verifications, vLLM's mean acceptance length); {} without speculation."""
        sp = self.spec
        if sp is None:
            return {}
        n, d, a = sp.num_drafts, sp.num_draft_tokens, sp.num_accepted_tokens
        return {"spec_num_verifications": n, "spec_num_draft_tokens": d,
                "spec_num_accepted_tokens": a,
                "spec_acceptance_rate": a / d if d else float("nan"),
                "spec_mean_tokens_per_verification": 1 + a / n if n else float("nan"),
                "spec_accepted_per_position": list(sp.num_accepted_tokens_per_pos)}


class SyntheticSpec:
    """Fake drafts and a seeded acceptance draw for each verified request (see module doc)."""
    __slots__ = ("config", "alpha", "rng", "max_model_len")

    def __init__(self, config: SchedulerConfig, alpha: float, seed: int) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"spec_acceptance must be in [0, 1], got {alpha!r}")
        self.config, self.alpha = config.speculative_config, alpha
        self.rng = np.random.default_rng(seed)
        self.max_model_len = config.max_model_len

    def propose(self, running: list[Request]) -> dict[str, list[int]]:
        """NgramProposer.propose's rule, every lookup a hit."""
        k = self.config.num_drafts_for(len(running))
        out = {}
        if k:
            for req in running:
                n = draft_room(req, k, self.max_model_len)
                if n:
                    out[req.request_id] = [DRAFT_TOKEN] * n
        return out

    def accepted(self, num_drafts: int) -> int:
        """Leading drafts accepted, each with probability alpha."""
        a, rand = 0, self.rng.random
        while a < num_drafts and rand() < self.alpha:
            a += 1
        return a

    def sampled(self, num_sched: dict[str, int], spec: dict[str, list[int]],
                one: list[int]) -> tuple[dict[str, list[int]], int, int]:
        """The sampled-token dict, the step's draft tokens and its accepted ones."""
        out = dict.fromkeys(num_sched, one)
        drafted = acc = 0
        for rid, drafts in spec.items():
            a = self.accepted(len(drafts))
            out[rid] = [SAMPLED_TOKEN] * (a + 1)
            drafted += len(drafts)
            acc += a
        return out, drafted, acc


def _make_request(wl: Workload, i: int, sp_cache: dict[int, SamplingParams]) -> Request:
    n_out = int(wl.output_lens[i])
    sp = sp_cache.get(n_out)
    if sp is None:
        sp = sp_cache[n_out] = SamplingParams(max_tokens=n_out, ignore_eos=True)
    prio = 0 if wl.priorities is None else int(wl.priorities[i])
    return Request(f"r{i}", wl.prompt_ids(i, int(wl.prompt_lens[i])), sp,
                   arrival_time=float(wl.arrivals[i]), priority=prio)


class Records:
    """Per-request records of one run, indexed by the request's position in the workload; every
    replica of a multi-replica run writes into the same Records."""
    __slots__ = ("first_sched", "first_tok", "finish", "last_tok", "n_out", "preempts", "itl",
                 "index")

    def __init__(self, n: int) -> None:
        nan = float("nan")
        self.first_sched, self.first_tok, self.finish = [nan] * n, [nan] * n, [nan] * n
        self.last_tok = [-1.0] * n
        self.n_out = [0] * n
        self.preempts = [0] * n
        self.itl = array("d")
        self.index: dict[str, int] = {}     # request id -> position


INF = float("inf")


class Replica:
    """One replica: a driver around the real Scheduler, its own clock and its step records.

    `advance(until)` runs steps while the clock is before `until` and there is work (a step may
    end past `until`; an idle replica's clock jumps to `until`); `advance(INF)` runs until no
    work is left. `add(i, req)` hands request i to the driver; it joins at the next step.
    on_finish(i, t) is called when request i finishes at simulated time t.
    """

    def __init__(self, config: SchedulerConfig, cost: CostModel, policy: str, rec: Records, *,
                 spec: SyntheticSpec | None = None, include_scheduler_time: bool = False,
                 step_hook: Callable | None = None, on_finish: Callable | None = None,
                 pbar=None) -> None:
        self.driver = make_driver(policy, config)
        self.scheduler = self.driver.scheduler
        self.rec = rec
        self.spec = spec
        self.t = 0.0
        self.steps = {k: array("d") for k in STEP_FIELDS}
        self._loop = self._run(cost, include_scheduler_time, step_hook, on_finish, pbar)
        next(self._loop)

    def add(self, i: int, req: Request) -> None:
        self.rec.index[req.request_id] = i
        self.driver.add(req)

    def advance(self, until: float) -> float:
        self.t = self._loop.send(until)
        return self.t

    def _run(self, cost, include_scheduler_time, step_hook, on_finish, pbar):
        driver, spec, rec = self.driver, self.spec, self.rec
        sched = driver.scheduler
        requests = sched.requests
        kvm = sched.kv_cache_manager
        first_sched, first_tok, finish = rec.first_sched, rec.first_tok, rec.finish
        last_tok, n_out, preempts, itl, index = (rec.last_tok, rec.n_out, rec.preempts, rec.itl,
                                                 rec.index)
        st = self.steps
        st_t, st_dt, st_tok, st_pre = st["t"], st["dt"], st["tokens"], st["prefill_tokens"]
        st_reqs, st_kv, st_run, st_wait = st["reqs"], st["kv_usage"], st["running"], st["waiting"]
        st_draft, st_acc = st["draft_tokens"], st["accepted_tokens"]
        one = [SAMPLED_TOKEN]
        step_time = cost.step_time
        has_work = driver.has_work

        t = 0.0
        host = 0.0      # measured host time of the previous update_from_output, if included
        until = yield t
        while True:
            if not has_work():
                if t < until < INF:     # idle: jump to the next arrival
                    t = until
                until = yield t
                continue
            if t >= until:
                until = yield t
                continue
            if include_scheduler_time:
                h0 = time.perf_counter()
                so = driver.schedule()
                host += time.perf_counter() - h0
            else:
                so = driver.schedule()
            num_sched = so.num_scheduled_tokens
            if not num_sched:
                if until < INF:     # nothing fits until more work arrives (or the batch drains)
                    t = max(t, until)
                    continue
                raise RuntimeError(f"no progress at t={t:.3f}s: {len(sched.waiting)} waiting "
                                   f"requests can never be admitted ({sched.config})")
            pad_n, pad_ctx = driver.padding()
            sd = so.scheduled_spec_decode_tokens
            if sd:
                dt = step_time(num_sched, requests, pad_n, pad_ctx, sd) + host
                sampled, drafted, accepted = spec.sampled(num_sched, sd, one)
            else:       # callers' cost models need not know the spec argument
                dt = step_time(num_sched, requests, pad_n, pad_ctx) + host
                sampled, drafted, accepted = dict.fromkeys(num_sched, one), 0, 0
            host = 0.0
            t0 = t
            t += dt
            for rid in so.scheduled_new_req_ids:
                first_sched[index[rid]] = t0
            if so.preempted_req_ids:
                for rid in so.preempted_req_ids:
                    preempts[index[rid]] += 1
            st_t.append(t0)
            st_dt.append(dt)
            st_tok.append(so.total_num_scheduled_tokens)
            st_reqs.append(len(num_sched))
            st_pre.append(so.total_num_scheduled_tokens - [*num_sched.values()].count(1)
                          - drafted - len(sd))
            st_draft.append(drafted)
            st_acc.append(accepted)
            st_kv.append(kvm.usage)
            st_run.append(len(sched.running))
            st_wait.append(driver.num_waiting())

            if include_scheduler_time:
                h0 = time.perf_counter()
            outs = sched.update_from_output(so, sampled)
            if include_scheduler_time:
                host = time.perf_counter() - h0
            done = 0
            for o in outs:
                i = index[o.request_id]
                last = last_tok[i]
                if last < 0:
                    first_tok[i] = t
                else:
                    itl.append(t - last)
                last_tok[i] = t
                n_out[i] += len(o.new_token_ids)
                if o.finished:
                    finish[i] = t
                    done += 1
                    if on_finish is not None:
                        on_finish(i, t)
            if spec is not None:
                sched.update_draft_token_ids(spec.propose(sched.running))
            if step_hook is not None:
                step_hook(driver, so, outs, t0, t)
            if pbar is not None and done:
                pbar.update(done)


def step_arrays(steps: dict[str, array]) -> dict[str, np.ndarray]:
    return {k: np.frombuffer(v, dtype=np.float64) for k, v in steps.items()}


def make_result(policy: str, wl: Workload, config: SchedulerConfig, rec: Records,
                steps: dict[str, np.ndarray], sim_time: float, wall0: float,
                spec: SpecDecodingStats | None) -> SimResult:
    return SimResult(
        policy=policy, workload=wl.name, config=config, arrival=wl.arrivals.copy(),
        prompt_lens=wl.prompt_lens.copy(), output_lens=wl.output_lens.copy(),
        first_scheduled=np.array(rec.first_sched), first_token=np.array(rec.first_tok),
        finish=np.array(rec.finish), num_output=np.array(rec.n_out, dtype=np.int64),
        preemptions=np.array(rec.preempts, dtype=np.int64),
        itl=np.frombuffer(rec.itl, dtype=np.float64), steps=steps,
        sim_time=sim_time, wall_time=time.perf_counter() - wall0, num_clipped=wl.num_clipped,
        spec=spec)


def simulate(wl: Workload, cost: CostModel, config: SchedulerConfig, policy: str = "vllm", *,
             include_scheduler_time: bool = False, progress: bool = False,
             step_hook: Callable | None = None, spec_acceptance: float = 0.7,
             spec_seed: int = 0) -> SimResult:
    """Replay `wl` through a Scheduler(config) driven as `policy`; see the module docstring.
    Requests longer than config.max_model_len are shortened first (counted in num_clipped).
    spec_acceptance / spec_seed: the per-draft acceptance probability and its generator's seed,
    used only with config.speculative_config.

    step_hook(driver, scheduler_output, engine_outputs, t_start, t_end) is called after each
    step (the HTML step viewer records its frames this way).
    """
    wall0 = time.perf_counter()
    wl = clip_to_model_len(wl, config.max_model_len)
    n = len(wl)
    rec = Records(n)
    spec = (SyntheticSpec(config, spec_acceptance, spec_seed)
            if config.speculative_config is not None else None)
    pbar = None
    if progress:
        from tqdm import tqdm
        pbar = tqdm(total=n, unit="req", desc=f"simulate {policy}", mininterval=0.5)
    rep = Replica(config, cost, policy, rec, spec=spec,
                  include_scheduler_time=include_scheduler_time, step_hook=step_hook, pbar=pbar)
    sp_cache: dict[int, SamplingParams] = {}
    arrivals = wl.arrivals.tolist()
    for i in range(n):
        rep.advance(arrivals[i])
        rep.add(i, _make_request(wl, i, sp_cache))
    t = rep.advance(INF)
    if pbar is not None:
        pbar.close()
    return make_result(policy, wl, config, rec, step_arrays(rep.steps), t, wall0,
                       rep.scheduler.spec_stats.copy() if spec is not None else None)
