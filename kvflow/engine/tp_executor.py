"""Rank 0's side of tensor parallelism: start (or join) the workers, and drive them.

Rank 0 is the engine core (in the LLM's process, or core_proc's under the server). With
tensor_parallel_size N > 1 it either starts N - 1 worker processes itself
(`python -m kvflow.engine.tp_worker`, ranks 1..N-1 on this machine), or, when launched by
torchrun (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT in the environment), joins the ranks
torchrun started, on this node or others: after the rendezvous both are the same.

Each step, TPExecutor broadcasts the SchedulerOutput once (with the tokens rank 0 sampled in the
step before, which the workers' request states need for their next inputs), then runs the
same forward pass as the workers; only rank 0 gets the full logits and samples. A worker that
dies makes rank 0's next collective raise (its sockets close): the step raises, and the engine
is dead from then on (the ranks' states can no longer be trusted to agree).
"""
from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
import weakref

import msgspec

from kvflow import envs
from kvflow.core.config import SchedulerConfig
from kvflow.core.outputs import ModelRunnerOutput
from kvflow.engine.arg_utils import EngineArgs
from kvflow.engine.executor import Executor
from kvflow.engine.tp_messages import ExecuteStep, InitWorkers, ShutdownWorkers
from kvflow.engine.tp_worker import torchrun_env
from kvflow.engine.worker import load_model, make_model_runner
from kvflow.model.config import ModelConfig
from kvflow.model.distributed.parallel import TPGroup, check_tp_size, destroy, init_distributed

logger = logging.getLogger(__name__)

_ACTIVE: weakref.ref | None = None     # this process's TPExecutor (one process group per process)


def launch(args: EngineArgs, model_cfg, device: str
           ) -> tuple[TPGroup, list[subprocess.Popen]]:
    """Rank 0's process group, joined, and the worker processes it started (none under
    torchrun, whose ranks it joins)."""
    n = args.tensor_parallel_size
    check_tp_size(model_cfg, n)     # before any process starts
    _shut_down_previous()
    env = torchrun_env()
    procs: list[subprocess.Popen] = []
    if env is not None:
        rank, world, addr, port, local = env
        if world != n:
            raise ValueError(f"tensor_parallel_size={n} differs from WORLD_SIZE={world}")
        if rank != 0:
            raise RuntimeError(f"rank {rank} runs the worker loop (kvflow.engine.tp_worker), "
                               "not an engine")
    else:
        addr, port, local = "127.0.0.1", _free_port(), 0
        procs = [_spawn_worker(args, r, n, addr, port) for r in range(1, n)]
    try:
        tp = init_distributed(0, n, device, addr, port, local)
    except BaseException:
        _stop(None, procs, graceful=False)
        raise
    return tp, procs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn_worker(args: EngineArgs, rank: int, world: int, addr: str, port: int
                  ) -> subprocess.Popen:
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
               MASTER_ADDR=addr, MASTER_PORT=str(port))
    # Sleeping, not spinning, OpenMP threads: a worker waits in gloo between steps.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    envs.set_process_defaults(env)
    return subprocess.Popen(
        [sys.executable, "-m", "kvflow.engine.tp_worker", str(os.getpid()),
         msgspec.json.encode(args).decode()], stdin=subprocess.DEVNULL, env=env)


class TPExecutor(Executor):
    """Rank 0's executor: its own shard and runner, and each step broadcast to the workers
    before rank 0 runs it."""

    def __init__(self, args: EngineArgs, ckpt, device: str, backend) -> None:
        super().__init__(args, ckpt, device, backend)
        self.tp, self.procs = launch(args, ModelConfig.from_hf(ckpt.config), device)
        self._sampled: dict[str, list[int]] = {}
        self._failed: dict = {}
        self._error: str | None = None
        self._state = {"stopped": False}
        self._finalizer: weakref.finalize | None = None     # set once the workers are built
        try:
            self.model_config, self.model, self.dtype = load_model(args, device, self.tp, ckpt)
        except BaseException:
            self._abort()
            raise

    def initialize(self, scheduler_config: SchedulerConfig) -> None:
        global _ACTIVE
        try:
            self.runner = make_model_runner(self.args, self.model, self.model_config,
                                            self.dtype, self.backend, self.device,
                                            scheduler_config)
            # The workers size their KV caches from rank 0's scheduler config, then all meet.
            self.tp.send(InitWorkers(scheduler_config))
            self.tp.barrier()
        except Exception as e:      # a worker failed to load, or rank 0 did
            error = f"tensor-parallel start failed: {_explain(self.procs, e)}"
            self._abort()
            raise RuntimeError(error) from e
        except BaseException:
            self._abort()
            raise
        self._finalizer = weakref.finalize(self, _stop, self.tp, self.procs, True, self._state)
        _ACTIVE = weakref.ref(self)

    def _abort(self) -> None:
        """Starting failed: the workers cannot go on (they wait for a message that never comes)."""
        if not self._state["stopped"]:
            self._state["stopped"] = True
            _stop(self.tp, self.procs, graceful=False)

    def _execute(self, so, grammar_bitmask) -> ModelRunnerOutput:
        if self._error is not None:
            raise RuntimeError(self._error)
        try:
            self._check_workers()
            self.tp.send(ExecuteStep(so, self._sampled, list(self._failed)))
            out = self.runner.execute_model(so, grammar_bitmask)     # rank 0 alone samples
            self._sampled, self._failed = out.sampled(), out.failed
            return out
        except BaseException as e:
            # Also on KeyboardInterrupt: a step cut short leaves the ranks at different
            # points of their collectives, which no later step could realign.
            self._error = f"tensor-parallel step failed: {_explain(self.procs, e)}"
            logger.error("%s", self._error)
            self._state["stopped"] = True
            _stop(self.tp, self.procs, graceful=False)
            if not isinstance(e, Exception):
                raise
            raise RuntimeError(self._error) from e

    def _check_workers(self) -> None:
        for rank, p in enumerate(self.procs, 1):
            if p.poll() is not None:
                raise RuntimeError(f"worker rank {rank} exited with code {p.returncode}")

    def shutdown(self) -> None:
        """Tell the workers to exit and leave the process group (also at exit, or when the
        executor is collected)."""
        super().shutdown()
        if self._finalizer is None:
            self._abort()
        else:
            self._finalizer()


def _explain(procs: list[subprocess.Popen], e: Exception) -> str:
    """The error, and which worker died if one did (given a moment to be reaped)."""
    deadline = time.monotonic() + 1.0
    for rank, p in enumerate(procs, 1):
        try:
            p.wait(max(deadline - time.monotonic(), 0.01))
            return f"worker rank {rank} exited with code {p.returncode} ({e})"
        except subprocess.TimeoutExpired:
            pass
    return f"{type(e).__name__}: {e}"


def _stop(tp: TPGroup | None, procs: list[subprocess.Popen], graceful: bool,
          state: dict | None = None) -> None:
    if state is not None:     # the driver's finalizer: once, and not after a failure's _stop
        if state["stopped"]:
            return
        state["stopped"] = True
    if graceful and tp is not None:
        try:
            tp.send(ShutdownWorkers())
        except Exception:      # a worker is gone already: nothing to tell
            graceful = False
    for p in procs:
        try:
            p.wait(5 if graceful else 0.5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    if tp is not None:
        try:
            destroy(tp)
        except Exception as e:     # a broken group may refuse; the process exits anyway
            logger.warning("destroying the process group: %r", e)


def _shut_down_previous() -> None:
    """One process group per process: a new tensor-parallel engine ends the previous one."""
    prev = _ACTIVE() if _ACTIVE is not None else None
    if prev is not None:
        logger.warning("a new tensor-parallel engine shuts down the previous one in this process")
        prev.shutdown()
