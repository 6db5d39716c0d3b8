"""Prefix caching: whole-block hits, chained keys, the n-1 cap, and what a hit costs."""
from helpers import make_sched, req, run_until_idle, step, toks

from kvflow.core import RequestStatus


def _ref_cnts(s):
    return [b.ref_cnt for b in s.kv_cache_manager.block_pool.blocks]


def _run_alone(s, rid, prompt, max_tokens=1, **kw):
    s.add_request(req(rid, prompt, max_tokens=max_tokens, **kw))
    run_until_idle(s)


def test_hit_is_capped_so_one_token_is_computed_a_2_block_prompt_repeated_hits_1_block():
    s = make_sched(block_size=16, num_blocks=16)
    prompt = toks(32)
    _run_alone(s, "first", prompt)
    s.add_request(req("again", prompt))
    so = s.schedule()
    again = s.requests["again"]
    assert again.num_cached_tokens == 16               # (32 - 1) // 16 = 1 whole block
    assert so.num_scheduled_tokens["again"] == 16


def test_hit_is_floored_to_whole_blocks_33_tokens_hit_2_blocks():
    s = make_sched(block_size=16, num_blocks=16)
    prompt = toks(33)
    _run_alone(s, "first", prompt)
    s.add_request(req("again", prompt))
    so = s.schedule()
    assert s.requests["again"].num_cached_tokens == 32
    assert so.num_scheduled_tokens["again"] == 1


def test_block_keys_chain_on_the_parent_same_block_after_a_different_first_block_misses():
    s = make_sched(block_size=16, num_blocks=16)
    a, b, c = toks(16), toks(16), toks(16)
    _run_alone(s, "ab", a + b + toks(1))
    s.add_request(req("cb", c + b + toks(1)))           # block "b" again, but after "c"
    s.schedule()
    assert s.requests["cb"].num_cached_tokens == 0
    s.add_request(req("ab2", a + b + toks(1)))
    s.schedule()
    assert s.requests["ab2"].num_cached_tokens == 32


def test_blocks_filled_by_generated_tokens_become_cacheable():
    s = make_sched(block_size=16, num_blocks=16)
    old = req("old", 20, max_tokens=13)
    s.add_request(old)
    run_until_idle(s, tokens_for=lambda rid: [7_000 + old.num_output_tokens])
    # 20 prompt + 13 outputs: its last step computed token 31, filling block 1 (12 of whose
    # 16 tokens are outputs). The 13th output was sampled but never computed.
    history = old.all_token_ids
    assert len(history) == 33 and old.is_finished()
    s.add_request(req("new", history + toks(5)))
    so = s.schedule()
    assert s.requests["new"].num_cached_tokens == 32
    assert so.num_scheduled_tokens["new"] == 38 - 32


def test_evictable_hits_count_as_blocks_to_allocate():
    for reserve in (True, False):
        s = make_sched(block_size=16, num_blocks=10, reserve_full_sequence=reserve)
        x_prompt = toks(64)
        _run_alone(s, "x", x_prompt)                     # blocks 0..3 cached, now free
        s.add_request(req("r", 70, max_tokens=5))        # holds 5 blocks (4..8)
        step(s)
        kvm = s.kv_cache_manager
        assert kvm.free_block_ids() == [9, 3, 2, 1, 0]
        # y: 97 tokens = 7 blocks, 4 of them hits sitting in the free queue. 3 new + 4 revived
        # = 7 > 5 free. (Were hits free of charge, 3 <= 5 would pass.)
        s.add_request(req("y", x_prompt + toks(33), max_tokens=1))
        so, _ = step(s)
        assert "y" not in so.num_scheduled_tokens
        assert s.requests["y"].status == RequestStatus.WAITING


def test_hits_held_by_a_running_request_are_free_of_charge():
    s = make_sched(block_size=16, num_blocks=10)
    x_prompt = toks(70)
    s.add_request(req("x", x_prompt, max_tokens=5))      # holds 5 blocks, 0..3 full and cached
    step(s)
    assert s.kv_cache_manager.num_free_blocks == 5
    s.add_request(req("y", x_prompt[:64] + toks(33), max_tokens=1))
    so = s.schedule()
    assert so.block_ids["y"] == [0, 1, 2, 3, 5, 6, 7]    # 4 shared hits + 3 new blocks
    assert s.requests["y"].num_cached_tokens == 64
    assert _ref_cnts(s)[:4] == [2, 2, 2, 2]


def test_a_failed_allocation_changes_no_ref_count_and_no_free_list():
    s = make_sched(block_size=16, num_blocks=10)
    x_prompt = toks(64)
    _run_alone(s, "x", x_prompt)
    s.add_request(req("r", 70, max_tokens=5))
    step(s)
    kvm = s.kv_cache_manager
    free_before, refs_before = kvm.free_block_ids(), _ref_cnts(s)
    hashes_before = [kvm.block_hash(b) for b in range(10)]
    s.add_request(req("y", x_prompt + toks(33), max_tokens=1))
    so = s.schedule()                                   # r decodes in place; y does not fit
    assert so.num_scheduled_tokens == {"r": 1}
    assert kvm.free_block_ids() == free_before
    assert _ref_cnts(s) == refs_before
    assert [kvm.block_hash(b) for b in range(10)] == hashes_before


def test_stats_count_a_query_and_its_hits_once_per_admission():
    s = make_sched(block_size=16, num_blocks=10)
    x_prompt = toks(64)
    _run_alone(s, "x", x_prompt)
    s.add_request(req("r", 70, max_tokens=5))
    step(s)
    s.add_request(req("y", x_prompt + toks(33), max_tokens=1))
    admitted_at = None
    for n in range(1, 10):                             # y fails in every step until r is done
        so, _ = step(s)
        if "y" in so.scheduled_new_req_ids:
            admitted_at = n
            break
    assert admitted_at == 5                            # after 4 failed attempts
    st = s.make_stats()
    assert st.prefix_cache_queries == 64 + 70 + 97
    assert st.prefix_cache_hits == 0 + 0 + 64


def test_no_stats_without_prefix_caching():
    s = make_sched(block_size=16, num_blocks=10, enable_prefix_caching=False)
    prompt = toks(40)
    _run_alone(s, "x", prompt)
    s.add_request(req("y", prompt))
    s.schedule()
    assert s.requests["y"].num_cached_tokens == 0
    assert all(s.kv_cache_manager.block_hash(b) is None for b in range(10))
    st = s.make_stats()
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (0, 0)


def test_num_cached_tokens_is_the_hit_of_the_latest_admission_after_preemption():
    s = make_sched(block_size=4, num_blocks=4, reserve_full_sequence=False)
    s.add_request(req("a", 7, max_tokens=4))
    s.add_request(req("y", 7, max_tokens=8))
    step(s)
    y = s.requests["y"]
    assert y.num_cached_tokens == 0                    # first admission: cold cache
    step(s)                                            # both at 9 tokens, pool full
    so, _ = step(s)                                    # a needs a 3rd block: y (tail) goes
    assert so.preempted_req_ids == {"y"}
    assert y.num_output_tokens == 2
    while "y" not in so.scheduled_resumed_req_ids:
        so, _ = step(s)
    # Re-admitted over prompt + outputs (9 tokens): its first block was still cached (its
    # second was evicted when a took it).
    assert y.num_cached_tokens == 4
    assert so.num_scheduled_tokens["y"] == 9 - 4
    st = s.make_stats()
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (7 + 7 + 9, 0 + 0 + 4)
