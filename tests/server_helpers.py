"""Shared by the server tests: a kvflow server on 127.0.0.1 (free port) with a tiny model, engine
state read from inside the engine thread, and /metrics parsed into {(name, labels): value}."""
from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvflow.engine.async_llm import AsyncLLM
from kvflow.engine.llm_engine import EngineArgs
from kvflow.server.api_server import ServerThread, build_app

ENGINE = dict(dtype="float32", num_threads=1, max_model_len=256)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_run(n: int) -> int:
    """A free port p with p+1 .. p+n free too (a router and its n replicas)."""
    for _ in range(50):
        p = free_port()
        if p + n <= 65535 and all(_is_free(p + i) for i in range(1, n + 1)):
            return p
    raise RuntimeError("no run of free ports")


def stop(proc: subprocess.Popen, sig: int, timeout: float) -> str:
    """Send sig to a server process and return its output once it exits (killed after timeout)."""
    proc.send_signal(sig)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@contextlib.contextmanager
def running_server(model_dir: str, api_key: str | None = None, name: str = "tiny",
                   app_kw: dict | None = None, server_kw: dict | None = None,
                   multiprocess: bool = False, core_patch: str | None = None, **engine_kw):
    """app_kw go to build_app, server_kw to ServerThread (timeouts), the rest to EngineArgs.
    multiprocess=False: the engine core steps in a thread, where tests can patch it.
    core_patch: Python run first thing in the engine core's process (a sitecustomize)."""
    threads = torch.get_num_threads()
    with _core_patched(core_patch):
        llm = AsyncLLM.from_engine_args(EngineArgs(model=model_dir, **{**ENGINE, **engine_kw}),
                                        multiprocess=multiprocess)
    app = build_app(llm, name, api_key=api_key, model_path=model_dir, **(app_kw or {}))
    srv = ServerThread(app, **(server_kw or {})).start()
    try:
        yield SimpleNamespace(url=srv.url, llm=llm, app=app, name=name, api_key=api_key)
    finally:
        srv.stop()
        llm.shutdown()
        torch.set_num_threads(threads)


def slow_core_steps(delay: float) -> str:
    """A core_patch (or sitecustomize): every engine step `delay` s longer, in whichever
    process the engine core runs."""
    return (f"import time\nfrom kvflow.engine.core import EngineCore\nstep = EngineCore.step\n"
            f"def slow(self):\n    time.sleep({delay})\n    return step(self)\n"
            f"EngineCore.step = slow\n")


SLOW_CORE_STEPS = slow_core_steps(0.02)


@contextlib.contextmanager
def _core_patched(code: str | None):
    """A spawned engine-core process runs `code` at start-up (PYTHONPATH -> sitecustomize.py)."""
    if code is None:
        yield
        return
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "sitecustomize.py"), "w") as f:
            f.write(code)
        old = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join([d] + sys.path)
        try:
            yield
        finally:
            if old is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = old


def engine_state(llm: AsyncLLM) -> dict:
    """Scheduler and KV-cache numbers, read by the engine core between steps, and the number of
    requests the frontend still tracks."""
    st = asyncio.run(llm.call_utility("kv_state"))
    return {**st, "states": len(llm.output_processor.states)}


def wait_idle(llm: AsyncLLM, timeout: float = 60.0) -> dict:
    """Poll until nothing runs or waits (a bound against hangs, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while True:
        st = engine_state(llm)
        if st["unfinished"] == 0 or time.monotonic() > deadline:
            return st
        time.sleep(0.02)


def metrics(url: str, api_key: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(url + "/metrics", headers=headers, timeout=30)
    r.raise_for_status()
    text = r.text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def metric(m: dict, name: str, **labels) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def slow_steps(llm: AsyncLLM, delay: float) -> None:
    """Make every engine step take `delay` s longer (set and undone in the engine thread)."""
    def patch(engine):
        real = type(engine).step.__get__(engine)

        def slow():
            time.sleep(delay)
            return real()
        engine.step = slow
    asyncio.run(llm.call_in_engine(patch))
