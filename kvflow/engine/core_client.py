"""How a frontend reaches its EngineCore: a thread of its own process, or a process of its own.

Both clients take the same calls (add, abort, utility, shutdown) and hand every step's
EngineCoreOutputs to `on_outputs` from one thread of theirs, in step order; `on_dead(error)` is
called once if the core stops on an error (a failed step, a crashed process).
"""
from __future__ import annotations

import concurrent.futures
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable

import msgspec
import zmq

from kvflow import envs
from kvflow.engine.arg_utils import EngineArgs
from kvflow.engine.messages import (AbortRequests, AddRequests, CoreOutput, EngineCoreOutputs,
                                    EngineCoreRequest, EngineDead, Ready, Shutdown, UtilityCall,
                                    UtilityResult)

OnOutputs = Callable[[EngineCoreOutputs], object]
OnDead = Callable[[BaseException], object]


class EngineCoreDied(RuntimeError):
    """The engine core stopped on an error; the message says which."""


class InprocClient:
    """The core steps in a background thread; commands reach it between steps."""

    def __init__(self, core, on_outputs: OnOutputs, on_dead: OnDead) -> None:
        self.core, self.on_outputs, self.on_dead = core, on_outputs, on_dead
        self._cv = threading.Condition()
        self._commands: list[tuple] = []
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kvflow-engine", daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _submit(self, cmd: tuple) -> None:
        with self._cv:
            self._commands.append(cmd)
            self._cv.notify()

    def add(self, requests: list[EngineCoreRequest]) -> None:
        self._submit(("add", requests))

    def abort(self, request_ids: list[str]) -> None:
        self._submit(("abort", request_ids))

    def call(self, fn: Callable) -> concurrent.futures.Future:
        """fn(core) in the engine thread, between steps."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(("call", fn, fut))
        return fut

    def utility(self, method: str, args: tuple) -> concurrent.futures.Future:
        return self.call(lambda core: _utility(core, method, args))

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)

    def _run(self) -> None:
        core = self.core
        try:
            while True:
                with self._cv:
                    while (not self._commands and not self._stopping
                           and not core.has_unfinished_requests()):
                        self._cv.wait()
                    if self._stopping:
                        break
                    cmds, self._commands = self._commands, []
                for cmd in cmds:
                    self._apply(cmd)
                # after adds or aborts alone, an empty step still reports the freed blocks' stats
                if core.has_unfinished_requests() or any(c[0] != "call" for c in cmds):
                    self.on_outputs(core.step())
        except BaseException as e:     # a bug in a step: the frontend fails every request
            traceback.print_exc()
            self.on_dead(e)
        finally:
            for cmd in self._commands:
                if cmd[0] == "call" and cmd[2].set_running_or_notify_cancel():
                    cmd[2].set_exception(EngineCoreDied("the engine stopped"))

    def _apply(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            for r in cmd[1]:
                self.core.add_request(r)
        elif cmd[0] == "abort":
            self.core.abort_requests(cmd[1])
        else:
            fut = cmd[2]
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(cmd[1](self.core))
                except BaseException as e:
                    fut.set_exception(e)


def _utility(core, method: str, args) -> object:
    if method.startswith("_") or method not in UTILITIES:
        raise ValueError(f"no engine-core utility {method!r}; known: {sorted(UTILITIES)}")
    return getattr(core, method)(*args)


UTILITIES = frozenset({"kv_state", "reset_prefix_cache", "check_structured_outputs"})


def _core_env() -> dict:
    """OpenMP threads that sleep rather than spin between parallel regions: spinning ones fight
    the frontend and the HTTP clients for the cores, and a preempted thread stalls every
    barrier of the step (BENCHMARKS.md, "Serving: the engine-core process"). A user's own
    OMP_WAIT_POLICY wins. Plus kvflow's process defaults (envs.set_process_defaults)."""
    env = envs.set_process_defaults(dict(os.environ))
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


class MPClient:
    """The core runs in a process of its own (core_proc.py); msgpack over ZMQ.

    Two ipc sockets in a private temp dir: PUSH for requests and aborts, PULL for outputs. A
    frontend thread receives outputs and watches the process: if it exits or reports an error,
    on_dead fires. Start with start_process(), then wait_ready(), then start().
    """

    def __init__(self, args: EngineArgs, on_outputs: OnOutputs, on_dead: OnDead) -> None:
        self.on_outputs, self.on_dead = on_outputs, on_dead
        self._dir = tempfile.mkdtemp(prefix="kvflow-core-")
        self._ctx = zmq.Context()
        self._in = self._socket(zmq.PUSH, "in")
        self._out = self._socket(zmq.PULL, "out")
        self._send_lock = threading.Lock()
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(CoreOutput)
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._stopping = False
        self._dead = False
        # A fresh interpreter, as multiprocessing's spawn, but one that never re-imports the
        # caller's __main__ (an unguarded script, `python -c`, a notebook all work).
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvflow.engine.core_proc", self._addr("in"),
             self._addr("out"), str(os.getpid()), msgspec.json.encode(args).decode()],
            stdin=subprocess.DEVNULL, env=_core_env())
        self._thread = threading.Thread(target=self._run, name="kvflow-core-output", daemon=True)

    def _addr(self, name: str) -> str:
        return f"ipc://{self._dir}/{name}"

    def _socket(self, kind: int, name: str) -> zmq.Socket:
        s = self._ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.RCVHWM, 0)
        s.bind(self._addr(name))
        return s

    def wait_ready(self) -> Ready:
        """Block until the core has loaded the model; its load error is raised here."""
        while not self._out.poll(100):
            if self.proc.poll() is not None:
                raise EngineCoreDied(f"the engine core exited with code {self.proc.returncode} "
                                     f"while loading")
        msg = self._dec.decode(self._out.recv())
        if isinstance(msg, EngineDead) and msg.is_value_error:
            raise ValueError(msg.error.removeprefix("ValueError: "))
        if isinstance(msg, EngineDead):
            raise EngineCoreDied(f"the engine core failed to load: {msg.error}")
        assert isinstance(msg, Ready), msg
        return msg

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return not self._dead and self.proc.poll() is None

    def _send(self, msg) -> None:
        data = self._enc.encode(msg)
        with self._send_lock:
            if self._stopping or self._ctx.closed:
                return
            try:    # no high-water mark: Again only when the core's end is gone (it died)
                self._in.send(data, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                pass

    def add(self, requests: list[EngineCoreRequest]) -> None:
        self._send(AddRequests(requests))

    def abort(self, request_ids: list[str]) -> None:
        self._send(AbortRequests(list(request_ids)))

    def utility(self, method: str, args: tuple) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        cid = next(self._call_ids)
        self._calls[cid] = fut
        self._send(UtilityCall(cid, method, list(args)))
        return fut

    def shutdown(self, timeout: float = 10.0) -> None:
        self._send(Shutdown())
        with self._send_lock:
            self._stopping = True
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.close()

    def close(self) -> None:
        """Sockets and the socket directory go; nothing stays behind in /tmp."""
        if not self._thread.is_alive() and not self._ctx.closed:
            self._ctx.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)

    def _run(self) -> None:
        try:
            while not self._stopping or self.proc.poll() is None:
                if self._out.poll(100):
                    if not self._dispatch(self._dec.decode(self._out.recv())):
                        break
                elif self.proc.poll() is not None:
                    if not self._stopping:
                        raise EngineCoreDied(f"the engine core process exited with code "
                                             f"{self.proc.returncode}")
                    break
        except BaseException as e:
            self._die(e)
        finally:
            for fut in self._calls.values():
                if fut.set_running_or_notify_cancel():
                    fut.set_exception(EngineCoreDied("the engine core stopped"))
            self._calls.clear()

    def _dispatch(self, msg) -> bool:
        """False: stop receiving."""
        if isinstance(msg, EngineCoreOutputs):
            self.on_outputs(msg)
        elif isinstance(msg, UtilityResult):
            fut = self._calls.pop(msg.call_id, None)
            if fut is not None and fut.set_running_or_notify_cancel():
                if msg.error is None:
                    fut.set_result(msg.result)
                else:
                    fut.set_exception(RuntimeError(msg.error))
        elif isinstance(msg, EngineDead):
            self._die(EngineCoreDied(msg.error))
            return False
        return True

    def _die(self, err: BaseException) -> None:
        if not self._dead:
            self._dead = True
            self.on_dead(err)
