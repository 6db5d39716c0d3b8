"""Waiting queues: FCFS (a deque) and priority (a heap on (priority, arrival_time))."""
from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from kvflow.core.request import Request


class FCFSRequestQueue:
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add_request(self, r: Request) -> None:
        self._q.append(r)

    def prepend_request(self, r: Request) -> None:
        # A preempted request goes back to the front: it has already waited once.
        self._q.appendleft(r)

    def peek_request(self) -> Request:
        return self._q[0]

    def pop_request(self) -> Request:
        return self._q.popleft()

    def remove_requests(self, reqs: set[Request]) -> None:
        self._q = deque(r for r in self._q if r not in reqs)

    def __len__(self) -> int:
        return len(self._q)

    def __bool__(self) -> bool:
        return bool(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityRequestQueue:
    """Lower `priority` first, then earlier arrival, then insertion order."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []

    def add_request(self, r: Request) -> None:
        heapq.heappush(self._heap, (r.priority, r.arrival_time, r.seq_no, r))

    prepend_request = add_request   # a preempted request simply rejoins the heap

    def peek_request(self) -> Request:
        return self._heap[0][3]

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove_requests(self, reqs: set[Request]) -> None:
        self._heap = [e for e in self._heap if e[3] not in reqs]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in sorted(self._heap, key=lambda e: e[:3]))


def create_request_queue(policy: str) -> FCFSRequestQueue | PriorityRequestQueue:
    return PriorityRequestQueue() if policy == "priority" else FCFSRequestQueue()
