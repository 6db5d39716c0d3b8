"""`kvflow router`: an OpenAI-compatible front for data-parallel replicas (docs/router.md).

POST /v1/completions and /v1/chat/completions go to the replica the routing policy picks
(kvflow/core/routing.py; the key is the prompt text, or for chat the conversation so far), and
the replica's answer comes back as it is: status, content type and body, streams chunk by chunk.
The router reuses the server's guard (API key on every route but /health, body-size limit),
body parsing (bad input is a 4xx before anything is routed) and uvicorn set-up (header and body
timeouts, shutdown grace period).

Errors of the router itself are OpenAI error objects: 503 with no healthy replica, 502 when the
replica fails under the request (a stream already started ends with an error event and [DONE]),
504 when it does not answer within --backend-timeout. A client that goes away has its upstream
request closed, so the replica aborts it.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvflow.core.routing import Key
from kvflow.server.bodies import ClientGone, read_json
from kvflow.server.http_common import (DEFAULT_MAX_BODY_BYTES, Drain, Guard, error_response,
                                       until_disconnect)
from kvflow.server.protocol import ApiError
from kvflow.server.router_pool import (ReplicaDown, ReplicaPool, Ticket, health_loop,
                                       or_killed)

logger = logging.getLogger("uvicorn.error")
_SSE = "text/event-stream"
SAME_KEY = object()     # build_router_app's default backend_api_key: the router's own


def completion_key(body: dict) -> Key:
    """The prompt: text, or token ids as a tuple; of a list of prompts, the first."""
    p = body.get("prompt")
    if p is None:
        raise ApiError(400, "prompt: field required", "prompt")
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        return p
    if isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return tuple(p)
    raise ApiError(400, "prompt: must be a string, a list of token ids, or a list of either",
                   "prompt")


def chat_key(body: dict) -> Key:
    """Roles and contents in order: a shared system prompt and earlier turns form the prefix."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "messages: must be a non-empty list of messages", "messages")
    parts = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages.{i}: must be an object with role and content",
                           "messages")
        parts.append(f"<|{m.get('role')}|>{_text(m.get('content'))}")
    return "\n".join(parts)


def _text(content) -> str:
    if isinstance(content, list):      # content parts: only the text ones
        return "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def _sse_error(error: ApiError, clean: bool) -> bytes:
    # clean: the bytes sent so far end an event; else close the cut one first
    head = b"" if clean else b"\n\n"
    return head + f"data: {json.dumps(error.body())}\n\ndata: [DONE]\n\n".encode()


class _StreamThrough(StreamingResponse):
    """An upstream SSE answer passed through as its bytes arrive; releases its ticket and
    closes the upstream response however it ends (done, failed, client gone, never started)."""

    def __init__(self, upstream: httpx.Response, ticket: Ticket, pool: ReplicaPool) -> None:
        self.upstream, self.ticket, self.pool = upstream, ticket, pool
        super().__init__(self._pump(), status_code=upstream.status_code, media_type=_SSE,
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _pump(self):
        it, tail = self.upstream.aiter_raw().__aiter__(), b"\n\n"
        while True:
            try:
                chunk = await or_killed(it.__anext__(), self.ticket)
            except StopAsyncIteration:
                return
            except (ReplicaDown, httpx.HTTPError) as e:
                err = _upstream_error(e, self.pool, self.ticket)
                yield _sse_error(err, tail == b"\n\n")
                return
            tail = (tail + chunk)[-2:]
            yield chunk

    async def __call__(self, scope, receive, send):
        try:
            await until_disconnect(receive, super().__call__(scope, receive, send))
        finally:
            await self.upstream.aclose()
            self.pool.release(self.ticket)


def _upstream_error(e: Exception, pool: ReplicaPool, ticket: Ticket) -> ApiError:
    """The error to answer for e; a replica that broke the connection is taken out."""
    url = pool.urls[ticket.replica]
    pool.metrics.errors.labels(url).inc()
    if isinstance(e, ReplicaDown):
        return e.error
    if isinstance(e, httpx.TimeoutException):
        return ApiError(504, f"the replica did not answer in time ({type(e).__name__})", None,
                        type="server_error")
    why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    pool.take_out(ticket.replica, why)
    return ApiError(502, f"the replica failed ({why})", None, type="server_error")


class Router:
    """The proxying half of the app; `client` exists while the app runs (see lifespan)."""

    def __init__(self, pool: ReplicaPool, backend_api_key: str | None,
                 max_body_bytes: int) -> None:
        self.pool, self.max_body_bytes = pool, max_body_bytes
        self.headers = {"Content-Type": "application/json"}
        if backend_api_key:
            self.headers["Authorization"] = f"Bearer {backend_api_key}"
        self.client: httpx.AsyncClient | None = None

    async def proxy(self, request: Request, path: str, key_of) -> Response:
        body = await read_json(request, self.max_body_bytes)
        ticket = self.pool.acquire(key_of(body))       # after every 4xx check
        up, handed_off = None, False
        try:
            up = await until_disconnect(request.receive,
                                        or_killed(self._open(ticket, path, body), ticket))
            if up is None:      # the client is gone; nobody reads this
                return Response(status_code=499)
            if up.status_code == 200 and up.headers.get("content-type", "").startswith(_SSE):
                handed_off = True       # the stream closes it and releases the ticket
                return _StreamThrough(up, ticket, self.pool)
            content = await until_disconnect(request.receive, or_killed(up.aread(), ticket))
            if content is None:
                return Response(status_code=499)
            return Response(content, status_code=up.status_code,
                            media_type=up.headers.get("content-type"))
        except (ReplicaDown, httpx.HTTPError) as e:
            return error_response(_upstream_error(e, self.pool, ticket))
        finally:
            if not handed_off:
                if up is not None:
                    await up.aclose()
                self.pool.release(ticket)

    async def _open(self, ticket: Ticket, path: str, body: dict) -> httpx.Response:
        url = self.pool.urls[ticket.replica] + path
        req = self.client.build_request("POST", url, headers=self.headers,
                                        content=json.dumps(body, ensure_ascii=False).encode())
        return await self.client.send(req, stream=True)

    async def models(self) -> Response:
        for url in self.pool.healthy_urls():
            try:
                r = await self.client.get(url + "/v1/models", headers=self.headers)
            except httpx.HTTPError:
                continue        # the health checks decide about the replica
            return Response(r.content, status_code=r.status_code,
                            media_type=r.headers.get("content-type"))
        raise ApiError(503, "no healthy replica answered /v1/models", None, type="server_error")


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return error_response(e)

    @app.exception_handler(ClientGone)
    async def _client_gone(request, e: ClientGone):
        return Response(status_code=499)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        r = error_response(ApiError(e.status_code, str(e.detail), None))
        r.headers.update(e.headers or {})
        return r


def build_router_app(backends: list[str], policy: str = "prefix", *, api_key: str | None = None,
                     backend_api_key: str | None | object = SAME_KEY,
                     max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                     health_check_interval: float = 5.0, health_check_timeout: float = 2.0,
                     health_failure_threshold: int = 2, backend_timeout: float = 600.0,
                     public_metrics: bool = False, policy_kw: dict | None = None) -> FastAPI:
    """backend_api_key: sent to the replicas (by default the api_key; None: no key).
    backend_timeout: seconds to connect, and between bytes of an answer."""
    from kvflow import __version__
    pool = ReplicaPool(backends, policy, failure_threshold=health_failure_threshold,
                       **(policy_kw or {}))
    router = Router(pool, api_key if backend_api_key is SAME_KEY else backend_api_key,
                    max_body_bytes)
    drain = Drain()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
        timeout = httpx.Timeout(backend_timeout, connect=min(backend_timeout, 10.0))
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            router.client = client
            tasks = [asyncio.create_task(health_loop(pool, client, health_check_interval,
                                                     health_check_timeout)),
                     asyncio.create_task(_end_all_on(drain, pool))]
            try:
                yield
            finally:
                for t in tasks:
                    t.cancel()

    app = FastAPI(title="kvflow router", version=__version__, lifespan=lifespan)
    app.state.pool, app.state.router, app.state.drain = pool, router, drain
    public = frozenset({"/health", "/metrics"} if public_metrics else {"/health"})
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes,
                       public_paths=public)
    _install_error_handlers(app)
    _add_routes(app, router, pool)
    return app


def _add_routes(app: FastAPI, router: Router, pool: ReplicaPool) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request):
        return await router.proxy(request, "/v1/completions", completion_key)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await router.proxy(request, "/v1/chat/completions", chat_key)

    @app.get("/v1/models")
    async def models():
        return await router.models()

    @app.get("/health")
    async def health():
        if not pool.healthy_urls():
            raise ApiError(503, "no healthy replica", None, type="server_error")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(pool.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version():
        from kvflow import __version__
        return JSONResponse({"version": __version__})


async def _end_all_on(drain: Drain, pool: ReplicaPool) -> None:
    """At the end of the shutdown grace period, what still runs ends with a 503 (or, streaming,
    an error event) instead of being cut."""
    await drain.expired.wait()
    err = ApiError(503, "the router is shutting down", None, type="server_error")
    for r in range(len(pool.urls)):
        pool.kill_all(r, err)
