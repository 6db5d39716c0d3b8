"""AsyncLLM: an LLMEngine driven by a background thread, one async stream of outputs per request.

Threading model. One engine thread owns the LLMEngine: nothing else ever touches it. Callers on
the event loop talk to that thread through a command list (add, abort, call), guarded by a
condition variable; the thread applies every pending command, runs one `engine.step()` if any
request is unfinished, hands the step's outputs to the requests' asyncio queues with a single
`loop.call_soon_threadsafe`, and sleeps on the condition when there is nothing to do. The model
forward is CPU-bound torch and runs in that thread, so the event loop stays free to accept
connections and write chunks while a step runs. Concurrent requests all sit in the engine's
scheduler and share its continuous batching.

Why a separate thread and not the caller's: stepping in the thread that loaded the model was
faster on an idle machine but collapsed whenever another runnable thread competed for a core,
which a server always has (BENCHMARKS.md, "Design choices measured").

Abort. When the consumer of a request's stream stops early (`RequestStream.close()`, or the
`generate()` generator is closed or its task cancelled, e.g. because the HTTP client went away,
or the task awaiting `add_request` is cancelled) or when `abort()` is called, an abort command
is queued and the engine thread calls `engine.abort_request` before its next step: the request's
KV blocks are free at the next step boundary, at most one step later. An explicit `abort()`
also ends the request's stream with a final output whose finish_reason is "abort".

Timings. The engine does not timestamp tokens, so they are measured here, in the engine thread,
with time.monotonic(): arrival when `generate()` is called, "scheduled" at the start of the first
step after which the request has computed tokens (the scheduler plans the step before the forward
runs, so that is when it was first scheduled), and each token batch when the step that produced it
returns. Per step, an `IterationStats` with those numbers goes to every registered stat logger
(the server's Prometheus metrics) from the engine thread.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from kvflow.core import RequestStatus, SchedulerStats
from kvflow.engine.llm_engine import EngineArgs, LLMEngine
from kvflow.engine.outputs import CompletionOutput, RequestOutput
from kvflow.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine thread stopped (an exception in a step, or shutdown())."""


@dataclass(slots=True)
class FinishedRequestStats:
    finish_reason: str              # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int
    num_generation_tokens: int
    e2e_latency: float              # finish - arrival, seconds
    queue_time: float | None        # first scheduled - arrival (None: never scheduled)
    prefill_time: float | None      # first token - first scheduled
    decode_time: float | None       # last token - first token
    first_token_latency: float | None


@dataclass(slots=True)
class IterationStats:
    """What happened in one engine-thread iteration (a step and/or commands)."""
    scheduler_stats: SchedulerStats
    num_prompt_tokens: int = 0          # prompt tokens of requests scheduled for the first time
    num_generation_tokens: int = 0      # tokens sampled this step
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


class _Stream:
    __slots__ = ("queue", "loop", "arrival", "scheduled", "first_token", "last_token",
                 "num_prompt_tokens", "num_tokens", "last_output")

    def __init__(self, queue: asyncio.Queue, loop: asyncio.AbstractEventLoop, arrival: float):
        self.queue, self.loop, self.arrival = queue, loop, arrival
        self.scheduled: float | None = None
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.num_prompt_tokens = 0
        self.num_tokens = 0
        self.last_output: RequestOutput | None = None


def _deliver(items: list) -> None:
    for q, item in items:
        q.put_nowait(item)


class AsyncLLM:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_config = engine.model_config
        self.scheduler_config = engine.scheduler_config
        self.stat_loggers: list = []
        self._cv = threading.Condition()
        self._commands: list[tuple] = []
        self._streams: dict[str, _Stream] = {}     # engine thread only
        self._unscheduled: set[str] = set()         # engine thread only
        self._ids = itertools.count()
        self._dead: BaseException | None = None
        self.step_error: BaseException | None = None     # what killed the engine thread
        self._on_dead: list[Callable[[BaseException], object]] = []
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kvflow-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "AsyncLLM":
        return cls(LLMEngine(args))

    # ---- the caller's side (event loop) ---------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    @property
    def errored(self) -> bool:
        return not self.is_running

    def _submit(self, *cmds: tuple) -> None:
        with self._cv:
            if self._dead is not None or self._stopping:
                raise EngineDeadError(f"the engine is not running ({self._dead!r})")
            self._commands.extend(cmds)
            self._cv.notify()

    async def add_request(self, request_id: str, prompt,
                          sampling_params: SamplingParams | None = None,
                          priority: int = 0) -> "RequestStream":
        """Hand a request to the engine; returns its output stream once the engine accepted it.

        ValueErrors of LLMEngine.add_request (bad prompt, too long, duplicate id, ...) are raised
        here. Whoever holds the stream must iterate it to the end or close() it (which aborts).
        """
        (stream,) = await self.add_requests([(request_id, prompt, sampling_params, priority)])
        return stream

    async def add_requests(self, items: list[tuple]) -> list["RequestStream"]:
        """add_request for several (request_id, prompt, sampling_params, priority) at once: all
        reach the engine together, before its next step, so a batch is scheduled as a batch.
        All or none: if one is refused, the others are aborted and its error is raised."""
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        queues = [asyncio.Queue() for _ in items]
        futs = [concurrent.futures.Future() for _ in items]
        self._submit(*(("add", rid, prompt, sp, prio, q, loop, fut, now)
                       for (rid, prompt, sp, prio), q, fut in zip(items, queues, futs)))
        try:
            await asyncio.gather(*(asyncio.wrap_future(f) for f in futs))
        except BaseException:
            for (rid, *_), fut in zip(items, futs):
                if not fut.cancel() and not (fut.done() and fut.exception() is not None):
                    self._abort_quietly(rid)     # added (or being added): take it out
            raise
        return [RequestStream(self, rid, q) for (rid, *_), q in zip(items, queues)]

    async def generate(self, prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0,
                       ) -> AsyncIterator[RequestOutput]:
        """Yield cumulative RequestOutputs for one request; the last has finished=True.

        When the consumer falls behind, intermediate outputs are skipped (each one is cumulative,
        so the newest says everything). Closing the generator, or cancelling the task while it
        awaits the next output, aborts the request at once. (If a consumer raises in its own loop
        body, Python closes the generator only when it is garbage-collected; use
        `contextlib.aclosing`, or `add_request` and `RequestStream.close()`, as the server does.)
        """
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        stream = await self.add_request(rid, prompt, sampling_params, priority)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def _abort_quietly(self, request_id: str) -> None:
        try:
            self._submit(("abort", (request_id,), False))
        except EngineDeadError:
            pass

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort requests; their streams end with finish_reason "abort". Unknown ids: no-op."""
        ids = (request_id,) if isinstance(request_id, str) else tuple(request_id)
        self._submit(("abort", ids, True))

    async def call_in_engine(self, fn: Callable[[LLMEngine], object]):
        """Run fn(engine) in the engine thread between steps; returns its result. For stats and
        tests: the engine is never touched from any other thread."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(("call", fn, fut))
        return await asyncio.wrap_future(fut)

    async def check_health(self) -> None:
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running ({self._dead!r})")

    def on_engine_dead(self, fn: Callable[[BaseException], object]) -> None:
        """fn(error) is called once, from the engine thread, if a step fails and the engine
        stops (not on shutdown()): `kvflow serve` then exits so that a supervisor restarts it."""
        self._on_dead.append(fn)

    def add_stat_logger(self, logger) -> None:
        """logger.record(IterationStats) is called from the engine thread after every
        iteration that did something."""
        self.stat_loggers.append(logger)

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)

    # ---- the engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._cv:
                    while (not self._commands and not self._stopping
                           and not engine.has_unfinished_requests()):
                        self._cv.wait()
                    if self._stopping:
                        break
                    cmds, self._commands = self._commands, []
                out: list = []
                stats = IterationStats(SchedulerStats())
                self._apply(cmds, out, stats)
                if engine.has_unfinished_requests():
                    self._step(out, stats)
                self._publish(out, stats)
            self._fail(EngineDeadError("the engine was shut down"))
        except BaseException as e:     # a bug in a step: fail every request, mark dead
            traceback.print_exc()
            self.step_error = e
            self._fail(EngineDeadError(f"engine step failed: {e!r}"))
            for fn in self._on_dead:
                try:
                    fn(e)
                except Exception:
                    traceback.print_exc()

    def _apply(self, cmds: list[tuple], out: list, stats: IterationStats) -> None:
        engine = self.engine
        for cmd in cmds:
            kind = cmd[0]
            if kind == "add":
                _, rid, prompt, sp, priority, queue, loop, fut, arrival = cmd
                if not fut.set_running_or_notify_cancel():    # the caller gave up already
                    continue
                try:
                    engine.add_request(rid, prompt, sp, priority=priority)
                except BaseException as e:
                    fut.set_exception(e)
                    continue
                st = _Stream(queue, loop, arrival)
                st.num_prompt_tokens = len(engine.scheduler.requests[rid].prompt_token_ids)
                self._streams[rid] = st
                self._unscheduled.add(rid)
                fut.set_result(None)
            elif kind == "abort":
                _, ids, notify = cmd
                live = [rid for rid in ids if rid in self._streams]
                engine.abort_request(live)
                now = time.monotonic()
                for rid in live:
                    st = self._streams.pop(rid)
                    self._unscheduled.discard(rid)
                    stats.finished_requests.append(_finished_stats(st, "abort", now))
                    if notify:
                        out.append((st, _aborted_output(rid, st)))
            elif kind == "call":
                _, fn, fut = cmd
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    fut.set_result(fn(engine))
                except BaseException as e:
                    fut.set_exception(e)

    def _step(self, out: list, stats: IterationStats) -> None:
        engine = self.engine
        p0, g0 = engine.num_prompt_tokens, engine.num_generation_tokens
        t0 = time.monotonic()
        outputs = engine.step()
        t1 = time.monotonic()
        stats.num_prompt_tokens = engine.num_prompt_tokens - p0
        stats.num_generation_tokens = engine.num_generation_tokens - g0
        if self._unscheduled:
            reqs = engine.scheduler.requests
            for rid in list(self._unscheduled):
                r = reqs.get(rid)
                if r is None or r.num_computed_tokens > 0 or r.status != RequestStatus.WAITING:
                    self._streams[rid].scheduled = t0
                    self._unscheduled.discard(rid)
        for o in outputs:
            st = self._streams.get(o.request_id)
            if st is None:
                continue
            n = len(o.outputs[0].token_ids)
            if n > st.num_tokens:
                if st.first_token is None:
                    st.first_token = t1
                    stats.time_to_first_tokens.append(t1 - st.arrival)
                else:
                    stats.inter_token_latencies.append(t1 - st.last_token)
                st.last_token = t1
                st.num_tokens = n
            st.last_output = o
            out.append((st, o))
            if o.finished:
                del self._streams[o.request_id]
                self._unscheduled.discard(o.request_id)
                stats.finished_requests.append(
                    _finished_stats(st, o.outputs[0].finish_reason or "stop", t1))

    @staticmethod
    def _send(out: list) -> None:
        """Hand (stream, item) pairs to their event loops, one callback per loop."""
        by_loop: dict = {}
        for st, item in out:
            by_loop.setdefault(st.loop, []).append((st.queue, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:        # that loop is closed: nobody is listening
                pass

    def _publish(self, out: list, stats: IterationStats) -> None:
        self._send(out)
        stats.scheduler_stats = self.engine.scheduler.make_stats()
        for logger in self.stat_loggers:
            try:
                logger.record(stats)
            except Exception:
                traceback.print_exc()

    def _fail(self, err: BaseException) -> None:
        with self._cv:
            self._dead = err
            cmds, self._commands = self._commands, []
        for cmd in cmds:
            fut = cmd[7] if cmd[0] == "add" else cmd[2] if cmd[0] == "call" else None
            if fut is not None and fut.set_running_or_notify_cancel():
                fut.set_exception(err)
        out = [(st, err) for st in self._streams.values()]
        self._streams.clear()
        self._send(out)


class RequestStream:
    """The async iterator of one request's cumulative outputs (see AsyncLLM.add_request)."""

    def __init__(self, owner: AsyncLLM, request_id: str, queue: asyncio.Queue) -> None:
        self.owner, self.request_id, self.queue = owner, request_id, queue
        self.finished = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        q = self.queue
        item = await q.get()
        while not q.empty() and not isinstance(item, BaseException):
            item = q.get_nowait()
        if isinstance(item, BaseException):
            self.finished = True        # the engine has already dropped the request
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        """Abort the request unless it already finished. Idempotent."""
        if not self.finished:
            self.finished = True
            self.owner._abort_quietly(self.request_id)


def _aborted_output(rid: str, st: _Stream) -> RequestOutput:
    last = st.last_output
    if last is None:
        return RequestOutput(rid, None, [], [CompletionOutput(0, "", [], "abort")], True)
    c = last.outputs[0]
    return RequestOutput(rid, last.prompt, last.prompt_token_ids,
                         [CompletionOutput(0, c.text, list(c.token_ids), "abort")], True,
                         last.num_cached_tokens)


def _finished_stats(st: _Stream, reason: str, now: float) -> FinishedRequestStats:
    first, sched = st.first_token, st.scheduled
    return FinishedRequestStats(
        finish_reason=reason, num_prompt_tokens=st.num_prompt_tokens,
        num_generation_tokens=st.num_tokens, e2e_latency=now - st.arrival,
        queue_time=None if sched is None else sched - st.arrival,
        prefill_time=None if first is None or sched is None else first - sched,
        decode_time=None if first is None else st.last_token - first,
        first_token_latency=None if first is None else first - st.arrival)
