"""Routing policies (kvflow/core/routing.py): the radix tree's matches and the policies' rules."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.core.routing import NoReplicaError, PrefixAware, PrefixTree, make_policy


def _lcp(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


keys = st.lists(st.integers(0, 3), min_size=0, max_size=12)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(keys, st.integers(0, 2)), max_size=25), keys)
def test_the_tree_matches_the_longest_prefix_each_replica_was_sent(sent, query):
    tree = PrefixTree()
    for key, r in sent:
        tree.insert(key, r)
    want = {}
    for key, r in sent:
        n = _lcp(key, query)
        if n:
            want[r] = max(want.get(r, 0), n)
    assert tree.match(query) == want


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(keys, st.integers(0, 2)), max_size=25), st.integers(1, 10))
def test_eviction_keeps_each_replica_within_its_size_and_matches_stay_true(sent, cap):
    tree = PrefixTree(max_size_per_replica=cap)
    for key, r in sent:
        tree.insert(key, r)
        assert all(s <= cap for s in tree.size.values())
    # Whatever the tree still claims for a replica, that replica was sent.
    for key, _ in sent:
        for r, n in tree.match(key).items():
            assert any(rr == r and _lcp(k, key) >= n for k, rr in sent)


def test_removing_a_replica_forgets_its_prefixes_only():
    tree = PrefixTree()
    tree.insert("system prompt A: hello", 0)
    tree.insert("system prompt B: hi", 1)
    tree.remove_replica(0)
    assert tree.match("system prompt A: hello") == {1: len("system prompt ")}
    assert 0 not in tree.size


def test_prefix_aware_sends_a_shared_prefix_back_to_the_replica_that_holds_it():
    p = PrefixAware(4)
    first = p.choose("You are a helpful assistant. Q1")
    others = {p.choose(f"You are a helpful assistant. Q{i}") for i in range(2, 10)}
    assert others == {first}


def test_prefix_aware_spreads_new_prefixes_over_the_replicas_with_least_stored():
    p = PrefixAware(3)
    chosen = [p.choose(f"{c * 20} question") for c in "abc"]
    assert sorted(chosen) == [0, 1, 2]


def test_prefix_aware_falls_back_to_least_load_past_the_balance_thresholds():
    p = PrefixAware(2, balance_abs_threshold=4, balance_rel_threshold=1.5)
    for _ in range(5):
        assert p.choose("shared prefix shared prefix") == 0
    assert p.load == [5, 0]
    assert p.choose("shared prefix shared prefix") == 1    # gap 5 > 4 and 5 > 0 * 1.5


def test_round_robin_and_least_load_skip_unhealthy_replicas():
    rr = make_policy("round_robin", 3)
    rr.set_healthy(1, False)
    assert [rr.choose("x") for _ in range(4)] == [0, 2, 0, 2]
    ll = make_policy("least_load", 3)
    ll.set_healthy(0, False)
    assert [ll.choose("x") for _ in range(4)] == [1, 2, 1, 2]
    ll.finish(1)
    ll.finish(1)
    assert ll.choose("x") == 1


def test_no_healthy_replica_is_an_error_not_a_pick():
    p = make_policy("prefix", 2)
    p.set_healthy(0, False)
    p.set_healthy(1, False)
    with pytest.raises(NoReplicaError):
        p.choose("x")


def test_an_unknown_policy_is_refused_by_name():
    with pytest.raises(ValueError, match="routing policy"):
        make_policy("random", 2)
