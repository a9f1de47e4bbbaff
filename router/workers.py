"""The workers behind the router: their health, and the requests in flight to each.

Every worker has a probe loop that GETs its /health every interval. It is down after one probe
that could not connect (refused, reset) or two failed ones in a row (timeout, non-200), and up
after one 200. Probes use fresh connections (their own session, force_close), so a refused probe
means a dead worker, never a pooled connection the worker had closed.

Going down fails every request in flight to the worker at once: each request registers its
handler task (InFlight), which is cancelled and raises WorkerDown instead. A killed worker also
breaks its streams' connections, and the proxy asks for a probe at once (suspect), so all of its
requests fail within a probe's round trip; a hung one fails them after two probe timeouts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from types import TracebackType
from typing import Sequence

import aiohttp

from router.errors import APIError, worker_unavailable
from router.policy import Load

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "both")
_SOFT_FAILURES_TO_DOWN = 2


class WorkerDown(Exception):
    """The worker of a request in flight was marked down."""

    def __init__(self, url: str, reason: str):
        super().__init__(f"{url}: {reason}")
        self.url = url
        self.reason = reason

    def api_error(self) -> APIError:
        return worker_unavailable(self.url, f"is unhealthy ({self.reason})", 503)


class Worker:
    """One worker server: its configured role, health, load and requests in flight."""

    def __init__(self, url: str, role: str):
        if role not in ROLES:
            raise ValueError(f"unknown worker role {role!r}")
        self.url = url
        self.role = role
        self.healthy = False  # until its first 200
        self.load = Load()
        self._failures = 0
        self._in_flight: set[InFlight] = set()
        self._wake = asyncio.Event()

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def probe_result(self, ok: bool, *, hard: bool = False, detail: str = "") -> None:
        """Applies one probe's outcome: ok, a hard failure (no connection) or a soft one."""
        if ok:
            if not self.healthy:
                log.info("worker %s (%s) is up", self.url, self.role)
            self._failures = 0
            self.healthy = True
            return
        self._failures += 1
        if hard or self._failures >= _SOFT_FAILURES_TO_DOWN:
            self.mark_down(detail)

    def mark_down(self, reason: str) -> None:
        """No new traffic, and every request in flight to it fails now."""
        if self.healthy:
            log.warning("worker %s (%s) is down: %s", self.url, self.role, reason)
        self.healthy = False
        for flight in list(self._in_flight):
            flight.fail(WorkerDown(self.url, reason))

    def suspect(self) -> None:
        """A request's connection broke: probe now rather than at the next interval."""
        self._wake.set()

    async def probe(self, session: aiohttp.ClientSession, timeout: float) -> None:
        try:
            async with asyncio.timeout(timeout):
                async with session.get(self.url + "/health") as resp:
                    body = await resp.read()
        except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError, ConnectionError) as e:
            self.probe_result(False, hard=True, detail=f"cannot connect: {e}")
            return
        except TimeoutError:
            self.probe_result(False, detail=f"/health timed out after {timeout:g}s")
            return
        except aiohttp.ClientError as e:
            self.probe_result(False, detail=f"/health failed: {e!r}")
            return
        if resp.status != 200:
            self.probe_result(False, detail=f"/health answered {resp.status}")
            return
        if not self.healthy:
            self._check_role(body)
        self.probe_result(True)

    def _check_role(self, health: bytes) -> None:
        with contextlib.suppress(ValueError, AttributeError):
            reported = json.loads(health).get("role")
            if reported is not None and reported != self.role:
                log.warning("worker %s was given as %s but reports role %r", self.url, self.role, reported)

    async def watch(self, session: aiohttp.ClientSession, interval: float, timeout: float) -> None:
        """Probes forever: every interval, or at once when suspected."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self._wake.wait()
            self._wake.clear()
            await self.probe(session, timeout)


class InFlight:
    """One request to a worker, for the with-block that sends it and reads the answer.

    Adds its load on entry (refuses a worker that is down), drops its queued prompt tokens at the
    first byte (answering()), removes the rest on exit. When the worker goes down meanwhile, the
    block's task is cancelled and the block raises WorkerDown.
    """

    def __init__(self, worker: Worker, tokens: int):
        self.worker = worker
        self._tokens = tokens
        self._answered = False
        self._task = asyncio.current_task()
        self._failure: WorkerDown | None = None

    def __enter__(self) -> InFlight:
        if not self.worker.healthy:
            raise WorkerDown(self.worker.url, "marked down before the request was sent")
        self.worker._in_flight.add(self)
        self.worker.load.sent(self._tokens)
        return self

    def answering(self) -> None:
        if not self._answered:
            self._answered = True
            self.worker.load.answering(self._tokens)

    def fail(self, failure: WorkerDown) -> None:
        # The task itself reporting its worker down (it is handling that error already) is not cancelled.
        if self._failure is None and self._task is not asyncio.current_task():
            self._failure = failure
            self._task.cancel()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.worker._in_flight.discard(self)
        self.worker.load.finished(self._tokens, self._answered)
        # Our cancellation becomes WorkerDown, unless someone else (a client disconnect) cancelled too.
        if self._failure is not None and exc_type is asyncio.CancelledError and self._task.uncancel() == 0:
            raise self._failure


class HealthMonitor:
    """The probe loops of all workers, on a session of their own."""

    def __init__(self, workers: Sequence[Worker], interval: float, timeout: float):
        self._workers = workers
        self._interval = interval
        self._timeout = timeout
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        """Probes every worker once (so the healthy ones take traffic at once), then keeps watching."""
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=0))
        await asyncio.gather(*(w.probe(self._session, self._timeout) for w in self._workers))
        self._tasks = [asyncio.create_task(w.watch(self._session, self._interval, self._timeout))
                       for w in self._workers]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
