"""Async scheduling: step N+1 is scheduled while step N runs, on output placeholders.

The rules: greedy output is token-identical with and without it (a property test over the
scheduler with a fake runner that keeps its own state as ModelRunner does, and real tiny models
through every path: chunked prefill, prefix hits, preemption, aborts, stop strings, structured
outputs, logprobs, tensor parallelism, the engine-core process); a request preempted while its
step is in flight keeps the token that step sampled; nothing leaks.
"""
from __future__ import annotations

import collections
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvflow import LLM, SamplingParams
from kvflow.core import (AsyncScheduler, ModelRunnerOutput, Request, RequestStatus, Scheduler,
                         SchedulerConfig)
from kvflow.engine.arg_utils import EngineArgs
from helpers import make_sched, req

VOCAB = 5


# ---- the scheduler ----------------------------------------------------------------------------
def test_a_request_preempted_while_its_step_runs_keeps_the_token_that_step_sampled():
    """vLLM's test_preempt_during_execution: two batches in flight, the second request is
    preempted by the first's growth before its own step's output arrives."""
    s = make_sched(block_size=16, num_blocks=10, max_num_batched_tokens=100,
                   enable_prefix_caching=False)
    r0, r1 = req("r0", 80, max_tokens=10), req("r1", 80, max_tokens=10)
    s.add_request(r0)
    so0 = s.schedule()
    assert list(so0.num_scheduled_tokens) == ["r0"] and len(so0.block_ids["r0"]) == 5
    s.add_request(r1)       # scheduled while r0's step is still running
    so1 = s.schedule()
    assert list(so1.num_scheduled_tokens) == ["r1"] and len(so1.block_ids["r1"]) == 5
    s.update_from_output(so0, ModelRunnerOutput(req_ids=["r0"], req_id_to_index={"r0": 0},
                                                sampled_token_ids=[[0]], logprobs=None,
                                                prompt_logprobs_dict={}, pooler_output=[]))
    s.schedule()            # r0 needs a sixth block: r1 is preempted
    assert s.running == [r0] and r1.status == RequestStatus.PREEMPTED
    s.update_from_output(so1, ModelRunnerOutput(req_ids=["r1"], req_id_to_index={"r1": 0},
                                                sampled_token_ids=[[42]]))
    assert r1.output_token_ids == [42] and r1.all_token_ids[-1] == 42


def test_a_request_preempted_while_its_step_runs_and_stopped_by_that_token_leaves_the_queue():
    s = make_sched(block_size=16, num_blocks=10, max_num_batched_tokens=100)
    r0, r1 = req("r0", 80, max_tokens=10), req("r1", 80, max_tokens=10, eos=7)
    s.add_request(r0)
    so0 = s.schedule()
    s.add_request(r1)
    so1 = s.schedule()
    s.update_from_output(so0, {"r0": [1]})
    s.schedule()
    assert r1.status == RequestStatus.PREEMPTED
    outs = s.update_from_output(so1, {"r1": [7]})
    assert [(o.request_id, o.finish_reason) for o in outs] == [("r1", "stop")]
    assert "r1" not in s.requests and list(s.waiting) == []


def test_a_token_in_flight_is_scheduled_on_a_placeholder():
    s = AsyncScheduler(SchedulerConfig(block_size=4, num_blocks=16))
    r = req("a", 6, max_tokens=3)
    s.add_request(r)
    so1 = s.schedule()
    assert so1.num_scheduled_tokens == {"a": 6} and r.num_output_placeholders == 1
    so2 = s.schedule()      # the prompt's token is in flight: its position runs next
    assert so2.num_scheduled_tokens == {"a": 1} and r.num_computed_tokens == 7
    assert r.num_output_placeholders == 2
    s.update_from_output(so1, {"a": [11]})
    assert r.output_token_ids == [11] and r.num_output_placeholders == 1
    so3 = s.schedule()
    assert so3.num_scheduled_tokens == {"a": 1} and r.num_output_placeholders == 2
    # max_tokens=3: the third token is in flight, so no fourth step is scheduled for it
    assert s.schedule().num_scheduled_tokens == {}
    s.update_from_output(so2, {"a": [12]})
    outs = s.update_from_output(so3, {"a": [13]})
    assert outs[0].finish_reason == "length" and r.output_token_ids == [11, 12, 13]
    assert not s.has_unfinished_requests()
    assert s.kv_cache_manager.num_free_blocks == 16


def test_a_structured_request_on_a_placeholder_still_asks_for_its_bitmask_row():
    from kvflow import StructuredOutputsParams
    s = AsyncScheduler(SchedulerConfig(block_size=4, num_blocks=16))
    s.add_request(req("g", 5, max_tokens=4, structured_outputs=StructuredOutputsParams(
        regex="a+")))
    assert s.schedule().structured_output_request_ids == ["g"]
    assert s.schedule().structured_output_request_ids == ["g"]     # its token is in flight


def test_async_scheduling_refuses_ngram_drafts_naming_both():
    with pytest.raises(ValueError, match="async_scheduling.*speculative_config"):
        EngineArgs(async_scheduling=True, speculative_config={"method": "ngram"})
    with pytest.raises(ValueError, match="async_scheduling.*speculative_config"):
        SchedulerConfig(async_scheduling=True,
                        speculative_config=EngineArgs(speculative_config={
                            "method": "ngram"}).speculative_config_obj())
    with pytest.raises(ValueError, match="async_scheduling.*speculative_config"):
        AsyncScheduler(SchedulerConfig(speculative_config=EngineArgs(speculative_config={
            "method": "ngram"}).speculative_config_obj()))
    assert not EngineArgs(speculative_config={"method": "ngram"}).resolved_async_scheduling(
        "cuda")


def test_the_flag_is_generated_from_engine_args():
    import argparse
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    for argv, want in (([], None), (["--async-scheduling"], True),
                       (["--no-async-scheduling"], False)):
        assert EngineArgs.from_cli_args(p.parse_args(argv)).async_scheduling is want


def test_the_default_is_on_with_cuda_and_off_on_cpu():
    assert EngineArgs().resolved_async_scheduling("cuda")
    assert not EngineArgs().resolved_async_scheduling("cpu")
    assert EngineArgs(async_scheduling=True).resolved_async_scheduling("cpu")


# ---- property: async == sync, with a fake runner --------------------------------------------
class FakeRunner:
    """ModelRunner's rules in miniature: its own request states built from SchedulerOutputs
    alone (its sampled tokens appended by itself), KV written through the block tables, and
    the next token a function of the context it reads back through them."""

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.reqs: dict[str, list] = {}     # rid -> [tokens, block table, computed]
        self.kv: dict[int, int] = {}         # slot -> fingerprint of the prefix it ends

    def slot(self, table, p):
        return table[p // self.bs] * self.bs + p % self.bs

    def execute(self, so) -> ModelRunnerOutput:
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.reqs.pop(rid, None)
        for nr in so.scheduled_new_reqs:
            self.reqs[nr.req_id] = [nr.prompt_token_ids + nr.output_token_ids,
                                    list(nr.block_ids), nr.num_computed_tokens]
        c = so.scheduled_cached_reqs
        for rid, computed in zip(c.req_ids, c.num_computed_tokens):
            self.reqs[rid][2] = computed
        for rid, blocks in c.new_block_ids.items():
            self.reqs[rid][1].extend(blocks)
        writes, spans = {}, []
        for rid, n in so.num_scheduled_tokens.items():
            toks, table, start = self.reqs[rid]
            assert start + n <= len(toks), f"{rid}: runs a token it does not know"
            fp, fps = -1, []
            for p in range(start + n):      # the request's own view of its prefix
                fp = hash((fp, p, toks[p]))
                fps.append(fp)
            for p in range(start, start + n):
                writes[self.slot(table, p)] = fps[p]
            spans.append((rid, start, n, fps))
        self.kv.update(writes)      # a forward pass writes every layer's KV before reading
        sampled = {}
        for rid, start, n, fps in spans:
            toks, table, _ = self.reqs[rid]
            for p in range(start):
                assert self.kv[self.slot(table, p)] == fps[p], f"{rid} reads wrong KV at {p}"
            self.reqs[rid][2] = start + n
            if start + n == len(toks):
                t = hash(fps[-1]) % VOCAB
                toks.append(t)
                sampled[rid] = [t]
        return ModelRunnerOutput.from_sampled(sampled)


def run(config: SchedulerConfig, workload, async_: bool, aborts=()):
    """Steps the workload (requests arriving at given steps) to the end; {rid: (tokens,
    finish reason)} and the scheduler."""
    s = (AsyncScheduler if async_ else Scheduler)(config)
    runner, queue = FakeRunner(config.block_size), collections.deque()
    out: dict[str, tuple[list[int], str | None]] = {}
    pending = sorted(workload, key=lambda w: w[0])
    aborts = dict(aborts)
    step = 0
    while pending or s.has_unfinished_requests() or queue:
        assert step < 5000, "no progress"
        while pending and pending[0][0] <= step:
            _, rid, prompt, sp, eos = pending.pop(0)
            s.add_request(Request(rid, prompt, sp, eos_token_id=eos))
            out[rid] = ([], None)
        if step in aborts and aborts[step] in s.requests:
            s.finish_requests(aborts[step], RequestStatus.FINISHED_ABORTED)
            out[aborts[step]] = (out[aborts[step]][0], "abort")
        step += 1
        scheduled = False
        if len(queue) < (2 if async_ else 1) and s.has_unfinished_requests():
            so = s.schedule()
            queue.append((so, runner.execute(so)))
            scheduled = so.total_num_scheduled_tokens > 0
        if queue and (len(queue) == (2 if async_ else 1) or not scheduled):
            so, mro = queue.popleft()
            for o in s.update_from_output(so, mro):
                toks, _ = out[o.request_id]
                out[o.request_id] = (toks + o.new_token_ids, o.finish_reason)
    assert not s.requests and not s.running and not s.waiting
    assert s.kv_cache_manager.num_free_blocks == config.num_blocks
    return out, s


@st.composite
def configs_and_workloads(draw):
    bs = draw(st.sampled_from([1, 2, 4, 16]))
    config = SchedulerConfig(
        block_size=bs, num_blocks=draw(st.integers(4, max(4, 160 // bs))),
        max_num_batched_tokens=draw(st.integers(1, 64)), max_num_seqs=draw(st.integers(1, 8)),
        max_model_len=draw(st.integers(8, 96)), enable_prefix_caching=draw(st.booleans()),
        long_prefill_token_threshold=draw(st.integers(0, 8)),
        policy=draw(st.sampled_from(["fcfs", "priority"])))
    base = random.Random(draw(st.integers(0, 2**16))).choices(range(VOCAB), k=60)
    max_len = max(1, min(40, config.max_model_len - 2,
                         config.num_blocks * bs * 2 // 3))
    items = []
    for i in range(draw(st.integers(1, 8))):
        length = draw(st.integers(1, max_len))
        shared = draw(st.integers(0, length))
        prompt = base[:shared] + random.Random(draw(st.integers(0, 2**16))).choices(
            range(VOCAB), k=length - shared)
        cap = max(1, min(20, config.num_blocks * bs - length))
        sp = SamplingParams(temperature=0.0, max_tokens=draw(st.integers(1, cap)),
                            ignore_eos=draw(st.booleans()),
                            stop_token_ids=draw(st.lists(st.integers(0, VOCAB - 1),
                                                         max_size=1)))
        items.append((draw(st.integers(0, 6)), f"q{i}", prompt, sp,
                      draw(st.one_of(st.none(), st.integers(0, VOCAB - 1)))))
    aborts = draw(st.lists(st.tuples(st.integers(0, 30), st.sampled_from(
        [w[1] for w in items])), max_size=2))
    return config, items, aborts


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=configs_and_workloads())
def test_greedy_outputs_with_async_scheduling_equal_those_without(case):
    """Chunked prefill, prefix hits, preemption (by either policy), stops and aborts, with two
    steps in flight: each request's tokens equal the synchronous run's, and nothing leaks."""
    config, workload, aborts = case
    rejected = set()
    for _, rid, prompt, sp, _ in workload:
        longest = min(len(prompt) + sp.max_tokens - 1, config.max_model_len)
        if len(prompt) >= config.max_model_len or -(-longest // config.block_size) > \
                config.num_blocks:
            rejected.add(rid)
    workload = [w for w in workload if w[1] not in rejected]
    want, _ = run(config, workload, False, aborts)
    got, s = run(config, workload, True, aborts)
    for rid, (toks, reason) in got.items():
        if reason == "abort" or want[rid][1] == "abort":
            # an abort lands at the same step but the runs are at different points by then
            assert toks == want[rid][0][:len(toks)] or want[rid][0] == toks[:len(want[rid][0])]
        else:
            assert (toks, reason) == want[rid], (rid, config)
    assert all(r.num_output_placeholders == 0 for r in s.requests.values())


# ---- real tiny models: async == sync through every path ---------------------------------------
ENGINE = dict(dtype="float32", max_model_len=128, num_threads=1)
CASES = {
    "chunked prefill": dict(max_num_batched_tokens=16, long_prefill_token_threshold=8),
    "preemption and prefix hits": dict(block_size=4, num_blocks=24, max_num_batched_tokens=32),
    "priority preemption": dict(block_size=4, num_blocks=24, policy="priority"),
}


def _prompts() -> list[dict]:
    rng = random.Random(1)
    prefix = [rng.randrange(3, 500) for _ in range(12)]
    return [{"prompt_token_ids": (prefix if i % 2 else []) +
             [rng.randrange(3, 500) for _ in range(rng.randrange(2, 30))]} for i in range(10)]


def _params() -> list[SamplingParams]:
    """Greedy with logprobs, greedy with a stop token, and seeded sampling with penalties."""
    return [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2,
                           prompt_logprobs=1),
            SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[7, 11, 13, 17]),
            SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True,
                           presence_penalty=0.5)] * 4


def _assert_idle(llm) -> None:
    st = llm.llm_engine.engine_core.kv_state()
    assert st["unfinished"] == 0 and st["runner_requests"] == 0 and st["grammars"] == 0
    assert st["free_blocks"] == st["num_blocks"]
    assert not llm.llm_engine.engine_core.batch_queue


def _same(a, b) -> None:
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert [o.outputs[0].finish_reason for o in a] == [o.outputs[0].finish_reason for o in b]
    assert [o.outputs[0].text for o in a] == [o.outputs[0].text for o in b]
    for x, y in zip(a, b):      # batches differ, so float sums differ in their last bits
        for d, e in zip(x.outputs[0].logprobs or (), y.outputs[0].logprobs or ()):
            assert d.keys() == e.keys()
            assert [e[t].logprob for t in d] == pytest.approx([d[t].logprob for t in d],
                                                              abs=1e-4)
        assert len(x.outputs[0].logprobs or ()) == len(y.outputs[0].logprobs or ())
        assert len(x.prompt_logprobs or ()) == len(y.prompt_logprobs or ())


@pytest.mark.parametrize("case", sorted(CASES))
def test_outputs_with_async_scheduling_equal_those_without(tiny_llama, case):
    prompts, params = _prompts(), _params()[:10]
    runs = {}
    for on in (False, True):
        llm = LLM(tiny_llama, **ENGINE, **CASES[case], async_scheduling=on)
        assert llm.llm_engine.scheduler_config.async_scheduling is on
        runs[on] = llm.generate(prompts, params, use_tqdm=False)
        runs[on, "stats"] = llm.llm_engine.scheduler.make_stats()
        _assert_idle(llm)
    _same(runs[False], runs[True])
    if case.startswith("preemption"):     # the paths were taken
        assert runs[True, "stats"].num_preemptions > 0
        assert runs[True, "stats"].prefix_cache_hits > 0


def test_stop_strings_and_aborts_with_async_scheduling_equal_those_without(tiny_llama):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llms = {on: LLM(tiny_llama, **ENGINE, async_scheduling=on) for on in (False, True)}
    full = llms[False].generate(["Once upon a time"], greedy, use_tqdm=False)[0].outputs[0]
    stop = full.text[5:8]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    cut = {on: llm.generate(["Once upon a time"], sp, use_tqdm=False)
           for on, llm in llms.items()}
    _same(cut[False], cut[True])
    assert cut[True][0].outputs[0].finish_reason == "stop"
    done = {}
    for on, llm in llms.items():      # an abort mid-run, its id reused at once
        eng, done[on] = llm.llm_engine, {}
        for i, p in enumerate(([7, 8, 9] * 5, [30, 31] * 9, [40] * 12)):
            eng.add_request(f"a{i}", p, greedy)
        step = 0
        while eng.has_unfinished_requests():
            if step == 3:
                eng.abort_request("a1")
                eng.add_request("a1", [50, 51, 52, 53], greedy)
            step += 1
            done[on].update({o.request_id: o.outputs[0].token_ids for o in eng.step()
                             if o.finished})
        _assert_idle(llm)
    assert done[True] == done[False] and sorted(done[True]) == ["a0", "a1", "a2"]


def test_structured_outputs_with_async_scheduling_equal_those_without(tiny_llama):
    from kvflow import StructuredOutputsParams
    sps = [SamplingParams(temperature=0, max_tokens=12,
                          structured_outputs=StructuredOutputsParams(regex="[ab]{3,9}")),
           SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    outs = {}
    for on in (False, True):
        llm = LLM(tiny_llama, **ENGINE, async_scheduling=on)
        outs[on] = llm.generate(["x y", "The cat", "1 2", "Hello"], sps * 2, use_tqdm=False)
        _assert_idle(llm)
    _same(outs[False], outs[True])
    assert all(set(o.outputs[0].text) <= set("ab") for o in outs[True][::2])


def test_a_request_whose_draw_fails_with_its_next_step_in_flight_fails_alone(tiny_llama):
    llm = LLM(tiny_llama, **ENGINE, async_scheduling=True)
    eng = llm.llm_engine
    eng.add_request("bad", "Hello", SamplingParams(temperature=1.0, seed=3, max_tokens=8))
    eng.add_request("ok", "The cat", SamplingParams(temperature=0, max_tokens=8,
                                                    ignore_eos=True))
    eng.runner.generators["bad"] = "not a generator"
    finals = {}
    while eng.has_unfinished_requests():
        finals.update({o.request_id: o for o in eng.step() if o.finished})
    assert finals["bad"].outputs[0].finish_reason == "error"
    ok = finals["ok"].outputs[0]
    assert ok.finish_reason == "length" and ok.token_ids == llm.generate(
        ["The cat"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        use_tqdm=False)[0].outputs[0].token_ids
    _assert_idle(llm)


def test_the_engine_core_process_with_async_scheduling_streams_the_same_tokens(tiny_llama):
    import asyncio

    from kvflow.engine.async_llm import AsyncLLM
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["The cat sat on", "Once upon a time", "1 2 3 4", "Hello"]
    ref = LLM(tiny_llama, **ENGINE).generate(prompts, sp, use_tqdm=False)
    a = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama, async_scheduling=True, **ENGINE),
                                  multiprocess=True)
    try:
        async def main():
            async def one(p):
                return [o async for o in a.generate(p, sp)][-1]
            return await asyncio.gather(*(one(p) for p in prompts))
        _same(ref, asyncio.run(main()))
        st = asyncio.run(a.call_utility("kv_state"))
        assert st["unfinished"] == 0 and st["runner_requests"] == 0
        assert st["free_blocks"] == st["num_blocks"]
    finally:
        a.shutdown()
