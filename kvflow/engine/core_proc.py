"""The engine core's process: load the model, then loop receiving requests, stepping, sending.

Started by MPClient as `python -m kvflow.engine.core_proc IN_ADDR OUT_ADDR PARENT_PID ARGS_JSON`. It exits when told to (Shutdown), when its parent process is gone
(checked every step and every second when idle: no orphan outlives the server), or on an error,
after telling the frontend (EngineDead) and with exit code 1.
"""
from __future__ import annotations

import os
import signal
import sys
import traceback

import msgspec
import zmq

from kvflow.engine.arg_utils import EngineArgs
from kvflow.engine.messages import (AbortRequests, AddRequests, CoreInput, EngineDead, Shutdown,
                                    UtilityCall, UtilityResult)


def run_engine_core(args: EngineArgs, in_addr: str, out_addr: str, parent_pid: int) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # Ctrl-C is the frontend's to handle
    ctx = zmq.Context()
    inp, out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for s, addr in ((inp, in_addr), (out, out_addr)):
        s.setsockopt(zmq.LINGER, 1000)
        s.setsockopt(zmq.SNDHWM, 0)     # never block on a slow reader ...
        s.connect(addr)
    enc = msgspec.msgpack.Encoder()
    code, core = 0, None
    try:
        from kvflow.engine.core import EngineCore
        core = EngineCore(args)
        _send(out, enc.encode(core.ready_message()))
        _loop(core, inp, out, enc, parent_pid)
    except _FrontendGone:
        pass
    except BaseException as e:
        traceback.print_exc()
        try:
            dead = EngineDead(f"{type(e).__name__}: {e}", isinstance(e, ValueError))
            _send(out, enc.encode(dead))
        except _FrontendGone:
            pass
        code = 1
    finally:
        if core is not None:
            core.shutdown()     # tensor-parallel workers, if any
        ctx.destroy(linger=1000)
    return code


def _loop(core, inp: zmq.Socket, out: zmq.Socket, enc, parent_pid: int) -> None:
    dec = msgspec.msgpack.Decoder(CoreInput)
    while True:
        if not core.has_unfinished_requests():
            while not inp.poll(1000):       # idle: wake up now and then to look for the parent
                if os.getppid() != parent_pid:
                    return
        handled = False
        while True:
            try:
                frame = inp.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            msg = dec.decode(frame.buffer)
            if isinstance(msg, Shutdown):
                return
            handled |= _handle(core, msg, out, enc)
        # after adds or aborts alone, an empty step still reports the freed blocks' stats
        if handled or core.has_unfinished_requests():
            _send(out, enc.encode(core.step()))
        if os.getppid() != parent_pid:
            return


def _handle(core, msg, out: zmq.Socket, enc) -> bool:
    """True: the scheduler's state changed."""
    from kvflow.engine.core_client import _utility
    if isinstance(msg, AddRequests):
        for r in msg.requests:
            core.add_request(r)
        return True
    if isinstance(msg, AbortRequests):
        core.abort_requests(msg.request_ids)
        return True
    if isinstance(msg, UtilityCall):
        try:
            res = UtilityResult(msg.call_id, _utility(core, msg.method, msg.args))
        except Exception as e:
            res = UtilityResult(msg.call_id, None, f"{type(e).__name__}: {e}")
        _send(out, enc.encode(res))
    return False


class _FrontendGone(Exception):
    pass


def _send(out: zmq.Socket, data: bytes) -> None:
    try:    # ... so Again means no reader at all: the frontend's process is gone
        out.send(data, zmq.NOBLOCK, copy=False)
    except zmq.Again:
        raise _FrontendGone from None


if __name__ == "__main__":
    in_addr, out_addr, ppid, args_json = sys.argv[1:5]
    sys.exit(run_engine_core(msgspec.json.decode(args_json, type=EngineArgs), in_addr, out_addr,
                             int(ppid)))
