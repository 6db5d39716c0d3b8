"""Simulated routing across replicas (kvflow/sim/replicas.py) and the multi-turn shared-prefix
workload (kvflow/sim/conversations.py). Every assertion is on simulated quantities."""
from collections import defaultdict

import numpy as np
import pytest

from kvflow.core.routing import POLICIES
from kvflow.sim import CostModel, get_gpu, get_model, scheduler_config, simulate
from kvflow.sim.conversations import multi_turn
from kvflow.sim.replicas import simulate_replicas, summarize_replicas
from kvflow.sim.simulator import SAMPLED_TOKEN
from kvflow.sim.workload import synthetic, with_arrivals, with_shared_prefix

CM = CostModel(get_model("Llama-3-8B"), get_gpu("h100"))
CFG = scheduler_config("vllm", num_blocks=3000, max_num_batched_tokens=1024, max_num_seqs=64)


def _conversations(seed=0, users=32):
    return multi_turn(num_users=users, num_system_prompts=3, system_prompt_len=512, turns=4,
                      question_len=48, answer_len=24, session_rate=8.0, think_time=1.0,
                      min_gap=0.2, seed=seed)


def _same(a, b):
    for f in ("first_scheduled", "first_token", "finish", "num_output", "preemptions", "itl"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
    assert a.steps.keys() == b.steps.keys()
    for k in a.steps:
        np.testing.assert_array_equal(a.steps[k], b.steps[k])
    assert a.sim_time == b.sim_time


@pytest.mark.parametrize("routing", POLICIES)
def test_every_request_finishes_on_exactly_one_replica_and_no_block_leaks(routing):
    wl = _conversations()
    rr = simulate_replicas(wl, CM, CFG, routing, 4)
    r = rr.result
    assert ((rr.replica >= 0) & (rr.replica < 4)).all()
    np.testing.assert_array_equal(r.num_output, wl.output_lens)
    assert not np.isnan(r.finish).any()
    # Each replica's scheduler saw exactly the requests routed to it, and holds no block.
    for k, s in enumerate(rr.schedulers):
        assert not s.has_unfinished_requests()
        pool = s.kv_cache_manager.block_pool
        assert pool.num_free_blocks == pool.num_blocks
        mine = np.flatnonzero(rr.replica == k)
        assert s.prefix_cache_queries == int(wl.prompt_lens[mine].sum())  # no preemption here
        assert sum(rr.replica_steps[k]["reqs"]) >= len(mine)
    assert r.preemptions.sum() == 0
    # The router was told of every finish: nothing in flight at the end.
    assert rr.policy.load == [0, 0, 0, 0]
    # The merged steps are every replica's steps.
    assert len(r.steps["t"]) == sum(len(s["t"]) for s in rr.replica_steps)
    assert (np.diff(r.steps["t"]) >= 0).all()


@pytest.mark.parametrize("routing", ["least_load", "prefix"])
def test_a_replica_run_is_repeatable_bit_for_bit(routing):
    a = simulate_replicas(_conversations(seed=1), CM, CFG, routing, 3)
    b = simulate_replicas(_conversations(seed=1), CM, CFG, routing, 3)
    _same(a.result, b.result)
    np.testing.assert_array_equal(a.replica, b.replica)
    assert a.prefix_cache_hits == b.prefix_cache_hits
    assert a.prefix_cache_queries == b.prefix_cache_queries
    c = simulate_replicas(_conversations(seed=2), CM, CFG, routing, 3)
    assert c.prefix_cache_hits != a.prefix_cache_hits       # another seed, another workload


@pytest.mark.parametrize("routing", POLICIES)
def test_one_replica_is_exactly_the_single_replica_simulation(routing):
    wl = with_shared_prefix(with_arrivals(synthetic(150, 600, 100, "uniform", seed=3), "poisson",
                                          25.0, seed=3), 256, 2)
    cfg = scheduler_config("vllm", num_blocks=400, max_num_batched_tokens=512, max_num_seqs=32,
                           reserve_full_sequence=False)
    single = simulate(wl, CM, cfg)
    rr = simulate_replicas(wl, CM, cfg, routing, 1)
    _same(single, rr.result)
    assert (rr.replica == 0).all()
    assert single.num_steps == len(rr.replica_steps[0]["t"])
    assert single.preemptions.sum() > 0      # the comparison covers preemption too


def test_prefix_routing_hits_the_cache_more_than_round_robin_at_4_replicas():
    wl = _conversations(users=48)
    s = {p: summarize_replicas(simulate_replicas(wl, CM, CFG, p, 4))
         for p in ("round_robin", "prefix")}
    rr, px = s["round_robin"], s["prefix"]
    assert px["prefix_cache_hit_rate"] > rr["prefix_cache_hit_rate"] + 0.1
    # Fewer prefill tokens to compute: cached tokens are skipped.
    assert (px["prefix_cache_queries"] - px["prefix_cache_hits"]
            < rr["prefix_cache_queries"] - rr["prefix_cache_hits"])
    assert px["completed"] == rr["completed"] == len(wl)


def test_multi_turn_prompts_extend_the_previous_turn_with_its_answer():
    wl = _conversations()
    turns = wl.prompts.turns
    by_user = defaultdict(list)
    for i, t in enumerate(turns):
        by_user[t.user].append(i)
    assert len(by_user) == 32 and all(len(v) == 4 for v in by_user.values())
    for u, reqs in by_user.items():
        assert [turns[i].turn for i in reqs] == [0, 1, 2, 3]   # in arrival order
        assert (np.diff(wl.arrivals[reqs]) >= 0.2).all()        # min_gap between turns
        for prev, cur in zip(reqs, reqs[1:]):
            p, c = wl.prompt_ids(prev, int(wl.prompt_lens[prev])), wl.prompts[cur]
            answer = [SAMPLED_TOKEN] * int(wl.output_lens[prev])
            assert c[:len(p) + len(answer)] == p + answer       # history = prompt + answer
            assert len(c) > len(p) + len(answer)               # ... then a new question
            assert len(c) == wl.prompt_lens[cur]
    # Users of the same system prompt share it and nothing after it; questions never repeat.
    first = {u: wl.prompts[reqs[0]] for u, reqs in by_user.items()}
    sys_len = {u: wl.prompts.system[wl.prompts.user_system[u]] for u in first}
    assert first[0][:len(sys_len[0])] == first[3][:len(sys_len[3])]        # 0 and 3: prompt 0
    assert first[0][:len(sys_len[0])] != first[1][:len(sys_len[1])]
    questions = [q for qs in wl.prompts.questions for q in qs]
    assert len({x for q in questions for x in q}) == sum(map(len, questions))
    # Seeded: the same arguments give the same workload.
    again = _conversations()
    np.testing.assert_array_equal(again.arrivals, wl.arrivals)
    assert [again.prompts[i] for i in range(10)] == [wl.prompts[i] for i in range(10)]
