"""The OpenAI-compatible HTTP server: FastAPI routes over AsyncLLM, errors as OpenAI error objects.

`build_app(async_llm, served_model_name, api_key=None)` returns the ASGI app; `ServerThread` runs
it with uvicorn on a background thread (tests, `kvflow bench serve --self-test`); `kvflow serve`
(kvflow/server/cli.py) runs it in the foreground.

Bad input never reaches the engine as an exception: bodies are read, parsed and validated in one
place (bodies.py: 415, 413 or a 400 naming the field), checked against the model (404) and the
context length (400); ValueErrors of the engine's add_request become 400s. Error bodies are
always encodable. A 500 means a bug in kvflow.

A client that goes away, streaming or not, gets its requests aborted (see
http_common.until_disconnect); one that goes away mid-body is logged in one line. On shutdown (see
http_server.KvflowServer) running requests get a grace period (http_common.Drain), then end with a
503 or, streaming, an error event.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvflow.engine.async_llm import AsyncLLM, EngineDeadError
from kvflow.server.bodies import ClientGone, read_json, validate_body
from kvflow.server.http_common import (DEFAULT_MAX_BODY_BYTES, Drain, Guard, error_response,
                                       shutting_down, until_disconnect)
from kvflow.server.http_server import make_server
from kvflow.server.metrics import PrometheusStatLogger
from kvflow.server.protocol import (ApiError, ChatCompletionRequest, CompletionRequest,
                                    DetokenizeRequest, ErrorResponse, TokenizeRequest)
from kvflow.server.serving import OpenAIServing
from kvflow.server.sse import SSEStream

logger = logging.getLogger("uvicorn.error")


async def _until_expired(body, expired: asyncio.Event):
    """body's chunks until the shutdown grace period runs out; then an error event and [DONE]
    instead of a silent cut (cancelling the body's generator aborts its requests)."""
    it = body.__aiter__()
    stop = asyncio.ensure_future(expired.wait())
    try:
        while True:
            nxt = asyncio.ensure_future(it.__anext__())
            await asyncio.wait({nxt, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not nxt.done():
                nxt.cancel()
                with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                    await nxt
                yield f"data: {json.dumps(shutting_down().body())}\n\n"
                yield "data: [DONE]\n\n"
                return
            try:
                chunk = nxt.result()
            except StopAsyncIteration:
                return
            yield chunk
    finally:
        stop.cancel()


class _SSEResponse(StreamingResponse):
    """text/event-stream that aborts its requests however it ends (done, error, disconnect,
    or never started)."""

    def __init__(self, stream: SSEStream, expired: asyncio.Event) -> None:
        super().__init__(_until_expired(stream.body, expired), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._stream = stream

    async def __call__(self, scope, receive, send):
        try:
            await until_disconnect(receive, super().__call__(scope, receive, send))
        finally:
            self._stream.close()


_BODY_MODELS = (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)
_ERRORS = {status: {"model": ErrorResponse, "description": what} for status, what in (
    (400, "Invalid request"), (401, "Missing or wrong API key"), (404, "Unknown model"),
    (413, "Body too large"), (415, "Body not sent as application/json"),
    (503, "Engine not running, or the server is shutting down"))}
_GENERATED = {200: {"description": "The answer as JSON, or with stream=true server-sent events "
                                   "(data: <chunk JSON> ... data: [DONE])",
                    "content": {"application/json": {"schema": {"type": "object"}},
                                "text/event-stream": {"schema": {"type": "string"}}}}, **_ERRORS}


def _json_body(model: type[BaseModel]) -> dict:
    """openapi_extra declaring model as the JSON request body (the route reads it itself)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def _with_body_schemas(app: FastAPI):
    """app.openapi, plus the request models' schemas (routes declare them by $ref only)."""
    base = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = base()
            _, top = models_json_schema([(m, "validation") for m in _BODY_MODELS],
                                        ref_template="#/components/schemas/{model}")
            schema.setdefault("components", {}).setdefault("schemas", {}).update(top["$defs"])
            app.openapi_schema = schema
        return app.openapi_schema
    return openapi


def build_app(async_llm: AsyncLLM, served_model_name: str | list[str], api_key: str | None = None,
              *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, model_path: str | None = None,
              public_metrics: bool = False) -> FastAPI:
    """public_metrics: /metrics needs no API key (for Prometheus scrapers)."""
    from kvflow import __version__
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    if not names:
        raise ValueError("served_model_name is empty")
    app = FastAPI(title="kvflow OpenAI-compatible server", version=__version__)
    app.openapi = _with_body_schemas(app)
    serving = OpenAIServing(async_llm, names)
    metrics = PrometheusStatLogger(names[0])
    async_llm.add_stat_logger(metrics)
    app.state.async_llm, app.state.serving, app.state.metrics = async_llm, serving, metrics
    app.state.drain = drain = Drain()
    public = frozenset({"/health", "/metrics"} if public_metrics else {"/health"})
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes,
                       public_paths=public)
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return error_response(e)

    @app.exception_handler(ClientGone)
    async def _client_gone(request, e: ClientGone):
        # One line, not a traceback: nothing is wrong with the server. Nobody reads the 499.
        logger.info("%s went away before sending all of its %s %s body",
                    request.client, request.method, request.url.path)
        return Response(status_code=499)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        return error_response(ApiError(400, f"{'.'.join(loc)}: {first['msg']}",
                                        loc[0] if loc else None))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        # e.headers carries a 405's Allow header
        r = error_response(ApiError(e.status_code, str(e.detail), None,
                                     type="invalid_request_error" if e.status_code < 500
                                     else "server_error"))
        r.headers.update(e.headers or {})
        return r

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request, e: EngineDeadError):
        return error_response(ApiError(503, str(e), None, type="server_error"))

    @app.exception_handler(Exception)
    async def _internal_error(request, e: Exception):
        # A bug in kvflow (client input never gets here); uvicorn logs the traceback.
        return error_response(ApiError(500, f"internal error: {e!r}", None, type="server_error"))

    @app.get("/health", responses={503: _ERRORS[503]})
    async def health():
        if not async_llm.is_running:
            return error_response(ApiError(503, "the engine is not running", None,
                                            type="server_error"))
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text exposition format"}})
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": n, "object": "model", "created": created, "owned_by": "kvflow",
             "root": model_path or n, "parent": None,
             "max_model_len": serving.max_model_len} for n in names]}

    async def _generate(request: Request, model: type[BaseModel], handler):
        req = validate_body(model, await read_json(request, max_body_bytes))
        result = await until_disconnect(request.receive, handler(req), drain.expired)
        if result is None:      # the client is gone; nobody reads this
            return Response(status_code=499)
        if isinstance(result, SSEStream):
            return _SSEResponse(result, drain.expired)
        return JSONResponse(result)

    @app.post("/v1/completions", openapi_extra=_json_body(CompletionRequest),
              responses=_GENERATED)
    async def completions(request: Request):
        return await _generate(request, CompletionRequest, serving.create_completion)

    @app.post("/v1/chat/completions", openapi_extra=_json_body(ChatCompletionRequest),
              responses=_GENERATED)
    async def chat_completions(request: Request):
        return await _generate(request, ChatCompletionRequest, serving.create_chat_completion)

    @app.post("/tokenize", openapi_extra=_json_body(TokenizeRequest), responses=_ERRORS)
    async def tokenize(request: Request):
        req = validate_body(TokenizeRequest, await read_json(request, max_body_bytes))
        serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "give exactly one of prompt or messages", "prompt")
        # tokenizing (up to a megabyte) and templating leave the event loop: streams go on
        if req.prompt is not None:
            ids = await asyncio.to_thread(serving.tokenizer.encode, req.prompt,
                                          add_special_tokens=req.add_special_tokens)
        else:
            ids = (await asyncio.to_thread(serving.render_chat, req.messages,
                                           req.add_generation_prompt))[1]
        return {"count": len(ids), "max_model_len": serving.max_model_len, "tokens": ids}

    @app.post("/detokenize", openapi_extra=_json_body(DetokenizeRequest), responses=_ERRORS)
    async def detokenize(request: Request):
        req = validate_body(DetokenizeRequest, await read_json(request, max_body_bytes))
        serving.check_model(req.model)
        bad = next((t for t in req.tokens if not 0 <= t < serving.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is not in [0, {serving.vocab_size})", "tokens")
        return {"prompt": await asyncio.to_thread(serving.tokenizer.decode, req.tokens)}

    return app


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1 (a free port by default) from a daemon thread."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning", **server_kw) -> None:
        """server_kw: header_timeout, body_timeout, shutdown_timeout (see make_server)."""
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = make_server(app, log_level=log_level,
                                  **{"shutdown_timeout": 2.0, **server_kw})
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="kvflow-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the uvicorn server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
