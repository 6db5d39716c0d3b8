"""AsyncLLM: the serving frontend. Prompts in, one async stream of outputs per request.

The frontend owns text: it validates and tokenizes prompts (InputProcessor), detokenizes and
applies stop strings (OutputProcessor), and times every request for the metrics. The engine core
(scheduler + model runner) runs in a process of its own by default (MPClient: msgpack over ZMQ),
so the model's steps never wait on the event loop, HTTP, tokenization or detokenization, and
vice versa. `multiprocess=False` (or KVFLOW_ENABLE_MULTIPROCESSING=0) runs it in a thread of
this process instead (InprocClient), where tests can reach into it with `call_in_engine`.

Outputs arrive on one client thread, step by step; that thread detokenizes and hands each
request's output to its asyncio queue with one `loop.call_soon_threadsafe` per loop. A stream
consumer that stops early (`RequestStream.close()`, a cancelled task, a closed generator) aborts
its request: the core frees its blocks before its next step. A request with n > 1 runs as n
child requests in the core (engine/parallel_sampling.py); its one stream yields all n
completions as they progress, and closing it aborts every child.

If the core dies (a failed step, a killed process), every stream ends with EngineDeadError,
`is_running` turns False (the server's /health answers 503) and `on_engine_dead` callbacks run.
"""
from __future__ import annotations

import asyncio
import itertools
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from kvflow import envs
from kvflow.core import SchedulerStats
from kvflow.engine.arg_utils import EngineArgs
from kvflow.engine.core_client import InprocClient, MPClient
from kvflow.engine.messages import EngineCoreOutputs
from kvflow.engine.outputs import CompletionOutput, RequestOutput
from kvflow.engine.parallel_sampling import ParentRequests
from kvflow.engine.processor import InputProcessor, OutputProcessor
from kvflow.engine.tokenizer import Tokenizer
from kvflow.model.loader.checkpoint import open_checkpoint
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
    # Per finished request (a parent once all its children are): its n and its longest output.
    n_params: list[int] = field(default_factory=list)
    max_num_generation_tokens: list[int] = field(default_factory=list)


class _Stream:
    __slots__ = ("queue", "loop", "arrival", "scheduled", "first_token", "last_token",
                 "num_prompt_tokens", "num_tokens", "last_output")

    def __init__(self, queue: asyncio.Queue, loop: asyncio.AbstractEventLoop, arrival: float,
                 num_prompt_tokens: int):
        # One per request the core runs: a parent's n children share its queue, and each is
        # timed as a request of its own in the metrics (as vLLM counts them).
        self.queue, self.loop, self.arrival = queue, loop, arrival
        self.scheduled: float | None = None
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.num_prompt_tokens = num_prompt_tokens
        self.num_tokens = 0
        self.last_output: RequestOutput | None = None


def _deliver(items: list) -> None:
    for q, item in items:
        q.put_nowait(item)


def multiprocessing_enabled() -> bool:
    return envs.KVFLOW_ENABLE_MULTIPROCESSING


class AsyncLLM:
    def __init__(self, args: EngineArgs, multiprocess: bool | None = None) -> None:
        t0 = time.perf_counter()
        self.stat_loggers: list = []
        self._lock = threading.Lock()       # streams and output processor: loop vs client thread
        self._streams: dict[str, _Stream] = {}     # by the core's request id
        self._parents = ParentRequests()            # n > 1
        self._ids = itertools.count()
        self._dead: BaseException | None = None
        self.step_error: BaseException | None = None     # what killed the engine core
        self._on_dead: list[Callable[[BaseException], object]] = []
        self._last_stats = SchedulerStats()
        if multiprocess if multiprocess is not None else multiprocessing_enabled():
            client = MPClient(args, self._on_outputs, self._core_died)
            try:        # the tokenizer loads here while the core loads the model there
                self.tokenizer = Tokenizer.from_checkpoint(open_checkpoint(args.model))
                ready = client.wait_ready()
            except BaseException:
                client.shutdown(timeout=5)
                raise
            self.model_config, self.scheduler_config = ready.model_config, ready.scheduler_config
            client.start()
        else:
            from kvflow.engine.core import EngineCore
            ckpt = open_checkpoint(args.model)
            core = EngineCore(args, ckpt)
            self.tokenizer = Tokenizer.from_checkpoint(ckpt)
            self.model_config, self.scheduler_config = core.model_config, core.scheduler_config
            client = InprocClient(core, self._on_outputs, self._core_died)
        self.input_processor = InputProcessor(self.tokenizer, self.model_config,
                                              self.scheduler_config)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.client = client
        self.load_time = time.perf_counter() - t0

    @classmethod
    def from_engine_args(cls, args: EngineArgs, multiprocess: bool | None = None) -> "AsyncLLM":
        return cls(args, multiprocess)

    # ---- the caller's side (event loop) ---------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self._dead is None and self.client.is_alive()

    @property
    def errored(self) -> bool:
        return not self.is_running

    def _check_running(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine is not running ({self._dead!r})")

    async def add_request(self, request_id: str, prompt,
                          sampling_params: SamplingParams | None = None,
                          priority: int = 0) -> "RequestStream":
        """Hand a request to the engine; returns its output stream. A ValueError names what is
        wrong with it. Whoever holds the stream must iterate it to the end or close() it."""
        (stream,) = await self.add_requests([(request_id, prompt, sampling_params, priority)])
        return stream

    async def add_requests(self, items: list[tuple]) -> list["RequestStream"]:
        """add_request for several (request_id, prompt, sampling_params, priority) at once: all
        reach the engine together, so a batch is scheduled as a batch. All or none."""
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        reqs = [self.input_processor.process(rid, prompt, sp, now, prio)
                for rid, prompt, sp, prio in items]
        fans = [(text, *self._parents.fan_out(text, r)) for text, r in reqs]
        ids = [r.request_id for _, r in reqs]
        # Each request claims its id, and a parent also its children's.
        claimed = ids + [c.request_id for _, p, cs in fans if p is not None for c in cs]
        if len(set(claimed)) < len(claimed):
            raise ValueError("request ids in one batch must be distinct")
        queues = [asyncio.Queue() for _ in items]
        with self._lock:
            self._check_running()
            taken = next((rid for rid in claimed
                          if rid in self._streams or rid in self._parents), None)
            if taken is not None:
                raise ValueError(f"request id {taken!r} is already in use")
            for (text, parent, children), q in zip(fans, queues):
                if parent is not None:
                    self._parents.add(parent)
                for r in children:
                    self.output_processor.add(text, r)
                    self._streams[r.request_id] = _Stream(q, loop, now, len(r.prompt_token_ids))
        self.client.add([r for _, _, children in fans for r in children])    # one batch
        return [RequestStream(self, rid, q, [c.request_id for c in children])
                for rid, q, (_, _, children) in zip(ids, queues, fans)]

    async def generate(self, prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0,
                       ) -> AsyncIterator[RequestOutput]:
        """Yield cumulative RequestOutputs for one request; the last has finished=True.

        When the consumer falls behind, intermediate outputs are skipped (each one is cumulative,
        so the newest says everything). Closing the generator, or cancelling the task while it
        awaits the next output, aborts the request. (If a consumer raises in its own loop body,
        Python closes the generator only when it is garbage-collected; use
        `contextlib.aclosing`, or `add_request` and `RequestStream.close()`, as the server does.)
        """
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        stream = await self.add_request(rid, prompt, sampling_params, priority)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def _abort(self, request_ids, notify: bool) -> None:
        now = time.monotonic()
        out, finished = [], []
        with self._lock:
            ids = self._parents.expand(request_ids)     # a parent's: all its children
            live = [rid for rid in ids if rid in self._streams]
            self.output_processor.abort(live)
            for rid in live:
                st = self._streams.pop(rid)
                finished.append(_finished_stats(st, "abort", now))
                item = self._parents.to_parent(_aborted_output(rid, st))
                if notify:
                    out.append((st, item))
        if live and self._dead is None:
            self.client.abort(live)
        self._send(out)
        if finished:
            self._record(IterationStats(self._last_stats, finished_requests=finished))

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort requests; their streams end with finish_reason "abort". Unknown ids: no-op."""
        self._check_running()
        self._abort((request_id,) if isinstance(request_id, str) else tuple(request_id), True)

    async def call_in_engine(self, fn: Callable):
        """fn(engine_core) in the engine thread between steps (in-process engine only: tests)."""
        if not isinstance(self.client, InprocClient):
            raise TypeError("call_in_engine needs the in-process engine (multiprocess=False); "
                            "use call_utility")
        self._check_running()
        return await asyncio.wrap_future(self.client.call(fn))

    async def call_utility(self, method: str, *args):
        """An EngineCore utility by name (e.g. "kv_state"), wherever the core runs."""
        self._check_running()
        return await asyncio.wrap_future(self.client.utility(method, args))

    async def check_health(self) -> None:
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running ({self._dead!r})")

    def on_engine_dead(self, fn: Callable[[BaseException], object]) -> None:
        """fn(error) is called once, from a client thread, if the engine core fails (not on
        shutdown()): `kvflow serve` then exits so that a supervisor restarts it."""
        self._on_dead.append(fn)

    def add_stat_logger(self, logger) -> None:
        """logger.record(IterationStats) is called after every step, from the client thread."""
        self.stat_loggers.append(logger)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._fail(EngineDeadError("the engine was shut down"))
        self.client.shutdown(timeout)

    # ---- the client thread ----------------------------------------------------------------
    def _on_outputs(self, outs: EngineCoreOutputs) -> None:
        t1 = outs.step_end
        stats = IterationStats(outs.scheduler_stats, outs.num_prompt_tokens,
                               sum(len(o.new_token_ids) for o in outs.outputs))
        out: list = []
        with self._lock:
            results, to_abort = self.output_processor.process(outs.outputs)
            streams = self._streams
            for rid in outs.newly_scheduled:
                st = streams.get(rid)
                if st is not None and st.scheduled is None:
                    st.scheduled = outs.step_start
            for o in results:
                st = streams[o.request_id]
                self._time_tokens(st, o, t1, stats)
                item = self._parents.to_parent(o)
                out.append((st, item))
                if item.finished:
                    stats.n_params.append(len(item.outputs))
                    stats.max_num_generation_tokens.append(
                        max(len(c.token_ids) for c in item.outputs))
                if o.finished:
                    del streams[o.request_id]
                    stats.finished_requests.append(
                        _finished_stats(st, o.outputs[0].finish_reason or "stop", t1))
        if to_abort:
            self.client.abort(to_abort)
        self._send(out)
        self._last_stats = outs.scheduler_stats or self._last_stats
        self._record(stats)

    @staticmethod
    def _time_tokens(st: _Stream, o: RequestOutput, t1: float, stats: IterationStats) -> None:
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

    def _record(self, stats: IterationStats) -> None:
        for logger in self.stat_loggers:
            try:
                logger.record(stats)
            except Exception:
                traceback.print_exc()

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

    def _core_died(self, err: BaseException) -> None:
        self.step_error = err
        self._fail(EngineDeadError(f"engine step failed: {err!r}"))
        for fn in self._on_dead:
            try:
                fn(err)
            except Exception:
                traceback.print_exc()

    def _fail(self, err: BaseException) -> None:
        with self._lock:
            if self._dead is None:
                self._dead = err
            out = [(st, err) for st in self._streams.values()]
            self.output_processor.abort(list(self._streams))
            self._streams.clear()
            self._parents = ParentRequests()
        self._send(out)


class RequestStream:
    """The async iterator of one request's cumulative outputs (see AsyncLLM.add_request)."""

    def __init__(self, owner: AsyncLLM, request_id: str, queue: asyncio.Queue,
                 core_ids: list[str] | None = None) -> None:
        self.owner, self.request_id, self.queue = owner, request_id, queue
        self.core_ids = core_ids or [request_id]    # n > 1: the children the core runs
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
            self.owner._abort(self.core_ids, False)


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
