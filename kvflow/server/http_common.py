"""What `kvflow serve` and `kvflow router` share over HTTP: their flags (add_http_args) and
defaults, the request guard (API key 401, body size 413), the shutdown grace period (Drain), the
client-disconnect watcher (until_disconnect) and the error response.

The bottom of kvflow/server: it imports no other module of the package but protocol.py. Building
the command-line parser imports this module, so starlette and pydantic (protocol.py) load on first
use, not at import: `kvflow --help` stays argparse only.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
from typing import TYPE_CHECKING

from kvflow import envs

if TYPE_CHECKING:
    from starlette.responses import JSONResponse

    from kvflow.server.protocol import ApiError

# Seconds.
DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_BODY_TIMEOUT = 30.0
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
DEFAULT_MAX_BODY_BYTES = 1 << 20
# Set by `kvflow serve --data-parallel-size N` to its pid in each replica's environment.
PARENT_PID_ENV = "KVFLOW_EXIT_WITH_PARENT"


def add_http_args(p) -> None:
    """The flags `kvflow serve` and `kvflow router` share: address, auth, limits, timeouts."""
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=envs.KVFLOW_API_KEY,
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(default: $KVFLOW_API_KEY)")
    p.add_argument("--metrics-no-auth", action="store_true",
                   help="with --api-key, leave /metrics open (for Prometheus scrapers)")
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="larger bodies get a 413 (default: 1 MiB)")
    p.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT,
                   help="seconds a client has to send a request's line and headers, from its "
                        "first byte; a late one gets a 408 and is disconnected "
                        f"(default: {DEFAULT_HEADER_TIMEOUT:g})")
    p.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT,
                   help="seconds a client has to send a request's body, after its headers "
                        f"(default: {DEFAULT_BODY_TIMEOUT:g})")
    p.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT,
                   help="on SIGTERM/Ctrl-C, seconds in-flight requests have to finish before "
                        "they end with an error (streams: an error event) "
                        f"(default: {DEFAULT_SHUTDOWN_TIMEOUT:g})")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])


def error_response(e: ApiError) -> JSONResponse:
    from starlette.responses import JSONResponse        # not at import: see the module docstring
    return JSONResponse(e.body(), status_code=e.status)


class Guard:
    """Pure ASGI middleware: the API key on every route but /health (and /metrics if made
    public) (401), and a declared body too large (413)."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int,
                 public_paths: frozenset[str]) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.public_paths = public_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            from kvflow.server.protocol import ApiError     # not at import: pydantic
            err = None
            headers = dict(scope["headers"])
            if self.expected is not None and scope["path"] not in self.public_paths:
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
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class Drain:
    """The shutdown grace period: `expired` is set `grace` seconds after begin(); requests still
    running then end with a 503, streams with an error event."""

    def __init__(self) -> None:
        self.expired = asyncio.Event()

    def begin(self, grace: float) -> None:
        asyncio.get_running_loop().call_later(max(grace, 0.0), self.expired.set)


def shutting_down() -> ApiError:
    from kvflow.server.protocol import ApiError         # not at import: pydantic
    return ApiError(503, "the server is shutting down", None, type="server_error")


async def _wait_disconnect(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(receive, coro, expired: asyncio.Event | None = None):
    """Run coro, cancelling it if the client disconnects first (its streams then abort; returns
    None) or the shutdown grace period runs out (raises a 503)."""
    task = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(_wait_disconnect(receive))
    stop = asyncio.ensure_future(expired.wait() if expired is not None else asyncio.Future())
    try:
        done, _ = await asyncio.wait({task, watch, stop}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if stop in done and watch not in done:
            raise shutting_down()
        return None
    finally:
        watch.cancel()
        stop.cancel()
        if not task.done():
            task.cancel()
