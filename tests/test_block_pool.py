"""The block pool's free queue (LRU order) and cached blocks, seen through the KV cache manager."""
import pytest
from helpers import make_sched, req, step, toks

from kvflow.core import RequestStatus


def _ref(s, block_id):
    return s.kv_cache_manager.block_pool.blocks[block_id].ref_cnt


def test_free_queue_starts_in_ascending_id_order():
    s = make_sched(block_size=16, num_blocks=8)
    kvm = s.kv_cache_manager
    assert kvm.free_block_ids() == list(range(8))
    assert kvm.num_free_blocks == 8
    assert all(kvm.block_hash(b) is None for b in range(8))


def test_allocation_pops_blocks_from_the_head():
    s = make_sched(block_size=16, num_blocks=8)
    s.add_request(req("a", 40))        # 3 blocks
    s.add_request(req("b", 20))        # 2 blocks
    so = s.schedule()
    assert so.block_ids == {"a": [0, 1, 2], "b": [3, 4]}
    assert s.kv_cache_manager.free_block_ids() == [5, 6, 7]


def test_freeing_puts_hashed_blocks_at_the_tail_last_first_and_the_partial_block_at_the_head():
    s = make_sched(block_size=16, num_blocks=8)
    s.add_request(req("a", 40, max_tokens=1))
    so, outs = step(s)
    assert outs[0].finished
    kvm = s.kv_cache_manager
    # Block 2 (partial, no hash: no prefix hit can ever revive it) is reused first; the cached
    # full blocks 0 and 1 wait at the tail, last block first, to be evicted last.
    assert kvm.free_block_ids() == [2, 3, 4, 5, 6, 7, 1, 0]
    assert kvm.get_block_ids("a") == []
    assert kvm.block_hash(0) is not None and kvm.block_hash(1) is not None
    assert kvm.block_hash(2) is None


def test_a_partial_block_is_reused_before_a_cached_one():
    s = make_sched(block_size=16, num_blocks=4)
    prompt = toks(40)
    s.add_request(req("a", prompt, max_tokens=1))
    step(s)
    kvm = s.kv_cache_manager
    assert kvm.free_block_ids() == [2, 3, 1, 0]
    s.add_request(req("b", 20, max_tokens=1))           # unrelated, 2 blocks
    so, _ = step(s)
    assert so.block_ids["b"] == [2, 3]                   # the cached blocks 0 and 1 survive
    s.add_request(req("c", prompt[:32] + toks(3), max_tokens=1))
    s.schedule()
    assert s.requests["c"].num_cached_tokens == 32


def test_a_cache_hit_on_a_free_block_takes_it_out_of_the_free_queue():
    s = make_sched(block_size=16, num_blocks=8)
    prompt = toks(40)
    s.add_request(req("a", prompt, max_tokens=1))
    step(s)
    s.add_request(req("b", prompt[:32] + toks(8)))
    so = s.schedule()
    assert s.requests["b"].num_cached_tokens == 32
    assert so.block_ids["b"] == [0, 1, 2]                  # hits first, then the head block 2
    assert s.kv_cache_manager.free_block_ids() == [3, 4, 5, 6, 7]
    assert _ref(s, 0) == _ref(s, 1) == 1


def test_reusing_a_cached_free_block_drops_its_hash():
    s = make_sched(block_size=16, num_blocks=4)
    x_prompt = toks(33)
    s.add_request(req("x", x_prompt, max_tokens=1))
    step(s)
    kvm = s.kv_cache_manager
    assert kvm.free_block_ids() == [2, 3, 1, 0]
    old_hash_1 = kvm.block_hash(1)
    assert old_hash_1 is not None
    # y (unrelated, 40 tokens = 3 blocks) pops 2, 3, 1 from the head: block 1 is evicted.
    s.add_request(req("y", 40, max_tokens=1))
    so, _ = step(s)
    assert so.block_ids["y"] == [2, 3, 1]
    assert kvm.block_hash(1) is None                      # y's partial third block: hash gone
    assert kvm.block_hash(0) is not None                  # never reused, still x's block 0
    # So x's prompt now hits only its first block.
    s.add_request(req("x2", x_prompt, max_tokens=1))
    s.schedule()
    assert s.requests["x2"].num_cached_tokens == 16


def test_taking_from_an_empty_free_queue_raises_even_under_python_O():
    import subprocess
    import sys
    code = ("from kvflow.core.block_pool import BlockPool\n"
            "p = BlockPool(2)\np.get_new_blocks(2)\n"
            "try:\n    p.get_new_blocks(1)\nexcept RuntimeError as e:\n    print('raised:', e)\n"
            "print(p.free_queue.num_free)\n")
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True,
                         check=True).stdout.split("\n")
    assert out[0].startswith("raised: asked for 1 blocks") and out[1] == "0"


def test_freeing_a_block_twice_raises():
    from kvflow.core.block_pool import BlockPool
    p = BlockPool(2)
    (b,) = p.get_new_blocks(1)
    p.free_blocks([b])
    with pytest.raises(RuntimeError, match="freed more often"):
        p.free_blocks([b])
    assert p.num_free_blocks == 2


def test_only_full_blocks_are_hashed():
    s = make_sched(block_size=16, num_blocks=8)
    s.add_request(req("a", 40))
    s.schedule()
    kvm = s.kv_cache_manager
    assert [kvm.block_hash(b) is not None for b in kvm.get_block_ids("a")] == [True, True, False]


def test_a_block_is_hashed_once_the_step_that_fills_it_is_scheduled():
    s = make_sched(block_size=16, num_blocks=8)
    s.add_request(req("a", 30))                           # prefill fills block 0 only
    step(s)
    kvm = s.kv_cache_manager
    assert kvm.block_hash(1) is None
    step(s)                                               # token 31: still not full
    assert s.requests["a"].num_computed_tokens == 31 and kvm.block_hash(1) is None
    s.schedule()                                          # token 32 fills block 1
    assert s.requests["a"].num_computed_tokens == 32 and kvm.block_hash(1) is not None


def test_reset_prefix_cache_refused_while_blocks_are_held_then_forgets_every_hash():
    s = make_sched(block_size=16, num_blocks=8)
    prompt = toks(40)
    s.add_request(req("a", prompt, max_tokens=2))
    step(s)
    assert s.reset_prefix_cache() is False               # a still holds blocks
    assert s.kv_cache_manager.block_hash(0) is not None
    step(s)
    assert not s.has_unfinished_requests()
    assert s.reset_prefix_cache() is True
    assert all(s.kv_cache_manager.block_hash(b) is None for b in range(8))
    s.add_request(req("b", prompt))
    s.schedule()
    assert s.requests["b"].num_cached_tokens == 0


def test_usage_is_the_fraction_of_blocks_held():
    s = make_sched(block_size=16, num_blocks=8)
    assert s.kv_cache_manager.usage == 0.0
    s.add_request(req("a", 40, max_tokens=1))
    s.add_request(req("b", 20, max_tokens=5))
    so, _ = step(s)
    # a finished and freed its 3 blocks (still cached, but free); b holds 2.
    assert s.kv_cache_manager.usage == 2 / 8
    assert s.make_stats().kv_cache_usage == 2 / 8
    s.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert s.kv_cache_manager.usage == 0.0
    assert s.kv_cache_manager.num_free_blocks == 8


def test_every_block_is_free_or_held_never_both():
    s = make_sched(block_size=4, num_blocks=12, reserve_full_sequence=False)
    for i in range(5):
        s.add_request(req(f"r{i}", 6 + i, max_tokens=12, ignore_eos=True))
    kvm = s.kv_cache_manager
    while s.has_unfinished_requests():
        step(s)
        free = kvm.free_block_ids()
        held = [b for r in s.running for b in kvm.get_block_ids(r.request_id)]
        assert len(set(free)) == len(free)
        assert not set(free) & set(held)
        assert all(_ref(s, b) == 0 for b in free) and all(_ref(s, b) > 0 for b in held)
        assert len(free) + len(set(held)) == 12
    assert sorted(kvm.free_block_ids()) == list(range(12))
