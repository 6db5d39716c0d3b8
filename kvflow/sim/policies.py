"""Scheduling policies, each a way of driving the real kvflow Scheduler.

- vllm:     the Scheduler as configured (vLLM V1: one token budget per step shared by running
            then waiting requests, chunked prefill on). Nothing wrapped.
- priority: the same with SchedulerConfig.policy="priority": the waiting heap orders by the
            request's priority (the workload assigns 0 to short prompts, 1 to long ones, see
            workload.with_priorities) and preemption picks the lowest-priority running request.
- nano:     nano-vllm / vLLM V0 style: a step is either prefill-only or decode-only, prefill
            first, prompts never chunked. The Scheduler always serves running requests before
            admitting, so a thin wrapper hides one queue per step: for a prefill step it hides
            the running list (and lowers max_num_seqs by its length) so schedule() can only admit
            whole prompts; if that admits nothing, it hides the waiting queue for a decode step.
            Admission, block allocation and preemption are the Scheduler's own.
- static:   static batching, the baseline of reference doc 000: a wrapper keeps arrivals out of
            the Scheduler until every request of the current batch has finished, then admits up
            to max_num_seqs at once. Finished members stay in the batch as padding (as in
            HF generate), so the cost model still charges their decode slots.
"""
from __future__ import annotations

from collections import deque

from kvflow.core import Request, Scheduler, SchedulerConfig, SchedulerOutput
from kvflow.core.request_queue import create_request_queue

POLICIES = ("vllm", "nano", "static", "priority")


def scheduler_config(policy: str, **fields) -> SchedulerConfig:
    """The SchedulerConfig a policy runs the Scheduler with; `fields` override its defaults."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    base: dict = {}
    if policy == "priority":
        base["policy"] = "priority"
    elif policy == "nano":
        # nano-vllm: no chunking, a budget large enough for any prompt (its default is 16384 and
        # it requires max_model_len <= max_num_batched_tokens), no watermark.
        base.update(enable_chunked_prefill=False, watermark=0.0)
        mml = fields.get("max_model_len") or SchedulerConfig().max_model_len
        if fields.get("max_num_batched_tokens") is None:
            fields["max_num_batched_tokens"] = max(16384, mml)
    base.update({k: v for k, v in fields.items() if v is not None})
    if policy == "nano":
        base["enable_chunked_prefill"] = False
    return SchedulerConfig(**base)


class Driver:
    """vllm and priority: every arrival goes straight to the Scheduler, every step is its own."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.scheduler = Scheduler(config)

    def add(self, req: Request) -> None:
        self.scheduler.add_request(req)

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def schedule(self) -> SchedulerOutput:
        return self.scheduler.schedule()

    def padding(self) -> tuple[int, int]:
        """(decode slots, their summed context) that run this step without being scheduled."""
        return 0, 0

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)


class NanoDriver(Driver):
    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self._max_seqs = config.max_num_seqs
        self._no_waiting = create_request_queue(config.policy)

    def schedule(self) -> SchedulerOutput:
        s = self.scheduler
        finished: set[str] = set()
        if s.waiting:
            running = s.running
            s.running = []
            s.max_num_seqs = self._max_seqs - len(running)
            try:
                so = s.schedule()
            finally:
                s.running = running + s.running
                s.max_num_seqs = self._max_seqs
            if so.total_num_scheduled_tokens:
                return so
            finished = so.finished_req_ids
        waiting, s.waiting = s.waiting, self._no_waiting
        try:
            so = s.schedule()
        finally:
            s.waiting = waiting
        # A decode step can preempt: the victims went into the empty stand-in queue.
        if self._no_waiting:
            for r in reversed(list(self._no_waiting)):
                waiting.prepend_request(r)
            self._no_waiting = create_request_queue(s.config.policy)
        so.finished_req_ids |= finished
        return so


class StaticDriver(Driver):
    def __init__(self, config: SchedulerConfig, batch_size: int | None = None,
                 pad: bool = True) -> None:
        super().__init__(config)
        self.batch_size = batch_size or config.max_num_seqs
        self.pad = pad
        self.pending: deque[Request] = deque()
        self.batch: list[Request] = []

    def add(self, req: Request) -> None:
        self.pending.append(req)

    def has_work(self) -> bool:
        return bool(self.pending) or self.scheduler.has_unfinished_requests()

    def schedule(self) -> SchedulerOutput:
        s = self.scheduler
        if not s.has_unfinished_requests() and self.pending:
            self.batch = [self.pending.popleft()
                          for _ in range(min(self.batch_size, len(self.pending)))]
            for r in self.batch:
                s.add_request(r)
        return s.schedule()

    def padding(self) -> tuple[int, int]:
        if not self.pad:
            return 0, 0
        n = ctx = 0
        for r in self.batch:
            if r.is_finished():
                n += 1
                ctx += r.num_tokens
        return n, ctx

    def num_waiting(self) -> int:
        return len(self.pending) + len(self.scheduler.waiting)


def make_driver(policy: str, config: SchedulerConfig) -> Driver:
    if policy == "nano":
        return NanoDriver(config)
    if policy == "static":
        return StaticDriver(config)
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    return Driver(config)
