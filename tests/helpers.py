"""Tiny shared helpers for the scheduler tests: build a scheduler, a request, run one step."""
from __future__ import annotations

import itertools

from kvflow import SamplingParams
from kvflow.core import Request, Scheduler, SchedulerConfig

# Every generated prompt token is unique across the whole test session, so two requests only
# share a prefix-cache block when a test builds them to.
_fresh = itertools.count(10_000)


def make_sched(**cfg) -> Scheduler:
    return Scheduler(SchedulerConfig(**cfg))


def toks(n: int) -> list[int]:
    """n fresh token ids that no other prompt contains."""
    return [next(_fresh) for _ in range(n)]


def req(rid: str, prompt: int | list[int], max_tokens: int | None = 16, *, eos: int | None = None,
        priority: int = 0, arrival: float | None = None, **sp) -> Request:
    """A request with `prompt` fresh tokens (an int) or exactly those token ids (a list)."""
    ids = toks(prompt) if isinstance(prompt, int) else list(prompt)
    return Request(rid, ids, SamplingParams(max_tokens=max_tokens, **sp), eos_token_id=eos,
                   arrival_time=arrival, priority=priority)


def step(sched: Scheduler, tokens_for=lambda rid: [1]):
    """One engine step: schedule(), sample `tokens_for(rid)` for every scheduled request."""
    so = sched.schedule()
    outs = sched.update_from_output(so, {rid: tokens_for(rid) for rid in so.num_scheduled_tokens})
    return so, outs


def run_until_idle(sched: Scheduler, max_steps: int = 10_000, tokens_for=lambda rid: [1]):
    """Step until nothing is left; returns the list of SchedulerOutputs."""
    sos = []
    while sched.has_unfinished_requests():
        assert len(sos) < max_steps, "scheduler made no progress"
        sos.append(step(sched, tokens_for)[0])
    return sos


def blocks_for(n_tokens: int, block_size: int) -> int:
    return -(-n_tokens // block_size)
