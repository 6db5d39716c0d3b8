"""The Executor: what the engine core hands each step to, and gets one ModelRunnerOutput back.

Two implementations: UniProcExecutor runs the model in this process; TPExecutor
(kvflow/engine/tp_executor.py) also drives tensor-parallel workers in others. Both own this
process's ModelRunner (`runner`, rank 0's under tensor parallelism).

With async scheduling the engine core calls execute_model(..., non_block=True): the step runs in
one executor thread, in submission order, and the call returns a Future at once, so that the
core schedules the next step while this one computes. Everything that touches the runner's
state afterwards (release) queues behind the steps in flight.
"""
from __future__ import annotations

import concurrent.futures
from abc import ABC, abstractmethod

from kvflow.core.config import SchedulerConfig
from kvflow.core.outputs import ModelRunnerOutput, SchedulerOutput
from kvflow.engine.arg_utils import EngineArgs
from kvflow.engine.worker import load_model, make_model_runner
from kvflow.model.runner.model_runner import ModelRunner
from kvflow.sampling_params import SamplingParams


class Executor(ABC):
    """Load the model (`__init__`), size and build the runner(s) (`initialize`), run steps."""
    runner: ModelRunner
    model_config = model = dtype = None

    def __init__(self, args: EngineArgs, ckpt, device: str, backend) -> None:
        self.args, self.device, self.backend = args, device, backend
        # vLLM's name: steps in flight at once (the engine core's batch queue depth).
        self.max_concurrent_batches = 2 if args.resolved_async_scheduling(device) else 1
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._last: concurrent.futures.Future | None = None

    @abstractmethod
    def initialize(self, scheduler_config: SchedulerConfig) -> None:
        """Build the runner(s) and their KV caches for this config."""

    @abstractmethod
    def _execute(self, so: SchedulerOutput, grammar_bitmask) -> ModelRunnerOutput:
        """One step, in the calling thread."""

    def execute_model(self, scheduler_output: SchedulerOutput, grammar_bitmask=None,
                      non_block: bool = False
                      ) -> ModelRunnerOutput | concurrent.futures.Future[ModelRunnerOutput]:
        if not non_block:
            return self._execute(scheduler_output, grammar_bitmask)
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="kvflow-execute")
        self._last = self._pool.submit(self._execute, scheduler_output, grammar_bitmask)
        return self._last

    def _in_flight(self) -> bool:
        return self._last is not None and not self._last.done()

    def release(self, request_ids) -> None:
        """Forget finished requests' runner state, after any step still in flight."""
        ids = list(request_ids)
        if self._in_flight():
            self._last = self._pool.submit(self.runner.release, ids)
        else:
            self.runner.release(ids)

    def wait_idle(self) -> None:
        """Until no step or release is in flight (before reading the runner's state)."""
        if self._last is not None:
            concurrent.futures.wait([self._last])

    @staticmethod
    def check_sampling_params(sp: SamplingParams) -> None:
        ModelRunner.check_sampling_params(sp)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


class UniProcExecutor(Executor):
    """The model and its runner in this process."""

    def __init__(self, args: EngineArgs, ckpt, device: str, backend) -> None:
        super().__init__(args, ckpt, device, backend)
        self.model_config, self.model, self.dtype = load_model(args, device, ckpt=ckpt)

    def initialize(self, scheduler_config: SchedulerConfig) -> None:
        self.runner = make_model_runner(self.args, self.model, self.model_config, self.dtype,
                                        self.backend, self.device, scheduler_config)

    def _execute(self, so: SchedulerOutput, grammar_bitmask) -> ModelRunnerOutput:
        return self.runner.execute_model(so, grammar_bitmask)
