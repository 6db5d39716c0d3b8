"""The OpenAI-compatible HTTP server: FastAPI routes over AsyncLLM, errors as OpenAI error objects.

`build_app(async_llm, served_model_name, api_key=None)` returns the ASGI app; `ServerThread` runs
it with uvicorn on a background thread (tests, `kvflow bench serve --self-test`); `kvflow serve`
(kvflow/server/cli.py) runs it in the foreground.

Bad input never reaches the engine as an exception: bodies are read here with a size limit (413),
parsed (400 on malformed JSON), validated strictly (400 naming the field), checked against the
model (404) and the context length (400); ValueErrors of the engine's add_request become 400s. A
client that goes away, streaming or not, gets its requests aborted (see _until_disconnect).
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import socket
import threading
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvflow.engine.async_llm import AsyncLLM, EngineDeadError
from kvflow.server.metrics import PrometheusStatLogger
from kvflow.server.protocol import (ApiError, ChatCompletionRequest, CompletionRequest,
                                    DetokenizeRequest, TokenizeRequest)
from kvflow.server.serving import OpenAIServing, SSEStream

DEFAULT_MAX_BODY_BYTES = 1 << 20
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "tuple"}


def _error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


class _Guard:
    """Pure ASGI middleware: API key on /v1 routes (401) and a declared body too large (413)."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            err = None
            headers = dict(scope["headers"])
            if self.expected is not None and scope["path"].startswith("/v1"):
                got = headers.get(b"authorization", b"")
                if not hmac.compare_digest(got, self.expected):
                    err = ApiError(401, "Incorrect or missing API key: send 'Authorization: "
                                        "Bearer <key>'", None, code="invalid_api_key")
            length = headers.get(b"content-length")
            if err is None and length is not None:
                try:
                    too_big = int(length) > self.max_body_bytes
                except ValueError:
                    too_big = False
                if too_big:
                    err = ApiError(413, f"the request body is {int(length)} bytes; the limit is "
                                        f"{self.max_body_bytes}", None, code="request_too_large")
            if err is not None:
                await _error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _read_json(request: Request, limit: int) -> dict:
    body, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
            raise ApiError(413, f"the request body exceeds the limit of {limit} bytes", None,
                           code="request_too_large")
        body.append(chunk)
    try:
        obj = json.loads(b"".join(body))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"malformed JSON body: {e}", None) from None
    if not isinstance(obj, dict):
        raise ApiError(400, f"the body must be a JSON object, got {type(obj).__name__}", None)
    return obj


def _validate(model: type[BaseModel], obj: dict):
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        errs = e.errors()
        first = errs[0]
        param = str(first["loc"][0]) if first["loc"] else None
        # Drop pydantic's union-member tags ('str', 'list[int]', ...) from the location.
        where = ".".join(str(x) for x in first["loc"] if isinstance(x, int) or (
            x not in _TYPE_TAGS and "[" not in x and "-" not in x))
        got = repr(first.get("input"))[:80] if first["type"] != "missing" else None
        msg = f"{where}: {first['msg']}" + (f" (got {got})" if got else "")
        raise ApiError(400, msg, param) from None


async def _wait_disconnect(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _until_disconnect(receive, coro):
    """Run coro, cancelling it if the client disconnects first (its streams then abort)."""
    task = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()


class _SSEResponse(StreamingResponse):
    """text/event-stream that aborts its requests however it ends (done, error, disconnect,
    or never started)."""

    def __init__(self, stream: SSEStream) -> None:
        super().__init__(stream.body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._stream = stream

    async def __call__(self, scope, receive, send):
        try:
            await _until_disconnect(receive, super().__call__(scope, receive, send))
        finally:
            self._stream.close()


def build_app(async_llm: AsyncLLM, served_model_name: str | list[str], api_key: str | None = None,
              *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, model_path: str | None = None,
              ) -> FastAPI:
    from kvflow import __version__
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    if not names:
        raise ValueError("served_model_name is empty")
    app = FastAPI(title="kvflow OpenAI-compatible server", version=__version__)
    serving = OpenAIServing(async_llm, names)
    metrics = PrometheusStatLogger(names[0])
    async_llm.add_stat_logger(metrics)
    app.state.async_llm, app.state.serving, app.state.metrics = async_llm, serving, metrics
    app.add_middleware(_Guard, api_key=api_key, max_body_bytes=max_body_bytes)
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return _error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        return _error_response(ApiError(400, f"{'.'.join(loc)}: {first['msg']}",
                                        loc[0] if loc else None))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        return _error_response(ApiError(e.status_code, str(e.detail), None,
                                        type="invalid_request_error" if e.status_code < 500
                                        else "server_error"))

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request, e: EngineDeadError):
        return _error_response(ApiError(503, str(e), None, type="server_error"))

    @app.exception_handler(Exception)
    async def _internal_error(request, e: Exception):
        return _error_response(ApiError(500, f"internal error: {e!r}", None, type="server_error"))

    @app.get("/health")
    async def health():
        if not async_llm.is_running:
            return _error_response(ApiError(503, "the engine is not running", None,
                                            type="server_error"))
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": n, "object": "model", "created": created, "owned_by": "kvflow",
             "root": model_path or n, "parent": None,
             "max_model_len": serving.max_model_len} for n in names]}

    async def _generate(request: Request, model: type[BaseModel], handler):
        req = _validate(model, await _read_json(request, max_body_bytes))
        result = await _until_disconnect(request.receive, handler(req))
        if result is None:      # the client is gone; nobody reads this
            return Response(status_code=499)
        if isinstance(result, SSEStream):
            return _SSEResponse(result)
        return JSONResponse(result)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(request, CompletionRequest, serving.create_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(request, ChatCompletionRequest, serving.create_chat_completion)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = _validate(TokenizeRequest, await _read_json(request, max_body_bytes))
        serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "give exactly one of prompt or messages", "prompt")
        if req.prompt is not None:
            ids = serving.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            ids = serving.render_chat(req.messages, req.add_generation_prompt)[1]
        return {"count": len(ids), "max_model_len": serving.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = _validate(DetokenizeRequest, await _read_json(request, max_body_bytes))
        serving.check_model(req.model)
        bad = next((t for t in req.tokens if not 0 <= t < serving.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is not in [0, {serving.vocab_size})", "tokens")
        return {"prompt": serving.tokenizer.decode(req.tokens)}

    return app


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1 (a free port by default) from a daemon thread."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning") -> None:
        import uvicorn
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level,
                                                    timeout_graceful_shutdown=2))
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
