"""The SchedulerOutput contract: what a runner is told about each request, and that its own
state, rebuilt from the messages alone, is the scheduler's."""
from __future__ import annotations

import random

from helpers import make_sched, req, step

from kvflow import SamplingParams


def test_a_new_request_carries_its_prompt_blocks_and_computed_tokens_once():
    s = make_sched(block_size=4, num_blocks=32, max_num_batched_tokens=6)
    r = req("a", 10, max_tokens=4, eos=2, ignore_eos=False, seed=5)
    s.add_request(r)
    so, _ = step(s)
    (nr,) = so.scheduled_new_reqs
    assert (nr.req_id, nr.prompt_token_ids, nr.sampling_params) == ("a", r.prompt_token_ids,
                                                                    r.sampling_params)
    assert nr.block_ids == [0, 1] and nr.num_computed_tokens == 0 and nr.eos_token_id == 2
    assert nr.output_token_ids == [] and so.scheduled_cached_reqs.req_ids == []
    so, _ = step(s)                                       # the rest of the prompt: cached now
    assert so.scheduled_new_reqs == [] and so.scheduled_cached_reqs.req_ids == ["a"]


def test_a_prefix_hit_is_sent_as_computed_tokens_before_the_step():
    s = make_sched(block_size=4, num_blocks=32)
    p = req("p", 9).prompt_token_ids
    s.add_request(req("p", p, max_tokens=1))
    step(s)
    s.add_request(req("q", p, max_tokens=1))
    so, _ = step(s)
    (nr,) = so.scheduled_new_reqs
    assert nr.num_computed_tokens == 8 and so.num_scheduled_tokens["q"] == 1
    assert so.context_lens() == {"q": 9}


def test_a_running_request_carries_only_its_new_blocks_and_computed_tokens():
    s = make_sched(block_size=4, num_blocks=32)
    s.add_request(req("a", 6, max_tokens=8, ignore_eos=True))
    step(s)                                               # positions 0-5 in blocks 0, 1
    for pos in (6, 7):                                    # still block 1
        so, _ = step(s)
        c = so.scheduled_cached_reqs
        assert (c.req_ids, c.num_computed_tokens) == (["a"], [pos])
        assert c.new_block_ids == {} and list(c.new_token_ids[0]) == []
    so, _ = step(s)                                       # position 8 opens block 2
    c = so.scheduled_cached_reqs
    assert c.num_computed_tokens == [8] and c.new_block_ids == {"a": [2]}
    assert so.block_ids["a"] == [0, 1, 2]


def test_a_preempted_then_resumed_request_is_sent_in_full_again():
    s = make_sched(block_size=4, num_blocks=4, reserve_full_sequence=False,
                   enable_prefix_caching=False)
    s.add_request(req("a", 7, max_tokens=4, ignore_eos=True))
    s.add_request(req("y", 7, max_tokens=8, ignore_eos=True))
    y = s.requests["y"]
    step(s, lambda rid: [5])
    step(s, lambda rid: [6])
    so = s.schedule()
    assert so.preempted_req_ids == {"y"} and "y" not in so.scheduled_cached_reqs.req_ids
    s.update_from_output(so, {"a": [7]})
    while True:
        so, _ = step(s, lambda rid: [8])
        if "y" in so.num_scheduled_tokens:
            break
    (nr,) = so.scheduled_new_reqs
    assert so.scheduled_resumed_req_ids == ["y"]
    assert nr.prompt_token_ids == y.prompt_token_ids and nr.output_token_ids == [5, 6]
    assert nr.num_computed_tokens == 0 and nr.block_ids == so.block_ids["y"]
    assert nr.output_token_ids is not y.output_token_ids      # a snapshot


class _Mirror:
    """A runner's bookkeeping, fed only the messages (as ModelRunner.update_states does)."""

    def __init__(self):
        self.reqs: dict[str, dict] = {}

    def apply(self, so, sampled):
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.reqs.pop(rid, None)
        for nr in so.scheduled_new_reqs:
            self.reqs[nr.req_id] = {"tokens": nr.prompt_token_ids + nr.output_token_ids,
                                    "blocks": list(nr.block_ids),
                                    "computed": nr.num_computed_tokens}
        c = so.scheduled_cached_reqs
        assert set(c.new_block_ids) <= set(c.req_ids)
        for rid, toks, n in zip(c.req_ids, c.new_token_ids, c.num_computed_tokens):
            st = self.reqs[rid]
            assert st["computed"] == n
            st["tokens"] += toks
            st["blocks"] += c.new_block_ids.get(rid, [])
        for rid, n in so.num_scheduled_tokens.items():
            st = self.reqs[rid]
            st["computed"] += n
            if st["computed"] == len(st["tokens"]):
                st["tokens"] += sampled[rid]


def test_runner_state_rebuilt_from_the_messages_alone_is_the_schedulers():
    rng = random.Random(7)
    for policy in ("fcfs", "priority"):
        s = make_sched(block_size=4, num_blocks=12, max_num_batched_tokens=24, max_num_seqs=6,
                       reserve_full_sequence=False, policy=policy, long_prefill_token_threshold=8)
        mirror, prompts = _Mirror(), []
        for _ in range(400):
            if rng.random() < 0.5:
                p = rng.choice(prompts) if prompts and rng.random() < 0.3 else rng.randint(1, 20)
                r = req(f"r{len(prompts)}", p, max_tokens=rng.randint(1, 16),
                        priority=rng.randint(0, 2), ignore_eos=True)
                prompts.append(r.prompt_token_ids)
                s.add_request(r)
            so = s.schedule()
            sampled = {rid: [rng.randint(0, 99)] for rid in so.num_scheduled_tokens}
            mirror.apply(so, sampled)
            for rid in so.num_scheduled_tokens:
                r, st = s.requests[rid], mirror.reqs[rid]
                assert st["blocks"] == so.block_ids[rid]
                assert st["computed"] == r.num_computed_tokens
                if r.num_computed_tokens == r.num_tokens:
                    assert st["tokens"] == r.all_token_ids + sampled[rid]
            s.update_from_output(so, sampled)
        stats = s.make_stats()
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


def test_the_runner_drops_a_finished_or_preempted_requests_state(tiny_llama):
    from kvflow.engine.llm_engine import EngineArgs, LLMEngine
    eng = LLMEngine(EngineArgs(model=tiny_llama, dtype="float32", block_size=4))
    s, runner = eng.scheduler, eng.runner
    sp = SamplingParams(temperature=1.0, seed=3, max_tokens=2, ignore_eos=True)
    s.add_request(_r("a", sp))
    s.add_request(_r("b", SamplingParams(temperature=1.0, seed=4, max_tokens=6, ignore_eos=True)))
    for _ in range(2):
        so = s.schedule()
        s.update_from_output(so, runner.execute_model(so))
    assert "a" not in s.requests and set(runner.requests) == {"a", "b"}
    assert runner.requests["b"].token_ids == s.requests["b"].all_token_ids
    so = s.schedule()                                     # finished_req_ids == {"a"}
    assert so.finished_req_ids == {"a"}
    s.update_from_output(so, runner.execute_model(so))
    assert set(runner.requests) == {"b"} and "a" not in runner.generators


def _r(rid, sp):
    from kvflow.core import Request
    return Request(rid, [5, 6, 7, 8, 9], sp, eos_token_id=2)
