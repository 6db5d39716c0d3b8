"""uvicorn as kvflow runs it: deadlines for reading requests, and a graceful shutdown.

uvicorn has a keep-alive timeout but none for reading a request, so a client that trickles its
headers or body one byte at a time holds a connection forever (a few hundred such clients exhaust
the server). `TimedH11Protocol` gives each request `header_timeout` seconds from its first byte
(or from the connection) to finish its request line and headers, and `body_timeout` seconds from
then to finish its body; a late client gets a 408 and its connection is closed.

`KvflowServer.shutdown` starts the app's grace period (see http_common.Drain) before uvicorn stops
accepting and waits for the in-flight requests; uvicorn's own graceful timeout is a backstop a few
seconds after the grace period, when every stream has already ended with an error event.
"""
from __future__ import annotations

import json
import logging

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvflow.server.http_common import (DEFAULT_BODY_TIMEOUT, DEFAULT_HEADER_TIMEOUT,
                                       DEFAULT_SHUTDOWN_TIMEOUT)

_BACKSTOP_S = 5.0       # uvicorn cancels what is left this long after the grace period

logger = logging.getLogger("uvicorn.error")


def _timeout_response(what: str, seconds: float) -> bytes:
    body = json.dumps({"error": {"message": f"the request {what} did not arrive within "
                                            f"{seconds:g} s", "type": "invalid_request_error",
                                 "param": None, "code": 408}}).encode()
    head = (f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
    return head + body


class TimedH11Protocol(H11Protocol):
    """H11Protocol with a deadline per phase of reading a request (set on a subclass by
    make_server). A phase's timer starts once: trickled bytes do not extend it."""

    header_timeout = DEFAULT_HEADER_TIMEOUT
    body_timeout = DEFAULT_BODY_TIMEOUT

    def connection_made(self, transport) -> None:
        self._phase, self._timer = None, None
        super().connection_made(transport)
        self._follow_phase(fresh=True)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow_phase()

    def connection_lost(self, exc) -> None:
        self._cancel_timer()
        super().connection_lost(exc)

    def _follow_phase(self, fresh: bool = False) -> None:
        # Reading headers: a fresh connection, or bytes of a next request; the body: SEND_BODY.
        # An idle keep-alive connection (IDLE, nothing buffered) is uvicorn's keep-alive timeout's.
        state = self.conn.their_state
        if state is h11.IDLE:
            phase = "headers" if fresh or self.conn.trailing_data[0] else None
        else:
            phase = "body" if state is h11.SEND_BODY else None
        if phase == self._phase:
            return
        self._cancel_timer()
        self._phase = phase
        if phase is not None and not self.transport.is_closing():
            seconds = self.header_timeout if phase == "headers" else self.body_timeout
            self._timer = self.loop.call_later(seconds, self._expire, phase, seconds)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self, phase: str, seconds: float) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        logger.info("closing a connection from %s: its request %s did not arrive within %g s",
                    self.client, phase, seconds)
        answered = phase == "body" and self.cycle is not None and self.cycle.response_started
        if phase == "body" and self.cycle is not None:
            self.cycle.disconnected = True      # the app's reads end; its writes are dropped
            self.cycle.message_event.set()
        if not answered:
            self.transport.write(_timeout_response(phase, seconds))
        self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()      # may start a pipelined request
        self._follow_phase()


class KvflowServer(uvicorn.Server):
    """uvicorn.Server whose shutdown first starts the app's grace period (app.state.drain)."""

    def __init__(self, config: uvicorn.Config, drain, grace: float) -> None:
        super().__init__(config)
        self.drain, self.grace = drain, grace

    async def shutdown(self, sockets=None) -> None:
        if self.drain is not None:
            self.drain.begin(self.grace)
        await super().shutdown(sockets)


def make_server(app, *, host: str = "127.0.0.1", port: int = 0, log_level: str = "info",
                header_timeout: float = DEFAULT_HEADER_TIMEOUT,
                body_timeout: float = DEFAULT_BODY_TIMEOUT,
                shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> KvflowServer:
    protocol = type("TimedH11Protocol", (TimedH11Protocol,),
                    {"header_timeout": header_timeout, "body_timeout": body_timeout})
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol,
                            timeout_graceful_shutdown=shutdown_timeout + _BACKSTOP_S)
    drain = getattr(getattr(app, "state", None), "drain", None)
    return KvflowServer(config, drain, shutdown_timeout)
