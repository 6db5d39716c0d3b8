"""Fake OpenAI backends for the router tests: each records what it got, answers with its own
name (plain and streamed), can fail its /health, and holds a request open on demand."""
from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvflow.server.api_server import ServerThread
from kvflow.server.router import build_router_app

HOLD_LIMIT_S = 30.0     # a held request gives up on its own: nothing hangs if a test fails


class FakeBackend:
    """Body flags: "hold": answer only once `release` is set; "stream_gate": stream one chunk,
    then wait for `release` (sending "late" if it never came)."""

    def __init__(self, name: str) -> None:
        self.name, self.got, self.healthy = name, [], True
        self.holding, self.release = threading.Event(), threading.Event()
        self.app = FastAPI()
        self.app.add_api_route("/health", self._health)
        self.app.add_api_route("/v1/models", self._models)
        for path in ("/v1/completions", "/v1/chat/completions"):
            self.app.add_api_route(path, self._generate, methods=["POST"])
        self.srv = ServerThread(self.app)

    @property
    def url(self) -> str:
        return self.srv.url

    async def _health(self):
        return Response(status_code=200 if self.healthy else 503)

    async def _models(self):
        return {"object": "list", "data": [{"id": "fake", "object": "model"}]}

    async def _generate(self, request: Request):
        body = await request.json()
        self.got.append({"path": request.url.path, "body": body,
                         "auth": request.headers.get("authorization")})
        if body.get("hold"):
            self.holding.set()
            await self._wait_release()
        if body.get("bad"):
            return JSONResponse({"error": {"message": "bad", "code": 400}}, status_code=400)
        if body.get("stream"):
            return StreamingResponse(self._chunks(body), media_type="text/event-stream")
        return {"backend": self.name, "choices": [{"index": 0, "text": self.name}]}

    async def _chunks(self, body: dict):
        yield _event(f"{self.name}-0")
        if body.get("stream_gate"):
            self.holding.set()
            if not await self._wait_release():
                yield _event("late")
        yield _event(f"{self.name}-1")
        yield "data: [DONE]\n\n"

    async def _wait_release(self) -> bool:
        deadline = time.monotonic() + HOLD_LIMIT_S
        while not self.release.is_set():
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.01)
        return True


def _event(text: str) -> str:
    return f"data: {json.dumps({'choices': [{'index': 0, 'text': text}]})}\n\n"


@contextlib.contextmanager
def fake_backends(n: int = 2):
    backends = [FakeBackend(f"b{i}") for i in range(n)]
    for b in backends:
        b.srv.start()
    try:
        yield backends
    finally:
        for b in backends:
            b.release.set()
            b.srv.stop()


@contextlib.contextmanager
def running_router(urls: list[str], policy: str = "prefix", **kw):
    kw = {"health_check_interval": 0.05, "health_check_timeout": 2.0,
          "health_failure_threshold": 1, **kw}
    srv = ServerThread(build_router_app(urls, policy, **kw)).start()
    try:
        yield srv
    finally:
        srv.stop()


def wait_until(pred, timeout: float = 30.0) -> bool:
    """Poll pred (a bound against hangs, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def sse_texts(lines) -> list:
    """The data payloads of an SSE stream's lines: parsed JSON, or the string [DONE]."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def post(url: str, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60, **kw)
