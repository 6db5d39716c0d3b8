"""The scheduler: every step, one token budget shared by running requests, then waiting ones.

Follows vLLM V1: no prefill or decode phase, only requests
whose num_computed_tokens chases their num_tokens. Running requests are served first, in order,
preempting by recompute when blocks run out; waiting requests are admitted only in a step that
preempted nothing, in queue order, stopping at the first that does not fit.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from kvflow.core.config import SchedulerConfig, check_new_request
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.outputs import (CachedRequestData, EngineCoreOutput, ModelRunnerOutput,
                                 NewRequestData, SchedulerOutput, SchedulerStats,
                                 SpecDecodingStats)
from kvflow.core.request import Request, RequestStatus
from kvflow.core.request_queue import create_request_queue

_RUNNING = RequestStatus.RUNNING
_PREEMPTED = RequestStatus.PREEMPTED
_STOPPED = RequestStatus.FINISHED_STOPPED
_LENGTH = RequestStatus.FINISHED_LENGTH_CAPPED
_NO_TOKENS = ()     # shared, so immutable


class Scheduler:
    def __init__(self, config: SchedulerConfig | None = None) -> None:
        self.config = c = config if config is not None else SchedulerConfig()
        self.block_size = c.block_size
        self.max_model_len = c.max_model_len
        self.max_num_batched_tokens = c.max_num_batched_tokens
        self.max_num_seqs = c.max_num_seqs
        self.priority_policy = c.policy == "priority"
        self.async_scheduling = c.async_scheduling
        self.watermark_blocks = c.watermark_blocks
        self.kv_cache_manager = KVCacheManager(c.block_size, c.num_blocks, c.max_model_len,
                                               c.enable_prefix_caching)
        self.waiting = create_request_queue(c.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}      # unfinished requests only
        self.finished_req_ids: set[str] = set()     # finished since the last schedule()
        self._num_added = 0
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.spec_stats = SpecDecodingStats()
        self._num_structured = 0    # unfinished requests with a grammar: none, no scan

    # ---- requests in and out -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if not isinstance(request, Request):
            raise ValueError(f"add_request takes a Request, got {type(request).__name__}")
        rid, c = request.request_id, self.config
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use by an unfinished request")
        if request.status != RequestStatus.WAITING or request.output_token_ids:
            raise ValueError(f"request {rid!r} was already scheduled ({request.status.name})")
        check_new_request(c, rid, request.num_prompt_tokens, request.max_tokens)
        self._num_added += 1
        request.seq_no = self._num_added
        self.requests[rid] = request
        self._num_structured += request.use_structured_output
        self.waiting.add_request(request)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish (e.g. abort) requests from outside; unknown or finished ids are ignored."""
        if not RequestStatus.is_finished(status):
            raise ValueError(f"finish_requests needs a FINISHED_* status, got {status!r}")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        running, waiting = set(), set()
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            (running if req.status == _RUNNING else waiting).add(req)
            req.status = status
            self._free_request(req)
        if running:
            self.running[:] = [r for r in self.running if r not in running]
        if waiting:
            self.waiting.remove_requests(waiting)

    def _free_request(self, req: Request) -> None:
        self.kv_cache_manager.free(req)
        self.finished_req_ids.add(req.request_id)
        del self.requests[req.request_id]
        self._num_structured -= req.use_structured_output

    def _preempt(self, req: Request) -> None:
        self.kv_cache_manager.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.spec_token_ids = []
        self.num_preemptions += 1
        self.waiting.prepend_request(req)

    # ---- the step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        c = self.config
        kvm = self.kv_cache_manager
        kvm.take_new_block_ids()        # the last step's admissions: sent in full, not as new
        allocate = kvm.allocate_slots
        running = self.running
        budget = self.max_num_batched_tokens
        threshold = c.long_prefill_token_threshold
        last_pos = self.max_model_len - 1
        num_scheduled: dict[str, int] = {}
        block_ids: dict[str, list[int]] = {}
        sched_running_ids: list[str] = []
        sched_computed: list[int] = []      # their num_computed_tokens before this step
        new_reqs: list[NewRequestData] = []
        new_ids: list[str] = []
        resumed_ids: list[str] = []
        preempted: list[Request] = []
        spec_tokens: dict[str, list[int]] = {}

        # 1. Running requests, in order: decodes ask for 1 token (plus their draft tokens),
        # partial prefills for the rest. A request alone in the system is not capped: chunking
        # it would only add steps. Drafts that do not fit are cut. A token still in flight
        # (async scheduling) counts as known: its position is scheduled on a placeholder.
        alone = len(running) == 1 and not self.waiting
        async_ = self.async_scheduling
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            computed = req.num_computed_tokens
            num_tokens = len(req.all_token_ids)
            n = num_tokens + len(req.spec_token_ids) - computed
            if async_ and (in_flight := req.num_output_placeholders):
                if len(req.output_token_ids) + in_flight >= req.max_tokens:
                    i += 1      # its last token is in flight already: no step past max_tokens
                    continue
                n += in_flight
            if 0 < threshold < n and not alone:
                n = threshold
            if n > budget:
                n = budget
            if n > last_pos - computed:
                n = last_pos - computed
            if n <= 0:      # at max_model_len, or its sampled token never came back
                i += 1
                continue
            ids = allocate(req, n)
            while ids is None:
                victim = self._pick_victim()
                if victim.request_id in num_scheduled:     # priority only: undo its schedule
                    undone = num_scheduled.pop(victim.request_id)
                    budget += undone
                    victim.num_computed_tokens -= undone
                    del block_ids[victim.request_id]
                    spec_tokens.pop(victim.request_id, None)
                    k = sched_running_ids.index(victim.request_id)
                    del sched_running_ids[k], sched_computed[k]
                    kvm.uncache_uncomputed(victim)
                vi = len(running) - 1 if running[-1] is victim else running.index(victim)
                del running[vi]
                if vi < i:
                    i -= 1
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
                ids = allocate(req, n)
            if ids is None:
                break
            rid = req.request_id
            num_scheduled[rid] = n
            block_ids[rid] = ids
            sched_running_ids.append(rid)
            sched_computed.append(computed)
            req.num_computed_tokens = computed + n
            if req.spec_token_ids:
                if computed + n > num_tokens:
                    spec_tokens[rid] = req.spec_token_ids[:computed + n - num_tokens]
                req.spec_token_ids = []     # verified now or never: the next step proposes anew
            budget -= n
            i += 1
        cached = CachedRequestData(    # before admission: its allocations are not new blocks
            sched_running_ids, [_NO_TOKENS] * len(sched_running_ids),
            kvm.take_new_block_ids(), sched_computed)

        # 2. Waiting requests, only if nothing was preempted, in order, no skipping.
        if not preempted:
            self._admit_waiting(budget, num_scheduled, block_ids, new_reqs, new_ids, resumed_ids)

        out = SchedulerOutput(
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            scheduled_new_req_ids=new_ids,
            scheduled_resumed_req_ids=resumed_ids,
            scheduled_running_req_ids=sched_running_ids,
            preempted_req_ids={r.request_id for r in preempted},
            finished_req_ids=self.finished_req_ids,
            block_ids=block_ids,
            scheduled_spec_decode_tokens=spec_tokens,
        )
        if self._num_structured:
            out.structured_output_request_ids = self._sampling_structured(num_scheduled)
        if self.async_scheduling:
            self._add_placeholders(num_scheduled)
        self.finished_req_ids = set()
        return out

    def _add_placeholders(self, num_scheduled: dict[str, int]) -> None:
        """Async scheduling: a request whose scheduled tokens reach the end of its sequence
        (tokens in flight included) samples in this step: one more token in flight."""
        reqs = self.requests
        for rid in num_scheduled:
            req = reqs[rid]
            if req.num_computed_tokens >= len(req.all_token_ids) + req.num_output_placeholders:
                req.num_output_placeholders += 1

    def _sampling_structured(self, num_scheduled: dict[str, int]) -> list[str]:
        """The scheduled requests with a grammar that sample this step (their computed tokens
        reach their last token, tokens in flight included: a prefill chunk short of it samples
        nothing). Called before this step's placeholders are added."""
        reqs = self.requests
        return [rid for rid in num_scheduled if reqs[rid].use_structured_output
                and reqs[rid].num_computed_tokens >= len(reqs[rid].all_token_ids)
                + reqs[rid].num_output_placeholders]

    def _pick_victim(self) -> Request:
        if self.priority_policy:
            # vLLM's key is (priority, arrival_time); on a tie it takes the first in running
            # order, which changes as requests are re-admitted, and two tied requests can then
            # preempt each other forever. seq_no makes the order total, as in the waiting heap.
            return max(self.running, key=lambda r: (r.priority, r.arrival_time, r.seq_no))
        return self.running[-1]

    def _admit_waiting(self, budget: int, num_scheduled: dict[str, int],
                       block_ids: dict[str, list[int]], new_reqs: list[NewRequestData],
                       new_ids: list[str], resumed_ids: list[str]) -> None:
        c, kvm, waiting, running = self.config, self.kv_cache_manager, self.waiting, self.running
        threshold = c.long_prefill_token_threshold
        while waiting and budget > 0 and len(running) < self.max_num_seqs:
            req = waiting.peek_request()
            hits, num_hit = kvm.get_computed_blocks(req)
            num_tokens = len(req.all_token_ids)
            n = num_tokens - num_hit
            if c.enable_chunked_prefill:
                if 0 < threshold < n and (running or len(waiting) > 1):
                    n = threshold
            elif n > budget and n <= self.max_num_batched_tokens:
                break   # no chunking: the whole uncached part must fit in this step
            # (A resumed request longer than the whole budget is recomputed in chunks even
            # without chunked prefill; otherwise it could never run again.)
            n = min(n, budget, self.max_model_len - 1 - num_hit)
            watermark = self.watermark_blocks if running else 0
            ids = kvm.allocate_slots(req, n, num_hit, hits, watermark, c.reserve_full_sequence)
            if ids is None:
                break
            waiting.pop_request()
            rid = req.request_id
            (new_ids if req.status == RequestStatus.WAITING else resumed_ids).append(rid)
            req.status = _RUNNING
            req.num_computed_tokens = num_hit + n
            req.num_cached_tokens = num_hit
            if c.enable_prefix_caching:
                self.prefix_cache_queries += num_tokens
                self.prefix_cache_hits += num_hit
            running.append(req)
            new_reqs.append(NewRequestData(rid, req.prompt_token_ids, req.sampling_params, ids,
                                           num_hit, req.eos_token_id, req.output_token_ids[:]))
            num_scheduled[rid] = n
            block_ids[rid] = ids
            budget -= n

    # ---- results of the step -----------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput | dict[str, list[int]]
                           ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop rules, free finished requests' blocks.

        `model_runner_output`: the step's ModelRunnerOutput, or a dict of sampled tokens by
        request (the simulator's and the tests' fake executors). A request verified with drafts
        gets its accepted drafts plus one token; its num_computed_tokens steps back over the
        rejected ones (their KV is overwritten later). A request preempted while its step was
        in flight keeps the token that step sampled (it resumes with it)."""
        sampled_token_ids = (model_runner_output if isinstance(model_runner_output, dict)
                             else model_runner_output.sampled())
        requests = self.requests
        spec = scheduler_output.scheduled_spec_decode_tokens
        max_model_len = self.max_model_len
        async_ = self.async_scheduling
        outputs: list[EngineCoreOutput] = []
        num_finished = 0
        for rid in scheduler_output.num_scheduled_tokens:
            req = requests.get(rid)
            if req is None:
                continue                # finished (e.g. aborted) after it was scheduled
            toks = sampled_token_ids.get(rid)
            if not toks:
                continue
            all_ids = req.all_token_ids
            running = req.status == _RUNNING
            if running:
                # With no token in flight, a prefill chunk short of the end sampled nothing
                # (fake executors sample every row); with tokens in flight the runner decides.
                if req.num_computed_tokens < len(all_ids) and not req.num_output_placeholders:
                    continue
            elif req.status != _PREEMPTED:
                continue
            if async_ and req.num_output_placeholders:
                req.num_output_placeholders -= 1
            drafts = spec.get(rid) if spec and running else None
            if drafts:
                num_rejected = len(drafts) + 1 - len(toks)
                req.num_computed_tokens -= num_rejected
                self.spec_stats.observe(len(drafts), len(toks) - 1)
            out_ids = req.output_token_ids
            status = None
            for k, t in enumerate(toks):
                out_ids.append(t)
                all_ids.append(t)
                n_out = len(out_ids)
                if n_out >= req.min_tokens:
                    if t == req.stop_eos:
                        status = _STOPPED
                    elif req.stop_token_set is not None and t in req.stop_token_set:
                        status = _STOPPED
                        req.stop_reason = t
                if status is None and (n_out >= req.max_tokens or len(all_ids) >= max_model_len):
                    status = _LENGTH
                if status is not None:
                    if k + 1 < len(toks):
                        toks = toks[:k + 1]
                    break
            if status is None:
                if async_ and running:
                    self.kv_cache_manager.cache_known_blocks(req)
                outputs.append(EngineCoreOutput(rid, toks, None, None, req.num_cached_tokens))
            else:
                if running:
                    num_finished += 1
                else:
                    self.waiting.remove_requests({req})
                req.status = status
                self._free_request(req)
                outputs.append(EngineCoreOutput(rid, toks, req.get_finished_reason(),
                                                req.stop_reason, req.num_cached_tokens))
        if num_finished:
            self.running[:] = [r for r in self.running if r.status == _RUNNING]
        return outputs

    def update_draft_token_ids(self, drafts: dict[str, list[int]]) -> None:
        """Drafts to verify in the next step (a proposer's, after update_from_output); requests
        not running are skipped."""
        requests = self.requests
        for rid, toks in drafts.items():
            req = requests.get(rid)
            if req is not None and req.status == _RUNNING:
                req.spec_token_ids = list(toks)

    # ---- introspection -------------------------------------------------------------------
    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or bool(self.waiting)

    @property
    def num_structured_requests(self) -> int:
        """Unfinished requests with a grammar."""
        return self._num_structured

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            spec_decoding=(self.spec_stats.copy() if self.config.speculative_config is not None
                           or self.spec_stats.num_drafts else None),
        )


class AsyncScheduler(Scheduler):
    """The scheduler with async scheduling on, whatever the config says (vLLM's class name)."""

    def __init__(self, config: SchedulerConfig | None = None) -> None:
        super().__init__(dataclasses.replace(config or SchedulerConfig(), async_scheduling=True))
