"""Shared by the server tests: a kvflow server on 127.0.0.1 (free port) with a tiny model, engine
state read from inside the engine thread, and /metrics parsed into {(name, labels): value}."""
from __future__ import annotations

import asyncio
import contextlib
import time
from types import SimpleNamespace

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvflow.engine.async_llm import AsyncLLM
from kvflow.engine.llm_engine import EngineArgs
from kvflow.server.api_server import ServerThread, build_app

ENGINE = dict(dtype="float32", num_threads=1, max_model_len=256)


@contextlib.contextmanager
def running_server(model_dir: str, api_key: str | None = None, name: str = "tiny",
                   app_kw: dict | None = None, server_kw: dict | None = None, **engine_kw):
    """app_kw go to build_app, server_kw to ServerThread (timeouts), the rest to EngineArgs."""
    threads = torch.get_num_threads()
    llm = AsyncLLM.from_engine_args(EngineArgs(model=model_dir, **{**ENGINE, **engine_kw}))
    app = build_app(llm, name, api_key=api_key, model_path=model_dir, **(app_kw or {}))
    srv = ServerThread(app, **(server_kw or {})).start()
    try:
        yield SimpleNamespace(url=srv.url, llm=llm, app=app, name=name, api_key=api_key)
    finally:
        srv.stop()
        llm.shutdown()
        torch.set_num_threads(threads)


def engine_state(llm: AsyncLLM) -> dict:
    """Scheduler and KV-cache numbers, read in the engine thread between steps."""
    def read(engine):
        s = engine.scheduler
        return {"running": len(s.running), "waiting": len(s.waiting),
                "unfinished": len(s.requests), "states": len(engine.states),
                "free_blocks": s.kv_cache_manager.block_pool.num_free_blocks,
                "num_blocks": engine.scheduler_config.num_blocks}
    return asyncio.run(llm.call_in_engine(read))


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
