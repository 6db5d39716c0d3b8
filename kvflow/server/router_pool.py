"""The router's replicas: their health, their in-flight requests, and the routing policy.

Each proxied request holds a Ticket from `ReplicaPool.acquire` until it has ended, however it
ends; `release` tells the policy (so its load counts stay true). A replica taken out (failed
health checks, a connection error, or the router shutting down) kills its tickets: the proxy,
which races every upstream read against its ticket, answers the client with an error at once
instead of waiting on a replica that may never answer.
"""
from __future__ import annotations

import asyncio
import logging

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge

from kvflow.core.routing import Key, NoReplicaError, make_policy
from kvflow.server.protocol import ApiError

logger = logging.getLogger("uvicorn.error")


class Ticket:
    """One proxied request to one replica; `killed` is set (with the error to answer) when the
    router gives up on it."""

    def __init__(self, replica: int) -> None:
        self.replica = replica
        self.killed = asyncio.Event()
        self.error: ApiError | None = None

    def kill(self, error: ApiError) -> None:
        if not self.killed.is_set():
            self.error = error
            self.killed.set()


class ReplicaDown(Exception):
    """The request's replica was taken out (or the router is stopping) while it ran."""

    def __init__(self, error: ApiError) -> None:
        super().__init__(error.message)
        self.error = error


async def or_killed(aw, ticket: Ticket):
    """aw's result, unless ticket is killed first: then aw is cancelled and ReplicaDown raised."""
    task = asyncio.ensure_future(aw)
    stop = asyncio.ensure_future(ticket.killed.wait())
    try:
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ReplicaDown(ticket.error)
    finally:
        stop.cancel()
        if not task.done():
            task.cancel()
            try:
                await task
            except BaseException:       # noqa: BLE001  (whatever a cancelled read raises)
                pass


class _Metrics:
    def __init__(self, urls: list[str], policy: str) -> None:
        self.registry = r = CollectorRegistry()
        self.routed = Counter("kvflow_router_requests", "Requests routed, per replica and policy.",
                              ["replica", "policy"], registry=r)
        self.errors = Counter("kvflow_router_upstream_errors",
                              "Requests that ended with an error of the router (502/503/504), "
                              "per replica.", ["replica"], registry=r)
        self.healthy = Gauge("kvflow_router_replica_healthy", "1 if the replica takes requests.",
                             ["replica"], registry=r)
        self.in_flight = Gauge("kvflow_router_requests_in_flight",
                               "Requests being proxied, per replica.", ["replica"], registry=r)
        for u in urls:
            self.routed.labels(u, policy)
            self.errors.labels(u)
            self.healthy.labels(u).set(1)
            self.in_flight.labels(u).set(0)


class ReplicaPool:
    def __init__(self, urls: list[str], policy: str, *, failure_threshold: int = 2,
                 **policy_kw) -> None:
        if not urls:
            raise ValueError("no backends given")
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        self.urls = [u.rstrip("/") for u in urls]
        self.policy = make_policy(policy, len(urls), **policy_kw)
        self.failure_threshold = failure_threshold
        self.failures = [0] * len(urls)
        self.tickets: list[set[Ticket]] = [set() for _ in urls]
        self.metrics = _Metrics(self.urls, policy)

    def acquire(self, key: Key) -> Ticket:
        try:
            r = self.policy.choose(key)
        except NoReplicaError:
            raise ApiError(503, "no healthy replica to send the request to", None,
                           type="server_error") from None
        t = Ticket(r)
        self.tickets[r].add(t)
        self.metrics.routed.labels(self.urls[r], self.policy.name).inc()
        self.metrics.in_flight.labels(self.urls[r]).inc()
        return t

    def release(self, t: Ticket) -> None:
        """Idempotent: the proxy may reach its cleanup twice (a stream and its response)."""
        if t in self.tickets[t.replica]:
            self.tickets[t.replica].discard(t)
            self.policy.finish(t.replica)
            self.metrics.in_flight.labels(self.urls[t.replica]).dec()

    def healthy_urls(self) -> list[str]:
        return [u for u, ok in zip(self.urls, self.policy.healthy) if ok]

    def take_out(self, r: int, why: str) -> None:
        if self.policy.healthy[r]:
            logger.warning("router: taking replica %s out: %s", self.urls[r], why)
            self.policy.set_healthy(r, False)
            self.metrics.healthy.labels(self.urls[r]).set(0)
        self.kill_all(r, ApiError(502, f"the replica the request was sent to failed ({why})",
                                  None, type="server_error"))

    def kill_all(self, r: int, error: ApiError) -> None:
        for t in list(self.tickets[r]):
            t.kill(error)

    def put_back(self, r: int) -> None:
        if not self.policy.healthy[r]:
            logger.warning("router: replica %s answers again; putting it back", self.urls[r])
            self.policy.set_healthy(r, True)
            self.metrics.healthy.labels(self.urls[r]).set(1)

    def record_check(self, r: int, ok: bool, why: str = "") -> None:
        if ok:
            self.failures[r] = 0
            self.put_back(r)
            return
        self.failures[r] += 1
        if self.failures[r] >= self.failure_threshold:
            self.take_out(r, f"{self.failures[r]} failed health checks, the last: {why}")


async def check_health(pool: ReplicaPool, client: httpx.AsyncClient, timeout: float) -> None:
    """One round: GET every replica's /health at once."""
    async def one(r: int) -> None:
        try:
            resp = await client.get(pool.urls[r] + "/health", timeout=timeout)
            ok, why = resp.status_code == 200, f"/health answered {resp.status_code}"
        except httpx.HTTPError as e:
            ok, why = False, f"/health: {type(e).__name__} {e}".strip()
        pool.record_check(r, ok, why)
    await asyncio.gather(*(one(r) for r in range(len(pool.urls))))


async def health_loop(pool: ReplicaPool, client: httpx.AsyncClient, interval: float,
                      timeout: float) -> None:
    while True:
        try:
            await check_health(pool, client, timeout)
        except Exception:       # a bug here must not stop the checks for good
            logger.exception("router: health check failed")
        await asyncio.sleep(interval)
