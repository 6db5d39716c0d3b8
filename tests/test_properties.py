"""Property-based tests for the scheduler and the paged KV cache (hypothesis).

Random add / schedule / random outputs / abort / reset_prefix_cache sequences over small pools
(so that preemption and prefix-cache sharing happen all the time). After every operation the
bookkeeping invariants (each block held or free, never both; ref counts match the block
tables; every prefix-cache entry is computed KV) are checked; a fake executor follows
SchedulerOutput.block_ids and writes a fake KV cache, so that every prefix-cache entry and every
request's attended context can be checked against what was really "computed". At the end the
scheduler is drained: every request must finish exactly once and every block must be free.

The fake KV cache stores, per slot (block_id * block_size + offset), a fingerprint of the whole
prefix up to and including that position: in a real model a position's K/V depends on every
earlier token, so two requests may only share a slot when their prefixes agree.
"""
from __future__ import annotations

import random
from collections import Counter

from hypothesis import HealthCheck, event, given, note, settings, target
from hypothesis import strategies as st

from kvflow import SamplingParams, StructuredOutputsParams
from kvflow.core import Request, RequestStatus, Scheduler, SchedulerConfig

VOCAB = 4                       # tiny vocabulary: prefixes are shared all the time
DRAIN_STEPS = 20_000            # upper bound on steps to finish everything (livelock check)

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                      HealthCheck.data_too_large])


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------------
@st.composite
def scheduler_configs(draw, tight: bool = False, policy: str | None = None) -> SchedulerConfig:
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    if tight:
        num_blocks = draw(st.integers(4, 14))
        max_num_seqs = draw(st.integers(2, 8))
    else:
        # at most ~160 token slots, so that a few requests fill the pool
        num_blocks = draw(st.integers(4, max(4, min(40, 160 // block_size))))
        max_num_seqs = draw(st.integers(1, 8))
    return SchedulerConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_batched_tokens=draw(st.integers(1, 64)),
        max_num_seqs=max_num_seqs,
        max_model_len=draw(st.integers(8, 128)),
        enable_prefix_caching=draw(st.booleans()),
        enable_chunked_prefill=draw(st.booleans()),
        long_prefill_token_threshold=draw(st.integers(0, 8)),
        policy=policy or draw(st.sampled_from(["fcfs", "priority"])),
        watermark=draw(st.sampled_from([0.0, 0.0, 0.1, 0.2, 0.3])),
        reserve_full_sequence=draw(st.booleans()),
    )


def draw_prompt(data, base: list[int], config: SchedulerConfig) -> list[int]:
    """A prompt that often shares a prefix with `base` (and so with other prompts), usually
    small enough for a few requests to share the pool, sometimes too long to be accepted."""
    if data.draw(st.integers(0, 30), label="empty?") == 0:
        return []
    pool_tokens = config.num_blocks * config.block_size
    if data.draw(st.integers(0, 5), label="any length?") == 0:
        max_len = min(60, config.max_model_len + 2, pool_tokens + 2)
    else:
        max_len = min(60, config.max_model_len - 1, pool_tokens // 2)
    length = data.draw(st.integers(1, max(1, max_len)), label="prompt_len")
    shared = data.draw(st.integers(0, length), label="shared_prefix")
    shared = min(shared, len(base))
    # token values from a drawn seed: far fewer hypothesis choices than one per token
    tail_seed = data.draw(st.integers(0, 2**16), label="tail_seed")
    tail = random.Random(tail_seed).choices(range(VOCAB), k=length - shared)
    return base[:shared] + tail


def draw_sampling(data, long_running: bool = False, config: SchedulerConfig | None = None):
    cap = 30 if config is None else max(1, min(30, config.num_blocks * config.block_size // 2))
    max_tokens = data.draw(st.integers(1, cap), label="max_tokens")
    min_tokens = data.draw(st.one_of(st.just(0), st.integers(0, max_tokens)), label="min_tokens")
    if long_running:
        eos = data.draw(st.one_of(st.none(), st.integers(0, VOCAB - 1)), label="eos")
        ignore_eos = data.draw(st.booleans(), label="ignore_eos") if eos is not None else False
        stop_ids = data.draw(st.one_of(st.just([]), st.lists(st.integers(0, VOCAB + 2),
                                                             max_size=1)), label="stop_ids")
    else:
        eos = data.draw(st.one_of(st.none(), st.integers(0, VOCAB - 1)), label="eos")
        ignore_eos = data.draw(st.booleans(), label="ignore_eos")
        stop_ids = data.draw(st.one_of(st.just([]), st.lists(st.integers(0, VOCAB + 2),
                                                             max_size=2)), label="stop_ids")
    # A grammar changes nothing the scheduler decides; it only asks for a bitmask row.
    grammar = StructuredOutputsParams(regex="a+") if data.draw(st.booleans(),
                                                               label="grammar") else None
    sp = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos,
                        stop_token_ids=stop_ids, temperature=0.0, structured_outputs=grammar)
    return sp, eos


# ---------------------------------------------------------------------------------------------
# The harness: a scheduler, a model of what it should hold, and a fake executor with a fake KV.
# ---------------------------------------------------------------------------------------------

def join_free_queue(free_ids: list[int], b: int, kvm) -> None:
    """The rule for a freed block (last block first): a hashed one joins the tail (LRU), an
    unhashed one the head, to be reused before any block a prefix-cache hit could revive."""
    if kvm.block_hash(b) is None:
        free_ids.insert(0, b)
    else:
        free_ids.append(b)

class Harness:
    def __init__(self, config: SchedulerConfig, token_seed: int = 0,
                 model_sampler: bool = False, check_kv: bool = True) -> None:
        self.cfg = config
        self.bs = config.block_size
        self.sched = Scheduler(config)
        self.rng = random.Random(token_seed)
        self.model_sampler = model_sampler      # tokens derived from the fake KV (determinism)
        self.check_kv = check_kv
        self.clock = 0.0
        self.next_id = 0
        self.accepted: dict[str, Request] = {}
        self.int_id: dict[str, int] = {}
        self.live: dict[str, Request] = {}          # accepted and not finished (model)
        self.finished: dict[str, str] = {}          # rid -> "stop" | "length" | "abort"
        self.stream: dict[str, list[int]] = {}      # tokens seen in EngineCoreOutputs
        self.finished_since_schedule: set[str] = set()
        self.num_preempted = 0
        self.prev_block_ids: list[tuple[dict, dict]] = []   # (SchedulerOutput.block_ids, copy)
        self.kv: dict[int, int] = {}                # slot -> prefix fingerprint
        self.fp: dict[str, list[int]] = {}          # rid -> per-position prefix fingerprints
        self.hash_content: dict[int, tuple] = {}    # block hash -> fingerprints it must hold
        self.hashes_seen: dict[str, int] = {}
        self.stats = Counter()

    # ---- helpers ----------------------------------------------------------------------------
    def fingerprints(self, req: Request) -> list[int]:
        """fp[p] identifies all_token_ids[:p+1]; extended as the request grows."""
        fp = self.fp.setdefault(req.request_id, [])
        toks = req.all_token_ids
        for p in range(len(fp), len(toks)):
            fp.append(hash((fp[p - 1] if p else -1, p, toks[p])))
        return fp

    def slot(self, table: list[int], pos: int) -> int:
        return table[pos // self.bs] * self.bs + pos % self.bs

    # ---- operations ---------------------------------------------------------------------------
    def add(self, prompt, sp, eos, priority, rid=None) -> bool:
        s, c = self.sched, self.cfg
        if rid is None:
            rid = f"r{self.next_id}"
            self.next_id += 1
        req = Request(rid, prompt, sp, eos_token_id=eos, arrival_time=self.clock,
                      priority=priority)
        n = len(prompt)
        longest = min(n + sp.max_tokens - 1, c.max_model_len)
        expect_reject = (rid in self.live or n == 0 or n >= c.max_model_len
                         or ceil_div(longest, self.bs) > c.num_blocks
                         # kvflow also refuses a prompt that could never be scheduled whole
                         or (not c.enable_chunked_prefill and n > c.max_num_batched_tokens))
        before_w = [r.request_id for r in s.waiting]
        before_n = s.get_num_unfinished_requests()
        try:
            s.add_request(req)
        except ValueError:
            assert expect_reject, f"add_request rejected a valid request {rid} ({n} tokens)"
            # not queued
            assert [r.request_id for r in s.waiting] == before_w
            assert s.get_num_unfinished_requests() == before_n
            if rid not in self.live:
                assert rid not in s.requests
            else:
                assert s.requests[rid] is self.live[rid]
            self.stats["rejected"] += 1
            return False
        assert not expect_reject, f"add_request accepted an invalid request {rid} ({n} tokens)"
        assert s.requests[rid] is req and req.status == RequestStatus.WAITING
        self.accepted[rid] = req
        self.int_id[rid] = int(rid[1:])     # depends on the id only, not on what was accepted
        self.live[rid] = req
        self.stream[rid] = []
        return True

    def abort(self, rid: str) -> None:
        s, kvm = self.sched, self.sched.kv_cache_manager
        blocks = kvm.block_pool.blocks
        free_before = kvm.free_block_ids()
        table = kvm.get_block_ids(rid)
        refs = {b: blocks[b].ref_cnt for b in table}
        was_live = rid in self.live
        s.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
        if was_live:
            req = self.live.pop(rid)
            assert rid not in self.finished
            self.finished[rid] = "abort"
            self.finished_since_schedule.add(rid)
            assert req.status == RequestStatus.FINISHED_ABORTED and req.is_finished()
            assert req.get_finished_reason() == "abort"
            expected = list(free_before)
            for b in reversed(table):
                if refs[b] == 1:
                    join_free_queue(expected, b, kvm)
            assert kvm.free_block_ids() == expected
            self.stats["aborted"] += 1
        else:
            assert kvm.free_block_ids() == free_before
        assert rid not in s.requests
        assert kvm.get_block_ids(rid) == []

    def schedule(self):
        s, c, kvm = self.sched, self.cfg, self.sched.kv_cache_manager
        old_running = list(s.running)
        old_index = {r.request_id: i for i, r in enumerate(old_running)}
        old_computed = {r.request_id: r.num_computed_tokens for r in old_running}
        pre_waiting = [r.request_id for r in s.waiting]
        had_unfinished = s.has_unfinished_requests()
        old_preemptions = {rid: r.num_preemptions for rid, r in self.live.items()}
        old_stats = s.make_stats()
        old_cached = set(kvm.block_pool.cached) if not old_running else None

        so = s.schedule()

        # earlier SchedulerOutputs keep the block tables they were given
        for given, copy in self.prev_block_ids:
            assert given == copy, "a block table handed out in a SchedulerOutput was mutated"
        self.prev_block_ids = self.prev_block_ids[-3:] + [
            (so.block_ids, {k: list(v) for k, v in so.block_ids.items()})]

        sched_ids = list(so.num_scheduled_tokens)
        n_by = so.num_scheduled_tokens
        assert so.total_num_scheduled_tokens == sum(n_by.values())
        assert so.total_num_scheduled_tokens <= c.max_num_batched_tokens
        assert all(n > 0 for n in n_by.values()), f"request scheduled with 0 tokens: {n_by}"
        assert set(so.block_ids) == set(n_by)
        assert not (so.preempted_req_ids & set(n_by)), "a preempted request is also scheduled"
        assert so.finished_req_ids == self.finished_since_schedule
        self.finished_since_schedule = set()
        new, resumed, cont = (so.scheduled_new_req_ids, so.scheduled_resumed_req_ids,
                              so.scheduled_running_req_ids)
        assert len(new) + len(resumed) + len(cont) == len(n_by)
        assert set(new) | set(resumed) | set(cont) == set(n_by)
        assert set(cont) <= set(old_index)
        # running requests are served in order
        assert [old_index[r] for r in cont] == sorted(old_index[r] for r in cont)
        admitted = set(new) | set(resumed)
        assert not (admitted & set(old_index))
        if had_unfinished and not so.total_num_scheduled_tokens:
            # a step that preempts nothing always makes progress
            assert so.preempted_req_ids, "nothing scheduled, nothing preempted: livelock"
            self.stats["empty_step"] += 1

        # preemption
        preempted = so.preempted_req_ids
        assert preempted <= set(old_index)
        self.num_preempted += len(preempted)
        if preempted:
            self.stats["preempt_steps"] += 1
            assert not admitted, "waiting requests admitted in a step that preempted"
        for rid in preempted:
            req = s.requests[rid]
            assert req.status == RequestStatus.PREEMPTED
            assert req.num_computed_tokens == 0 and kvm.get_block_ids(rid) == []
            assert req.num_preemptions == old_preemptions[rid] + 1
        kept = [r.request_id for r in old_running if r.request_id not in preempted]
        run_ids = [r.request_id for r in s.running]
        assert run_ids[:len(kept)] == kept
        assert set(run_ids[len(kept):]) == admitted and len(run_ids) == len(kept) + len(admitted)
        if c.policy == "fcfs":
            # victims come from the tail and go to the front of waiting, oldest first
            assert all(old_index[k] < old_index[v] for k in kept for v in preempted)
            if preempted:
                assert [r.request_id for r in s.waiting] == (
                    sorted(preempted, key=old_index.get) + pre_waiting)
        else:
            # victims have the largest (priority, arrival_time) of the running requests
            for v in preempted:
                kv_ = (s.requests[v].priority, s.requests[v].arrival_time)
                assert all((s.requests[k].priority, s.requests[k].arrival_time) <= kv_
                           for k in kept)
            unscheduled = [v for v in preempted
                           if any(old_index[r] > old_index[v] for r in cont)]
            if unscheduled:
                self.stats["unscheduled_victims"] += len(unscheduled)
        # admission: a prefix of the waiting queue, no skipping
        assert admitted == set(pre_waiting[:len(admitted)]), (admitted, pre_waiting)
        for rid in new:
            req = s.requests[rid]
            assert req.num_preemptions == 0
            if not c.enable_chunked_prefill:
                assert req.num_computed_tokens == req.num_tokens, "prompt chunked without chunking"
        for rid in resumed:
            assert s.requests[rid].num_preemptions > 0
            self.stats["resumed"] += 1
        for rid in admitted:
            req = s.requests[rid]
            assert req.status == RequestStatus.RUNNING
            assert req.num_cached_tokens % self.bs == 0
            assert req.num_cached_tokens < req.num_tokens
            assert req.num_cached_tokens + n_by[rid] == req.num_computed_tokens
            if not c.enable_prefix_caching:
                assert req.num_cached_tokens == 0
            if req.num_cached_tokens:
                self.stats["prefix_hit"] += 1
        if not preempted:
            # Nothing preempted: the running requests served are a prefix of `running` (the
            # rest only for lack of budget) and every request got exactly
            # min(remaining, long_prefill_token_threshold, budget left, max_model_len - 1 -
            # computed) tokens; without chunked prefill an admission is not cut by the threshold.
            old_ids = [r.request_id for r in old_running]
            assert cont == old_ids[:len(cont)]
            budget = c.max_num_batched_tokens
            thr = c.long_prefill_token_threshold
            # ... except a request alone in the system (one request, nothing else running or
            # waiting), which the threshold does not cap.
            alone_running = len(old_running) == 1 and not pre_waiting
            alone_admitted = not old_running and len(pre_waiting) == 1
            for rid in cont + run_ids[len(kept):]:
                req = s.requests[rid]
                start = old_computed[rid] if rid in old_index else req.num_cached_tokens
                want = min(req.num_tokens - start, budget, c.max_model_len - 1 - start)
                alone = alone_running if rid in old_index else alone_admitted
                if thr and not alone and (rid in old_index or c.enable_chunked_prefill):
                    want = min(want, thr)
                assert n_by[rid] == want, (rid, n_by[rid], want)
                budget -= want
            if len(cont) < len(old_ids):
                assert budget == 0, "a running request was left out with budget to spare"
            # watermark: kept free after an admission while something else was running
            if admitted and c.watermark_blocks and (kept or len(admitted) > 1):
                assert kvm.num_free_blocks >= c.watermark_blocks
            # reserve_full_sequence: the last admitted request had room for its whole sequence
            if admitted and c.reserve_full_sequence:
                last = s.requests[run_ids[-1]]
                full = ceil_div(min(last.num_tokens, c.max_model_len), self.bs)
                reserve = c.watermark_blocks if (kept or len(admitted) > 1) else 0
                assert kvm.num_free_blocks >= full - len(kvm.get_block_ids(last.request_id)) \
                    + reserve, "admitted without room for the whole sequence"
        if old_cached is not None and admitted and c.enable_prefix_caching:
            # Nothing ran before the first admission's lookup, so the cache it saw is the one
            # before schedule(): its hit is the longest cached chain of whole blocks, capped
            # to leave at least one token to compute.
            first = s.requests[run_ids[0]]
            hashes = getattr(first, "block_hashes", None)
            if hashes is not None:
                cap = (first.num_tokens - 1) // self.bs
                hit = 0
                while hit < cap and hashes[hit] in old_cached:
                    hit += 1
                assert first.num_cached_tokens == hit * self.bs, (
                    f"{first.request_id}: hit {first.num_cached_tokens} tokens, the cache held "
                    f"{hit * self.bs}")
        # prefix-cache stats: counted once per admission, in tokens
        stats = s.make_stats()
        if c.enable_prefix_caching:
            assert stats.prefix_cache_queries - old_stats.prefix_cache_queries == sum(
                s.requests[rid].num_tokens for rid in admitted)
            assert stats.prefix_cache_hits - old_stats.prefix_cache_hits == sum(
                s.requests[rid].num_cached_tokens for rid in admitted)
        for rid in cont:
            req = s.requests[rid]
            assert req.num_computed_tokens == old_computed[rid] + n_by[rid]
        for rid in sched_ids:
            req = s.requests[rid]
            assert req.num_computed_tokens <= req.num_tokens
            assert req.num_computed_tokens <= c.max_model_len - 1
            assert so.block_ids[rid] == kvm.get_block_ids(rid)
            alone = len(old_running) + len(pre_waiting) == 1
            if c.enable_chunked_prefill and c.long_prefill_token_threshold and not alone:
                assert n_by[rid] <= c.long_prefill_token_threshold
        self.execute_writes(so)
        check_state(self)
        return so

    def execute_writes(self, so) -> None:
        """The fake executor: write this step's KV into the slots the block tables name."""
        s = self.sched
        writes: dict[int, int] = {}
        for rid, n in so.num_scheduled_tokens.items():
            req = s.requests[rid]
            cnum = req.num_computed_tokens
            table = so.block_ids[rid]
            assert len(table) >= ceil_div(cnum, self.bs)
            fp = self.fingerprints(req)
            for pos in range(cnum - n, cnum):
                slot = self.slot(table, pos)
                old = writes.get(slot)
                assert old is None or old == fp[pos], (
                    f"two requests write different KV into slot {slot} in one step")
                writes[slot] = fp[pos]
        # In a forward pass every layer writes the whole batch's K/V before attention reads it,
        # so KV written this step by one request is visible to another in the same step.
        if self.check_kv:
            for rid, n in so.num_scheduled_tokens.items():
                req = s.requests[rid]
                start = req.num_computed_tokens - n
                fp, table = self.fp[req.request_id], so.block_ids[rid]
                for pos in range(start):
                    slot = self.slot(table, pos)
                    if slot not in self.kv or self.kv[slot] != fp[pos]:
                        assert writes.get(slot) == fp[pos], (
                            f"{rid} attends to invalid KV at position {pos} (slot {slot}, "
                            f"block {table[pos // self.bs]})")
                        self.stats["same_step_context"] += 1
        self.kv.update(writes)
        if self.check_kv:
            self.check_kv_contents()

    def check_kv_contents(self) -> None:
        """Every running request's computed context, and every cached block, is real KV."""
        s, kvm, bs = self.sched, self.sched.kv_cache_manager, self.bs
        kv = self.kv
        for req in s.running:
            fp, table = self.fingerprints(req), kvm.get_block_ids(req.request_id)
            for pos in range(req.num_computed_tokens):
                assert kv.get(self.slot(table, pos)) == fp[pos], (
                    f"{req.request_id}: KV of position {pos} is not what was computed")
        # what each block hash stands for, learnt from the requests' own hash chains
        for rid, req in self.accepted.items():
            hashes = getattr(req, "block_hashes", None)
            if not hashes:
                continue
            fp = self.fingerprints(req)
            for i in range(self.hashes_seen.get(rid, 0), len(hashes)):
                content = tuple(fp[i * bs:(i + 1) * bs])
                assert len(content) == bs
                assert self.hash_content.setdefault(hashes[i], content) == content
            self.hashes_seen[rid] = len(hashes)
        for b in kvm.block_pool.blocks:
            h = b.block_hash
            if h is None:
                continue
            assert h in self.hash_content, f"block {b.block_id} has a hash no request produced"
            got = tuple(kv.get(b.block_id * bs + o) for o in range(bs))
            assert got == self.hash_content[h], (
                f"block {b.block_id} is in the prefix cache but its KV was never computed "
                f"(ref_cnt={b.ref_cnt})")

    def sample(self, so, sampling: list[str]) -> dict[str, list[int]]:
        s = self.sched
        out: dict[str, list[int]] = {}
        if self.model_sampler:
            # greedy "model": the next token is a function of the KV context it reads
            for rid in sampling:
                req = s.requests[rid]
                table = so.block_ids[rid]
                ctx = tuple(self.kv.get(self.slot(table, p)) for p in range(req.num_tokens))
                out[rid] = [hash((self.int_id[rid], ctx)) % VOCAB]
            return out
        rng = self.rng
        for rid in so.num_scheduled_tokens:
            if rid in sampling or rng.random() < 0.3:    # partial prefills: garbage, dropped
                k = 2 if rng.random() < 0.1 else 1
                out[rid] = [rng.randrange(VOCAB + 1) for _ in range(k)]
        return out

    def update(self, so, sampling: list[str], sampled: dict[str, list[int]]) -> None:
        s, kvm = self.sched, self.sched.kv_cache_manager
        blocks = kvm.block_pool.blocks
        free_before = kvm.free_block_ids()
        tables = {r.request_id: kvm.get_block_ids(r.request_id) for r in s.running}
        refs = {b.block_id: b.ref_cnt for b in blocks}
        live_sampling = [rid for rid in sampling if rid in self.live]
        outs = s.update_from_output(so, sampled)
        seen = set()
        expected_free = list(free_before)
        for o in outs:
            rid = o.request_id
            assert rid not in seen, f"two outputs for {rid}"
            seen.add(rid)
            assert rid in live_sampling, f"output for {rid}, which did not sample this step"
            given = sampled[rid]
            assert o.new_token_ids and o.new_token_ids == given[:len(o.new_token_ids)]
            if not o.finished:
                assert o.new_token_ids == given
                assert o.finish_reason is None
            self.stream[rid].extend(o.new_token_ids)
            req = self.live[rid]
            assert self.stream[rid] == req.output_token_ids
            assert req.all_token_ids == req.prompt_token_ids + req.output_token_ids
            if o.finished:
                assert o.finish_reason in ("stop", "length")
                assert req.is_finished() and req.get_finished_reason() == o.finish_reason
                assert o.stop_reason == req.stop_reason
                self.live.pop(rid)
                assert rid not in self.finished
                self.finished[rid] = o.finish_reason
                self.finished_since_schedule.add(rid)
                self.stats["finished_" + o.finish_reason] += 1
                for b in reversed(tables[rid]):
                    refs[b] -= 1
                    if refs[b] == 0:
                        join_free_queue(expected_free, b, kvm)
            else:
                assert req.status == RequestStatus.RUNNING
        assert seen == set(live_sampling), "a sampling request got no output"
        assert kvm.free_block_ids() == expected_free
        check_state(self)

    def step(self, abort_mid: str | None = None):
        so = self.schedule()
        s = self.sched
        sampling = [rid for rid in so.num_scheduled_tokens
                    if s.requests[rid].num_computed_tokens == s.requests[rid].num_tokens]
        assert so.structured_output_request_ids == [
            rid for rid in sampling if s.requests[rid].use_structured_output]
        sampled = self.sample(so, sampling)
        if abort_mid is not None:
            # an abort that arrives while the step runs: its late output is dropped
            self.abort(abort_mid)
            check_state(self)
        self.update(so, sampling, sampled)
        self.clock += 1.0
        return so

    def reset_prefix_cache(self) -> None:
        s, kvm = self.sched, self.sched.kv_cache_manager
        all_free = kvm.num_free_blocks == self.cfg.num_blocks
        ok = s.reset_prefix_cache()
        assert ok == all_free
        if ok:
            assert all(b.block_hash is None for b in kvm.block_pool.blocks)
        check_state(self)

    def state_signature(self) -> tuple:
        """Everything the scheduler's next decisions depend on (not counters)."""
        s, kvm = self.sched, self.sched.kv_cache_manager
        return (tuple((r.request_id, r.num_computed_tokens, r.num_tokens,
                       tuple(kvm.get_block_ids(r.request_id))) for r in s.running),
                tuple((r.request_id, int(r.status), r.num_tokens) for r in s.waiting),
                tuple(kvm.free_block_ids()),
                tuple(b.block_hash for b in kvm.block_pool.blocks))

    def drain(self) -> int:
        """Step until everything finishes, detecting livelock: a whole scheduler state that
        recurs (tokens only grow, so nothing was sampled in between, and schedule() is
        deterministic: it would cycle forever), or too long a stretch in which nothing
        finishes. Without ties the most important running request (FCFS: the head) always
        progresses, so some request finishes within about the total length of the live
        requests; twice that plus a margin is the bound."""
        steps = stalled = 0
        seen: dict[tuple, int] = {}
        problem = None
        while self.sched.has_unfinished_requests():
            sig = self.state_signature()
            stall_limit = 100 + 2 * sum(min(r.num_prompt_tokens + r.max_tokens,
                                            self.cfg.max_model_len)
                                        for r in self.live.values())
            if sig in seen:
                problem = f"the scheduler state of step {seen[sig]} recurs at step {steps}"
            elif stalled > stall_limit or steps >= DRAIN_STEPS:
                problem = f"nothing finished in the last {stalled} of {steps} steps"
            if problem:
                break
            seen[sig] = steps
            done = len(self.finished)
            self.step()
            steps += 1
            stalled = 0 if len(self.finished) > done else stalled + 1
        assert problem is None, (
            f"livelock: {problem}; running={self.sched.running} "
            f"waiting={list(self.sched.waiting)}")
        return steps


# ---------------------------------------------------------------------------------------------
# The invariants, checked after every operation
# ---------------------------------------------------------------------------------------------
def check_state(h: Harness) -> None:
    s, c, bs = h.sched, h.cfg, h.bs
    kvm = s.kv_cache_manager
    pool = kvm.block_pool
    free_ids = kvm.free_block_ids()
    free_set = set(free_ids)
    assert len(free_set) == len(free_ids), "duplicate block in the free queue"
    assert kvm.num_free_blocks == len(free_ids)
    assert free_set <= set(range(c.num_blocks))

    running, waiting = list(s.running), list(s.waiting)
    run_ids = [r.request_id for r in running]
    wait_ids = [r.request_id for r in waiting]
    assert len(set(run_ids)) == len(run_ids) and len(set(wait_ids)) == len(wait_ids)
    assert not set(run_ids) & set(wait_ids)
    assert set(run_ids) | set(wait_ids) == set(s.requests) == set(h.live)
    assert len(run_ids) + len(wait_ids) == len(s.requests) == s.get_num_unfinished_requests()
    assert s.has_unfinished_requests() == bool(h.live)
    assert s._num_structured == sum(r.use_structured_output for r in s.requests.values())
    assert len(running) <= c.max_num_seqs
    for r in running:
        assert s.requests[r.request_id] is r and r.status == RequestStatus.RUNNING
    for r in waiting:
        assert s.requests[r.request_id] is r
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert r.num_computed_tokens == 0 and kvm.get_block_ids(r.request_id) == []
    if c.policy == "priority":
        keys = [(r.priority, r.arrival_time) for r in waiting]
        assert keys == sorted(keys), "priority waiting queue out of order"

    refs = Counter()
    for r in running:
        table = kvm.get_block_ids(r.request_id)
        assert len(set(table)) == len(table), f"{r.request_id}: a block twice in its table"
        assert 0 <= r.num_computed_tokens <= r.num_tokens
        assert r.num_tokens < c.max_model_len
        assert len(table) == ceil_div(r.num_computed_tokens, bs), (
            f"{r.request_id}: {len(table)} blocks for {r.num_computed_tokens} computed tokens")
        refs.update(table)
    num_hashed = 0
    for b in pool.blocks:
        assert b.ref_cnt >= 0, f"negative ref count on block {b.block_id}"
        assert b.ref_cnt == refs[b.block_id], (
            f"block {b.block_id}: ref_cnt {b.ref_cnt} but {refs[b.block_id]} tables hold it")
        assert (b.block_id in free_set) == (b.ref_cnt == 0), (
            f"block {b.block_id}: ref_cnt {b.ref_cnt}, in free queue: {b.block_id in free_set}")
        assert kvm.block_hash(b.block_id) == b.block_hash
        if b.block_hash is not None:
            num_hashed += 1
            assert c.enable_prefix_caching
            entry = pool.cached.get(b.block_hash)
            members = [entry] if not isinstance(entry, dict) else list(entry.values())
            assert b in members, f"block {b.block_id} carries a hash the cache does not map"
    total = 0
    for hsh, entry in pool.cached.items():
        members = [entry] if not isinstance(entry, dict) else list(entry.values())
        assert members
        for b in members:
            assert b.block_hash == hsh, f"hash maps to block {b.block_id}, which lost it"
        total += len(members)
    assert total == num_hashed

    for rid in h.finished:
        assert kvm.get_block_ids(rid) == []
    stats = s.make_stats()
    assert stats.num_running_reqs == len(running) and stats.num_waiting_reqs == len(waiting)
    assert stats.num_preemptions == h.num_preempted
    assert abs(stats.kv_cache_usage - (1 - len(free_ids) / c.num_blocks)) < 1e-9
    assert 0 <= stats.prefix_cache_hits <= stats.prefix_cache_queries
    if not c.enable_prefix_caching:
        assert stats.prefix_cache_queries == 0 and stats.prefix_cache_hits == 0


def check_final(h: Harness) -> None:
    s, c = h.sched, h.cfg
    kvm = s.kv_cache_manager
    check_state(h)
    assert not s.has_unfinished_requests() and not s.requests and not h.live
    assert not s.running and not list(s.waiting)
    assert kvm.num_free_blocks == c.num_blocks, "leaked KV blocks"
    assert sorted(kvm.free_block_ids()) == list(range(c.num_blocks))
    assert all(b.ref_cnt == 0 for b in kvm.block_pool.blocks)
    # every accepted request finished exactly once (double finishes fail in update/abort)
    assert set(h.finished) == set(h.accepted)
    for rid, req in h.accepted.items():
        sp = req.sampling_params
        out = req.output_token_ids
        assert h.stream[rid] == out, f"{rid}: streamed tokens differ from output_token_ids"
        assert len(out) <= sp.max_tokens
        assert req.num_prompt_tokens + len(out) <= c.max_model_len
        stop_ids = set(sp.stop_token_ids)
        eos = None if sp.ignore_eos else req.eos_token_id

        def stops(k: int) -> bool:     # would output token k (0-based) stop the request?
            return k + 1 >= sp.min_tokens and (out[k] == eos or out[k] in stop_ids)

        def capped(k: int) -> bool:
            return k + 1 >= sp.max_tokens or req.num_prompt_tokens + k + 1 >= c.max_model_len

        # no token before the last one should have finished the request
        for k in range(len(out) - 1):
            assert not stops(k) and not capped(k), f"{rid} ran past a stop at token {k}: {out}"
        reason = h.finished[rid]
        if reason == "abort":
            assert req.status == RequestStatus.FINISHED_ABORTED
            if out:
                assert not stops(len(out) - 1) and not capped(len(out) - 1)
        elif reason == "stop":
            assert req.status == RequestStatus.FINISHED_STOPPED
            assert out and stops(len(out) - 1), f"{rid}: stopped without a stop token: {out}"
            assert len(out) >= sp.min_tokens
            if out[-1] == eos:
                assert req.stop_reason is None
            else:
                assert req.stop_reason == out[-1]
        else:
            assert reason == "length" and req.status == RequestStatus.FINISHED_LENGTH_CAPPED
            assert out and capped(len(out) - 1) and not stops(len(out) - 1)
    if c.enable_prefix_caching:
        assert s.reset_prefix_cache()
        assert all(b.block_hash is None for b in kvm.block_pool.blocks)


# ---------------------------------------------------------------------------------------------
# Random operation sequences
# ---------------------------------------------------------------------------------------------
OPS = ["add"] * 7 + ["step"] * 9 + ["abort"] * 2 + ["abort_mid"] + ["reset"] + ["dup"]


def run_random_ops(data, h: Harness, max_ops: int, long_running: bool | None,
                   priorities: tuple[int, int] | str) -> None:
    c = h.cfg
    # sometimes a narrow priority range: ties in (priority, arrival_time) matter for victims;
    # or "inverted": every new request is more important than all earlier ones, so victims are
    # requests admitted earlier, already scheduled in the step when a later one runs short
    if priorities != "inverted":
        priorities = data.draw(st.sampled_from([priorities, (0, 0), (0, 1), "inverted"]),
                               label="priorities")
    num_adds = 0
    if long_running is None:
        long_running = data.draw(st.booleans(), label="long_running")
    base_seed = data.draw(st.integers(0, 2**16), label="base_seed")
    base = random.Random(base_seed).choices(range(VOCAB), k=60)
    num_ops = data.draw(st.integers(max_ops // 3, max_ops), label="num_ops")
    for _ in range(num_ops):
        op = data.draw(st.sampled_from(OPS), label="op")
        if op == "add":
            prompt = draw_prompt(data, base, c)
            sp, eos = draw_sampling(data, long_running, c)
            if priorities == "inverted":
                prio = 100 - num_adds
            else:
                prio = data.draw(st.integers(*priorities), label="priority")
            num_adds += 1
            h.add(prompt, sp, eos, prio)
        elif op == "dup" and h.live:
            rid = data.draw(st.sampled_from(sorted(h.live)), label="dup_id")
            sp, eos = draw_sampling(data, long_running)
            h.add([1, 2], sp, eos, 0, rid=rid)      # duplicate of a live id: rejected
        elif op == "step":
            h.step()
        elif op in ("abort", "abort_mid") and h.accepted:
            rid = data.draw(st.sampled_from(sorted(h.accepted)), label="abort_id")
            if op == "abort":
                h.abort(rid)
                check_state(h)
            else:
                h.step(abort_mid=rid)
        elif op == "reset":
            h.reset_prefix_cache()
    steps = h.drain()
    note(f"drained in {steps} steps; stats={dict(h.stats)}")
    check_final(h)


@settings(max_examples=250, **SETTINGS)
@given(data=st.data(), config=st.one_of(scheduler_configs(), scheduler_configs(tight=True)),
       seed=st.integers(0, 2**32 - 1))
def test_random_operations_keep_invariants(data, config, seed):
    """Random add / step / abort / abort-while-running / reset_prefix_cache sequences; every
    invariant after every operation, then a drain: no livelock, no leak, one finish each."""
    h = Harness(config, token_seed=seed)
    run_random_ops(data, h, max_ops=60, long_running=None, priorities=(0, 3))
    for k in h.stats:
        event(k)


@settings(max_examples=150, **SETTINGS)
@given(data=st.data(), config=scheduler_configs(tight=True, policy="priority"),
       seed=st.integers(0, 2**32 - 1))
def test_prefix_cache_and_context_are_computed_kv_under_priority_preemption(data, config, seed):
    """Tight pools, priority policy, long-running requests: many preemptions, including
    victims that were already scheduled in the step and must be unscheduled. The fake KV
    (checked in Harness.execute_writes / check_kv_contents) must always back every context
    a request attends to and every block in the prefix cache."""
    h = Harness(config, token_seed=seed)
    run_random_ops(data, h, max_ops=50, long_running=True, priorities=(0, 4))
    for k in h.stats:
        event(k)
    target(float(h.stats["unscheduled_victims"]), label="unscheduled victims")
    target(float(h.num_preempted), label="preemptions")


@st.composite
def victim_prone_configs(draw) -> SchedulerConfig:
    """Priority policy, small blocks, big prefill chunks: a victim scheduled earlier in the
    step has just cached several blocks it will now never compute."""
    return SchedulerConfig(
        block_size=draw(st.sampled_from([1, 2])),
        num_blocks=draw(st.integers(6, 16)),
        max_num_batched_tokens=draw(st.integers(4, 24)),
        max_num_seqs=draw(st.integers(2, 4)),
        max_model_len=draw(st.integers(16, 64)),
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 3, 5, 8])),
        policy="priority",
        watermark=0.0,
        reserve_full_sequence=draw(st.booleans()),
    )


@settings(max_examples=200, **SETTINGS)
@given(data=st.data(), config=victim_prone_configs(), seed=st.integers(0, 2**32 - 1))
def test_unscheduled_victims_leave_no_uncomputed_prefix_cache_entries(data, config, seed):
    """Each new request is more important than every earlier one, so the victims are requests
    already scheduled in the step (often mid-prefill, having just cached several blocks):
    unscheduling them must not leave cache entries whose KV the executor never writes."""
    h = Harness(config, token_seed=seed)
    run_random_ops(data, h, max_ops=40, long_running=True, priorities="inverted")
    for k in h.stats:
        event(k)
    target(float(h.stats["unscheduled_victims"]), label="unscheduled victims")


@settings(max_examples=800, **SETTINGS)
@given(data=st.data(), config=st.one_of(scheduler_configs(tight=True),
                                        scheduler_configs(tight=True, policy="priority")),
       seed=st.integers(0, 2**32 - 1))
def test_competing_requests_with_equal_keys_all_finish(data, config, seed):
    """A burst of long requests with the same priority and arrival time (what a client adding
    requests in a loop gets with a coarse clock) that the pool cannot hold all at once: each
    fits alone, so all of them must finish, whichever the policy, without livelock."""
    h = Harness(config, token_seed=seed)
    pool_tokens = config.num_blocks * config.block_size
    n = data.draw(st.integers(2, 4), label="n")
    prio = data.draw(st.integers(0, 2), label="priority")
    for _ in range(n):
        longest = min(pool_tokens, config.max_model_len)
        plen = data.draw(st.integers(1, max(1, min(longest - 1, 60))), label="prompt_len")
        max_tokens = data.draw(st.integers(1, max(1, min(30, longest - plen + 1))),
                               label="max_tokens")
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        h.add([data.draw(st.integers(0, VOCAB - 1), label="tok")] * plen, sp, None, prio)
    steps = h.drain()
    check_final(h)
    event(f"preempted: {h.num_preempted > 0}")
    note(f"drained in {steps} steps, {h.num_preempted} preemptions")


# ---------------------------------------------------------------------------------------------
# Determinism: greedy outputs do not depend on batching, chunking, preemption or cache hits
# ---------------------------------------------------------------------------------------------
def run_fixed_workload(config: SchedulerConfig, workload) -> tuple[dict[str, tuple], Harness]:
    h = Harness(config, model_sampler=True, check_kv=False)
    by_step: dict[int, list] = {}
    for item in workload:
        by_step.setdefault(item[0], []).append(item)
    last = max(by_step) if by_step else 0
    accepted = []
    for step_no in range(last + 1):
        for _, rid, prompt, sp, eos, prio in by_step.get(step_no, ()):
            if h.add(prompt, sp, eos, prio, rid=rid):
                accepted.append(rid)
        h.step()
    h.drain()
    check_final(h)
    return {rid: (tuple(h.accepted[rid].output_token_ids), h.finished[rid],
                  h.accepted[rid].stop_reason) for rid in accepted}, h


@st.composite
def workloads(draw, config: SchedulerConfig):
    """Requests sized to the pool (so that several compete for it), arriving over a few steps."""
    base = random.Random(draw(st.integers(0, 2**16))).choices(range(VOCAB), k=60)
    max_len = max(1, min(60, config.max_model_len - 1,
                         config.num_blocks * config.block_size * 2 // 3))
    n = draw(st.integers(1, 10))
    items = []
    for i in range(n):
        length = draw(st.integers(1, max_len))
        shared = draw(st.integers(0, length))
        tail_seed = draw(st.integers(0, 2**16))
        prompt = base[:shared] + random.Random(tail_seed).choices(range(VOCAB), k=length - shared)
        max_tokens = draw(st.integers(1, 30))
        # mostly long-running (EOS ignored or absent) so that decodes outgrow the pool
        ignore_eos = draw(st.sampled_from([True, True, False]))
        eos = draw(st.one_of(st.none(), st.integers(0, VOCAB - 1)))
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos,
                            min_tokens=draw(st.integers(0, max_tokens)),
                            stop_token_ids=draw(st.one_of(
                                st.just([]), st.lists(st.integers(0, VOCAB - 1), max_size=1))))
        items.append((draw(st.integers(0, 3)), f"q{i}", prompt, sp, eos,
                      draw(st.integers(0, 3))))
    return items


@st.composite
def configs_and_workloads(draw):
    config = draw(st.one_of(scheduler_configs(), scheduler_configs(tight=True),
                            scheduler_configs(tight=True, policy="priority")))
    return config, draw(workloads(config))


@settings(max_examples=250, **SETTINGS)
@given(config_and_workload=configs_and_workloads())
def test_greedy_outputs_independent_of_scheduling(config_and_workload):
    """The scheduler analogue of "greedy output does not depend on batching, chunking,
    preemption or prefix-cache hits": the fake model's next token is a function of the KV
    context it reads through the block tables, and every request's outputs must match those of
    a roomy run (no preemption, no prefix caching, no chunking pressure)."""
    config, workload = config_and_workload
    # enough blocks for every request at once, whatever its length: nothing is ever preempted
    roomy_blocks = len(workload) * ceil_div(config.max_model_len, config.block_size)
    roomy = SchedulerConfig(block_size=config.block_size, num_blocks=roomy_blocks,
                            max_num_batched_tokens=8192, max_num_seqs=256,
                            max_model_len=config.max_model_len, enable_prefix_caching=False,
                            enable_chunked_prefill=True)
    want, h_roomy = run_fixed_workload(roomy, workload)
    assert h_roomy.num_preempted == 0
    got, h = run_fixed_workload(config, workload)
    event(f"preempted: {h.num_preempted > 0}")
    event(f"prefix hits: {h.stats['prefix_hit'] > 0}")
    target(float(h.num_preempted), label="preemptions")
    assert set(got) <= set(want)
    for rid, res in got.items():
        assert res == want[rid], f"{rid}: {res} with {config}, {want[rid]} with a roomy config"
