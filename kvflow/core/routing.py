"""Routing policies for data-parallel replicas: round-robin, least-load, prefix-aware.

One implementation serves the HTTP router (kvflow/server/router.py, keys are prompt text) and the
simulator (kvflow/sim/replicas.py, keys are token ids), so what the simulator compares is what
the router runs. Pure Python, like the rest of core/.

Prefix-aware is SGLang's cache-aware routing: the router keeps an approximate radix tree of what
it sent to each replica (it never asks a replica what its cache holds; LRU eviction keeps each
replica's share of the tree bounded), sends a request to the replica whose tree matches the
longest share of its key when that share is at least `cache_threshold`, else to the replica with
the least stored (the most room for a new prefix); and when the load gap between replicas is too
wide it ignores the trees and picks the least-loaded replica.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

Key = str | Sequence[int]
POLICIES = ("round_robin", "least_load", "prefix")


@dataclass(eq=False, slots=True)
class _Node:
    key: Key                                   # the edge label leading here
    parent: _Node | None
    children: dict = field(default_factory=dict)   # first element of the child's key -> child
    last_used: dict[int, int] = field(default_factory=dict)  # replica -> logical time


class PrefixTree:
    """A radix tree over keys; each node records which replicas were sent a key through it."""

    def __init__(self, max_size_per_replica: int = 1 << 20) -> None:
        self.root = _Node(key="", parent=None)
        self.max_size = max_size_per_replica
        self.size: dict[int, int] = {}         # replica -> elements of keys it holds
        self._clock = itertools.count(1)

    def match(self, key: Key) -> dict[int, int]:
        """Per replica, the length of the longest prefix of key it was sent."""
        best: dict[int, int] = {}
        node, depth = self.root, 0
        while depth < len(key):
            child = node.children.get(key[depth])
            if child is None:
                break
            n = _common(child.key, key, depth)
            depth += n
            for r in child.last_used:
                best[r] = depth
            if n < len(child.key):
                break
            node = child
        return best

    def insert(self, key: Key, replica: int) -> None:
        now = next(self._clock)
        node, depth = self.root, 0
        while depth < len(key):
            child = node.children.get(key[depth])
            if child is None:
                child = _Node(key[depth:], node)
                node.children[key[depth]] = child
            else:
                n = _common(child.key, key, depth)
                if n < len(child.key):
                    child = self._split(child, n)
            if replica not in child.last_used:
                self.size[replica] = self.size.get(replica, 0) + len(child.key)
            child.last_used[replica] = now
            depth += len(child.key)
            node = child
        while self.size.get(replica, 0) > self.max_size:
            self._evict_one(replica)

    def remove_replica(self, replica: int) -> None:
        for node in reversed(list(self._nodes())):     # children before their parents
            if node.last_used.pop(replica, None) is not None and not node.last_used:
                self._unlink(node)
        self.size.pop(replica, None)

    def _split(self, child: _Node, n: int) -> _Node:
        """Cut child's edge after n elements; returns the new upper node."""
        upper = _Node(child.key[:n], child.parent, last_used=dict(child.last_used))
        child.parent.children[child.key[0]] = upper
        child.key, child.parent = child.key[n:], upper
        upper.children[child.key[0]] = child
        return upper

    def _evict_one(self, replica: int) -> None:
        """Drop replica from its least recently used leaf (a node no child of which it holds)."""
        leaves = [n for n in self._nodes() if replica in n.last_used
                  and not any(replica in c.last_used for c in n.children.values())]
        victim = min(leaves, key=lambda n: n.last_used[replica])
        del victim.last_used[replica]
        self.size[replica] -= len(victim.key)
        if not victim.last_used:
            self._unlink(victim)

    def _unlink(self, node: _Node) -> None:
        if node.parent is not None and not node.children:
            del node.parent.children[node.key[0]]
            node.parent = None

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            yield n


def _common(edge: Key, key: Key, start: int) -> int:
    n = min(len(edge), len(key) - start)
    i = 0
    while i < n and edge[i] == key[start + i]:
        i += 1
    return i


class RoutingPolicy:
    """Picks a replica per request and tracks each replica's in-flight requests. `choose` counts
    the request in; the caller calls `finish(replica)` when it ends, however it ends."""
    name = "base"

    def __init__(self, num_replicas: int) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.num_replicas = num_replicas
        self.load = [0] * num_replicas
        self.healthy = [True] * num_replicas

    def candidates(self) -> list[int]:
        live = [i for i in range(self.num_replicas) if self.healthy[i]]
        if not live:
            raise NoReplicaError("no healthy replica")
        return live

    def choose(self, key: Key) -> int:
        r = self._pick(key, self.candidates())
        self.load[r] += 1
        return r

    def finish(self, replica: int) -> None:
        self.load[replica] = max(0, self.load[replica] - 1)

    def set_healthy(self, replica: int, ok: bool) -> None:
        self.healthy[replica] = ok

    def _pick(self, key: Key, live: list[int]) -> int:
        raise NotImplementedError

    def _least_loaded(self, live: list[int]) -> int:
        return min(live, key=lambda i: (self.load[i], i))


class NoReplicaError(RuntimeError):
    pass


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def __init__(self, num_replicas: int) -> None:
        super().__init__(num_replicas)
        self._next = 0

    def _pick(self, key: Key, live: list[int]) -> int:
        for _ in range(self.num_replicas):
            r, self._next = self._next, (self._next + 1) % self.num_replicas
            if self.healthy[r]:
                return r
        return live[0]


class LeastLoad(RoutingPolicy):
    name = "least_load"

    def _pick(self, key: Key, live: list[int]) -> int:
        return self._least_loaded(live)


class PrefixAware(RoutingPolicy):
    """SGLang's defaults: cache_threshold 0.5, balance thresholds 32 requests and 1.5x."""
    name = "prefix"

    def __init__(self, num_replicas: int, cache_threshold: float = 0.5,
                 balance_abs_threshold: int = 32, balance_rel_threshold: float = 1.5,
                 max_tree_size: int = 1 << 20) -> None:
        super().__init__(num_replicas)
        self.cache_threshold = cache_threshold
        self.balance_abs, self.balance_rel = balance_abs_threshold, balance_rel_threshold
        self.tree = PrefixTree(max_tree_size)

    def _pick(self, key: Key, live: list[int]) -> int:
        loads = [self.load[i] for i in live]
        hi, lo = max(loads), min(loads)
        if hi - lo > self.balance_abs and hi > lo * self.balance_rel:
            r = self._least_loaded(live)
        else:
            r = self._by_prefix(key, live)
        self.tree.insert(key, r)
        return r

    def _by_prefix(self, key: Key, live: list[int]) -> int:
        matched = self.tree.match(key)
        best = max(live, key=lambda i: (matched.get(i, 0), -self.load[i], -i))
        if key and matched.get(best, 0) / len(key) >= self.cache_threshold:
            return best
        return min(live, key=lambda i: (self.tree.size.get(i, 0), self.load[i], i))

    def set_healthy(self, replica: int, ok: bool) -> None:
        if self.healthy[replica] and not ok:    # what it cached is gone or unreachable
            self.tree.remove_replica(replica)
        super().set_healthy(replica, ok)


def make_policy(name: str, num_replicas: int, **kw) -> RoutingPolicy:
    cls = {"round_robin": RoundRobin, "least_load": LeastLoad, "prefix": PrefixAware}.get(name)
    if cls is None:
        raise ValueError(f"routing policy must be one of {list(POLICIES)}, got {name!r}")
    return cls(num_replicas, **kw)
