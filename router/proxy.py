"""The proxied endpoints: choose a request's workers, prefill it remotely when that pays, forward it to
its decode worker and pass the answer through (whole, or event by event when it streams).

Disaggregation (vLLM's `kv_transfer_params`): the prefill worker runs the prompt with max_tokens 1
and answers the parameters its KV can be pulled with; the decode worker gets the client's own body
plus those parameters, pulls the KV and generates. A failed prefill fails no request: the decode
worker prefills locally, as it does for short prompts and for completions of several prompts (a
transfer carries one). A `both` replica serves the requests routed to it whole. The prefill worker
holds the KV until the decode worker releases it (imported or not); on every outcome but an import
the router releases it too (`_Hold`), so its pages are free at once rather than at the hold's expiry
even when the decode worker could not (a 404 then: released already), and also when the client
leaves while the prefill's answer is on its way (`_PrefillCall`).

The router never checks keys: Authorization and every x-* header go to the workers as they came.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from typing import Awaitable, Sequence

import aiohttp
from aiohttp import web

from router.errors import APIError, no_healthy_worker, worker_unavailable
from router.metrics import RouterMetrics
from router.policy import Policy, route_key
from router.workers import InFlight, Worker, WorkerDown

log = logging.getLogger(__name__)

SESSION_HEADER = "x-session-affinity"
TENANT_HEADER = "x-tenant-id"
PREFILL_HEADER = "x-infire-prefill-worker"
DECODE_HEADER = "x-infire-decode-worker"
KV_BYTES_HEADER = "x-infire-kv-bytes"
KV_SECONDS_HEADER = "x-infire-kv-seconds"
KV_TRANSFER_HEADER = "x-infire-kv-transfer"  # the decode worker's outcome: imported (and released) or failed
RELEASE_PATH = "/v1/kv_transfer/release"  # a prefill worker's (server/kv_handoff.py)
_RELEASE_HEADERS = ("authorization", TENANT_HEADER)  # a hold is released only for the tenant that made it
_RELEASE_TIMEOUT_S = 5.0  # past this, the hold is left to expire
_ABANDON_GRACE_S = 0.25  # how long a prefill whose client left may take to answer (its answer may be on its way)
DECODE_ROLES = ("decode", "both")
# What the prefill's one-token, one-choice run leaves out of the client's body (best_of == n is valid only
# with the client's n).
_PREFILL_DROPS = ("max_completion_tokens", "min_tokens", "stream_options", "best_of")
_DONE = b"data: [DONE]\n\n"


@dataclasses.dataclass
class RouterState:
    """What the handlers need; the session is opened at start-up."""

    workers: list[Worker]
    policy: Policy
    metrics: RouterMetrics
    disagg_min_tokens: int
    request_timeout: float
    session: aiohttp.ClientSession = dataclasses.field(init=False)
    releases: set[asyncio.Task] = dataclasses.field(default_factory=set)  # awaited at shut-down

    def healthy(self, roles: Sequence[str]) -> list[Worker]:
        return [w for w in self.workers if w.healthy and w.role in roles]


STATE = web.AppKey("router_state", RouterState)


class _ClientGone(Exception):
    """The client closed its connection while we wrote to it."""


async def completions(request: web.Request) -> web.StreamResponse:
    return await generate(request, "completions", "/v1/completions")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await generate(request, "chat", "/v1/chat/completions")


async def embeddings(request: web.Request) -> web.StreamResponse:
    """Workers started with `--runner pooling` serve them (and scores); prompts alone, never disaggregated."""
    return await generate(request, "embeddings", "/v1/embeddings")


async def score(request: web.Request) -> web.StreamResponse:
    return await generate(request, "score", request.path)


async def rerank(request: web.Request) -> web.StreamResponse:
    return await generate(request, "rerank", request.path)


async def models(request: web.Request) -> web.Response:
    """The first healthy worker's model list."""
    return await call_one(request, any_worker(request.app[STATE]), "GET", "/v1/models")


def any_worker(st: RouterState) -> Worker:
    """The first healthy worker: for what every worker answers alike."""
    pool = [w for w in st.workers if w.healthy]
    if not pool:
        raise _no_worker(st, None)
    return pool[0]


async def call_one(request: web.Request, worker: Worker, method: str, path: str,
                   data: bytes | None = None) -> web.Response:
    """One call to `worker`, its answer passed back whole."""
    st = request.app[STATE]
    try:
        with InFlight(worker, 0) as flight:
            async with asyncio.timeout(st.request_timeout):
                async with st.session.request(method, worker.url + path, data=data,
                                              headers=forward_headers(request)) as up:
                    flight.answering()
                    body = await up.read()
    except (WorkerDown, TimeoutError, aiohttp.ClientError) as e:
        raise _upstream_error(st, worker, e) from e
    return web.Response(status=up.status, body=body, headers=_response_headers(up, {}))


async def generate(request: web.Request, kind: str, path: str, *, owner: Worker | None = None) -> web.StreamResponse:
    """A generation request routed, maybe prefilled remotely, forwarded. `owner`: the worker it must go to
    while healthy (a Responses API continuation's, router/passthrough.py)."""
    st = request.app[STATE]
    raw = await request.read()
    body = _parse(raw)
    # The model (a LoRA adapter's name selects one) separates prompts too: adapters never share KV on a worker.
    headers = request.headers
    tenant = (f"{headers.get('Authorization', '')}\0{headers.get(TENANT_HEADER, '')}\0{body.get('model')}"
              f"\0{body.get('cache_salt')}")  # vLLM's cache_salt separates prefixes as a tenant does
    key = route_key(kind, body, tenant=tenant, session=request.headers.get(SESSION_HEADER))
    pool = st.healthy(DECODE_ROLES)
    if not pool:
        raise _no_worker(st, "decode" if any(w.role == "decode" for w in st.workers) else None)
    if owner is not None and owner in pool:
        target, cached = owner, 0
    else:
        choice = st.policy.choose(pool, key)
        if choice.affinity_hit is not None:
            st.metrics.affinity(choice.affinity_hit)
        target, cached = choice.worker, choice.cached_tokens
    headers = forward_headers(request)
    route = {DECODE_HEADER: target.url}
    uncached = key.tokens - cached  # what the target computes unless the KV comes to it
    hold = None
    if target.role == "both":
        route[PREFILL_HEADER] = target.url
    elif (kind in ("completions", "chat") and key.prompts == 1 and uncached >= st.disagg_min_tokens
          and not body.get("use_beam_search")  # a search runs its beams as prompts of their own
          and body.get("cache_salt") is None  # a salted prompt is computed where it runs
          and (prefills := st.healthy(("prefill",)))):
        prefill = st.policy.choose_prefill(prefills)
        kv = await _prefill(st, prefill, path, body, headers, key.tokens, route)
        if isinstance(kv, web.Response):
            return kv
        if kv is not None:
            raw = json.dumps({**body, "kv_transfer_params": kv}).encode()
            st.metrics.disaggregated()
            uncached = 0
            hold = _Hold.of(st, prefill, kv, headers)
    try:
        return await _forward(request, st, target, path, raw, headers, uncached, route, hold)
    finally:  # also when the client left (this task is cancelled) or the decode worker went down
        if hold is not None:
            await hold.settle()


def _parse(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except ValueError as e:  # also UnicodeDecodeError
        raise APIError(400, f"We could not parse the JSON body of your request ({e}). "
                            "The body must be a JSON object.") from e
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


async def _prefill(st: RouterState, worker: Worker, path: str, body: dict, headers: dict[str, str], tokens: int,
                   route: dict[str, str]) -> web.Response | dict | None:
    """The prompt's kv_transfer_params (None: nothing to transfer, or the prefill failed and the decode
    worker prefills locally), or the prefill worker's 4xx answer for the client."""
    req = {k: v for k, v in body.items() if k not in _PREFILL_DROPS}
    req.update(max_tokens=1, stream=False, n=1, kv_transfer_params={"do_remote_decode": True})
    st.metrics.request(worker, "prefill")
    try:
        up, data = await _PrefillCall(st, worker, path, req, headers, tokens).answer()
    except (WorkerDown, TimeoutError, aiohttp.ClientError) as e:
        _prefill_failed(st, worker, *_failure(st, e))
        return None
    if up.status >= 500:
        _prefill_failed(st, worker, f"http_{up.status}", f"prefill answered {up.status}: {data[:200]!r}")
        return None
    if up.status == 429:  # the prefill worker is full: no fault of the client's, and the worker is up
        log.info("prefill worker %s is at capacity; the decode worker prefills locally", worker.url)
        st.metrics.error(worker.url, "prefill_busy")
        return None
    if up.status >= 400:  # the client's own fault (a bad field, a wrong key): it gets the worker's answer
        return web.Response(status=up.status, body=data, headers=_response_headers(up, {PREFILL_HEADER: worker.url}))
    route[PREFILL_HEADER] = worker.url
    return _transfer_params(data)


def _transfer_params(data: bytes) -> dict | None:
    """The kv_transfer_params of a prefill worker's 200 answer, if it has any."""
    try:
        kv = json.loads(data).get("kv_transfer_params")
    except (ValueError, AttributeError):
        kv = None
    return kv if isinstance(kv, dict) else None


class _PrefillCall:
    """The prefill request, in a task of its own so that a client who leaves cannot lose a hold.

    The prefill worker releases its hold itself when its client (the router) leaves before the
    answer is written. Once written, the hold is the reader's to release: if the router's client
    leaves while the answer is on its way, the answer is still read and its hold released
    (`_abandoned`). A prefill still computing after `_ABANDON_GRACE_S` is cancelled instead, which
    closes the connection, so the prefill worker stops the prompt and releases its own hold.
    """

    def __init__(self, st: RouterState, worker: Worker, path: str, req: dict, headers: dict[str, str], tokens: int):
        self._st = st
        self._worker = worker
        self._headers = headers
        self._answered = asyncio.Event()
        self._task = asyncio.create_task(self._post(path, json.dumps(req).encode(), tokens))

    async def _post(self, path: str, data: bytes, tokens: int) -> tuple[aiohttp.ClientResponse, bytes]:
        st = self._st
        with InFlight(self._worker, tokens) as flight:
            async with asyncio.timeout(st.request_timeout):
                async with st.session.post(self._worker.url + path, data=data, headers=self._headers) as up:
                    flight.answering()
                    self._answered.set()
                    return up, await up.read()

    async def answer(self) -> tuple[aiohttp.ClientResponse, bytes]:
        """The worker's response (its headers) and body."""
        try:
            return await asyncio.shield(self._task)
        except asyncio.CancelledError:  # our client left (or our worker went down: then the task failed too)
            if not self._task.done():
                release = asyncio.create_task(self._abandoned())
                self._st.releases.add(release)
                release.add_done_callback(self._st.releases.discard)
            raise

    async def _abandoned(self) -> None:
        try:
            async with asyncio.timeout(_ABANDON_GRACE_S):
                await self._answered.wait()
        except TimeoutError:
            self._task.cancel()
        try:
            up, data = await self._task
        except (asyncio.CancelledError, WorkerDown, TimeoutError, aiohttp.ClientError):
            return
        kv = _transfer_params(data) if up.status == 200 else None
        hold = _Hold.of(self._st, self._worker, kv, self._headers) if kv is not None else None
        if hold is not None:
            log.info("releasing KV hold %s: its client left while the prefill answered", hold.transfer_id)
            await hold.settle()


class _Hold:
    """A prefill worker's hold on a prompt's KV: pages of its staging buffer, the router's to release
    unless the decode worker's answer says it imported them (and so released the hold itself)."""

    def __init__(self, st: RouterState, worker: Worker, transfer_id: str, headers: dict[str, str]):
        self._st = st
        self._worker = worker
        self.transfer_id = transfer_id
        self._headers = {k: v for k, v in headers.items() if k.lower() in _RELEASE_HEADERS}
        self._imported = False
        self._release: asyncio.Task | None = None

    @classmethod
    def of(cls, st: RouterState, worker: Worker, kv: dict, headers: dict[str, str]) -> _Hold | None:
        transfer_id = kv.get("transfer_id")
        return cls(st, worker, transfer_id, headers) if isinstance(transfer_id, str) else None

    def answered(self, up: aiohttp.ClientResponse) -> None:
        """The decode worker's headers (it pulls before it answers). Not imported: released now, not
        after the stream that may follow."""
        self._imported = up.headers.get(KV_TRANSFER_HEADER) == "imported"
        if not self._imported:
            self._start()

    async def settle(self) -> None:
        """The request is over, however it ended: unless the KV was imported, the release is done
        before the client gets its error (and goes on in its own task if this one is cancelled)."""
        if not self._imported:
            await asyncio.shield(self._start())

    def _start(self) -> asyncio.Task:
        if self._release is None:
            self._release = asyncio.create_task(self._post())
            self._st.releases.add(self._release)
            self._release.add_done_callback(self._st.releases.discard)
        return self._release

    async def _post(self) -> None:
        """404 is no failure: the decode worker released the hold before it failed, or it expired."""
        url = self._worker.url + RELEASE_PATH
        try:
            async with asyncio.timeout(_RELEASE_TIMEOUT_S):
                async with self._st.session.post(url, json={"transfer_id": self.transfer_id},
                                                 headers=self._headers) as up:
                    await up.read()
        except (TimeoutError, aiohttp.ClientError) as e:
            log.warning("could not release KV hold %s on %s (it expires instead): %r", self.transfer_id, url, e)
            return
        if up.status == 200:
            self._st.metrics.hold_released()
        elif up.status != 404:
            log.warning("releasing KV hold %s on %s answered %d (it expires instead)", self.transfer_id, url,
                        up.status)


def _prefill_failed(st: RouterState, worker: Worker, code: str, detail: str) -> None:
    log.warning("prefill on %s failed (%s); the decode worker prefills locally", worker.url, detail)
    st.metrics.error(worker.url, code)
    worker.mark_down(detail)


async def _forward(request: web.Request, st: RouterState, worker: Worker, path: str, data: bytes,
                   headers: dict[str, str], tokens: int, route: dict[str, str],
                   hold: _Hold | None) -> web.StreamResponse:
    """Sends the request to its (decode) worker and passes the answer through."""
    st.metrics.request(worker, worker.role)
    response: web.StreamResponse | None = None
    try:
        with InFlight(worker, tokens) as flight:
            async with asyncio.timeout(st.request_timeout):  # until the response's headers
                up = await st.session.post(worker.url + path, data=data, headers=headers)
            async with up:  # leaving early closes the connection: the worker aborts the request
                _count_kv(st, up)
                if hold is not None:
                    hold.answered(up)
                if up.content_type != "text/event-stream":
                    flight.answering()
                    return web.Response(status=up.status, body=await up.read(), headers=_response_headers(up, route))
                response = web.StreamResponse(status=up.status, headers=_response_headers(up, route))
                await _pipe(request, up, response, flight)
    except _ClientGone:
        return response
    except (WorkerDown, TimeoutError, aiohttp.ClientError) as e:
        error = _upstream_error(st, worker, e)
        if response is None or not response.prepared:
            raise error from e
        try:  # the headers are sent: end the stream with the error
            await response.write(error.event() + _DONE)
        except ConnectionResetError:
            return response
    try:
        await response.write_eof()
    except ConnectionResetError:  # the client left after the last event
        pass
    return response


async def _pipe(request: web.Request, up: aiohttp.ClientResponse, response: web.StreamResponse,
                flight: InFlight) -> None:
    """Sends the headers, then the upstream's events as they arrive, whole events only (so an error
    event after a broken upstream never lands inside a half-sent one)."""
    await _to_client(response.prepare(request))
    pending = b""
    async for chunk in up.content.iter_any():
        flight.answering()  # the first event; the headers come at admission, before the prefill
        pending += chunk
        cut = pending.rfind(b"\n\n") + 2
        if cut > 1:
            await _to_client(response.write(pending[:cut]))
            pending = pending[cut:]
    if pending:
        await _to_client(response.write(pending))


async def _to_client(write: Awaitable[object]) -> None:
    """A write to the client; its reset (an aiohttp ClientError too) is told apart from the worker's."""
    try:
        await write
    except ConnectionResetError as e:
        raise _ClientGone from e


def _count_kv(st: RouterState, up: aiohttp.ClientResponse) -> None:
    """The decode worker's report of the KV it imported."""
    if KV_BYTES_HEADER in up.headers:
        try:
            st.metrics.kv_transfer(float(up.headers[KV_BYTES_HEADER]), float(up.headers.get(KV_SECONDS_HEADER, 0)))
        except ValueError:
            log.warning("worker sent malformed KV transfer headers: %s", dict(up.headers))


def _failure(st: RouterState, e: BaseException) -> tuple[str, str]:
    """The metric code and the description of a failed upstream call."""
    if isinstance(e, WorkerDown):
        return "worker_down", e.reason
    if isinstance(e, TimeoutError):
        return "timeout", f"did not answer within {st.request_timeout:g}s"
    return "connection_lost", f"lost the connection ({type(e).__name__}: {e})"


def _upstream_error(st: RouterState, worker: Worker, e: BaseException) -> APIError:
    """The error a client gets for a failed upstream call; a broken connection has the worker probed now."""
    code, detail = _failure(st, e)
    st.metrics.error(worker.url, code)
    log.warning("request to %s failed: %s", worker.url, detail)
    if isinstance(e, WorkerDown):
        return e.api_error()
    if isinstance(e, aiohttp.ClientConnectorError):  # refused: a fresh connection, so the worker is gone
        worker.mark_down(detail)
    elif not isinstance(e, TimeoutError):
        worker.suspect()
    return worker_unavailable(worker.url, detail, 504 if code == "timeout" else 502)


def _no_worker(st: RouterState, pool: str | None) -> APIError:
    st.metrics.error("", "no_healthy_worker")
    return no_healthy_worker(pool)


def forward_headers(request: web.Request) -> dict[str, str]:
    """Authorization and every x-* header (tenant, session, prefix hint), as the client sent them."""
    headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization" or k.lower().startswith("x-")}
    headers["Content-Type"] = "application/json"
    return headers


def _response_headers(up: aiohttp.ClientResponse, route: dict[str, str]) -> dict[str, str]:
    """The worker's x-* headers and content type, then the router's own."""
    headers = {k: v for k, v in up.headers.items() if k.lower().startswith("x-")}
    headers["Content-Type"] = up.headers.get("Content-Type", "application/json")
    if up.content_type == "text/event-stream":
        headers["Cache-Control"] = "no-cache"
    headers.update(route)
    return headers
