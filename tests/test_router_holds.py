"""The router releases a prefill worker's KV hold on every way a disaggregated request can fail after
its prefill, in one process: the real router app between a fake prefill worker, which holds a region
per prefill and releases it only for its tenant (as server/kv_handoff.py does), and a fake decode
worker told how to fail. No model, no jax; tests/test_fleet.py checks the same on real workers."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from router.app import RouterConfig, build_router_app
from server.listen import bind, make_runner

BODY = {"model": "m", "prompt": "a long prompt " * 40, "max_tokens": 4}
CLIENT = {"Authorization": "Bearer key", "x-tenant-id": "tenant-a", "x-session-affinity": "s"}


def _health(role: str):
    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "role": role})

    return health


class FakePrefill:
    """Holds a region per prefill until a release names it with the tenant that made it."""

    def __init__(self):
        self.holds: dict[str, str | None] = {}  # transfer id -> tenant
        self.prefills = 0
        self.release_calls = 0
        self.released = asyncio.Event()
        self.on_prefill = None  # awaited before answering a prefill
        self.answer = None  # when set, answers the prefill in its place
        self.bodies: list[dict] = []  # the prefill requests' bodies
        self.app = web.Application()
        self.app.router.add_get("/health", _health("prefill"))
        self.app.router.add_post("/v1/completions", self._prefill)
        self.app.router.add_post("/v1/kv_transfer/release", self._release)

    async def _prefill(self, request: web.Request) -> web.StreamResponse:
        if self.answer is not None:
            return await self.answer(request)
        body = await request.json()
        self.bodies.append(body)
        assert body["max_tokens"] == 1 and body["kv_transfer_params"] == {"do_remote_decode": True}
        self.prefills += 1
        transfer_id = f"hold-{self.prefills}"
        self.holds[transfer_id] = request.headers.get("x-tenant-id")
        if self.on_prefill is not None:
            await self.on_prefill()
        return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": {
            "do_remote_prefill": True, "transfer_id": transfer_id, "remote_url": str(request.url.origin())}})

    async def _release(self, request: web.Request) -> web.Response:
        self.release_calls += 1
        transfer_id = (await request.json())["transfer_id"]
        if self.holds.get(transfer_id, "none") != request.headers.get("x-tenant-id"):
            return web.json_response({"error": {"code": "kv_hold_not_found"}}, status=404)
        del self.holds[transfer_id]
        self.released.set()
        return web.json_response({"released": True})


class FakeDecode:
    """A decode worker that ends each request as `mode` says."""

    def __init__(self, prefill: FakePrefill):
        self.mode = "imported"
        self.received = asyncio.Event()
        self.local = 0  # requests that came without a transfer: prefilled here
        self.runner: web.AppRunner | None = None
        self._prefill = prefill
        self.app = web.Application()
        self.app.router.add_get("/health", _health("decode"))
        self.app.router.add_post("/v1/completions", self._generate)

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if "kv_transfer_params" not in body:
            self.local += 1
            return web.json_response({"choices": [{"text": "local"}]})
        params = body["kv_transfer_params"]
        assert params["do_remote_prefill"]
        self.received.set()
        if self.mode == "imported":  # pulled, then released the hold itself, as a real decode worker does
            headers = {k: v for k, v in request.headers.items() if k in ("Authorization", "x-tenant-id")}
            async with aiohttp.ClientSession() as s:
                async with s.post(params["remote_url"] + "/v1/kv_transfer/release",
                                  json={"transfer_id": params["transfer_id"]}, headers=headers) as r:
                    assert r.status == 200
            return web.json_response({"choices": [{"text": "ok"}]}, headers={"x-infire-kv-transfer": "imported"})
        if self.mode == "failed":  # the pull failed (no room, read failed): computed locally, hold untouched
            return web.json_response({"choices": [{"text": "ok"}]}, headers={"x-infire-kv-transfer": "failed"})
        if self.mode == "stream_failed":  # the last event waits for the release: it must come at the headers
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                   "x-infire-kv-transfer": "failed"})
            await response.prepare(request)
            await response.write(b'data: {"choices": [{"text": "a"}]}\n\n')
            await self._prefill.released.wait()
            await response.write(b'data: {"choices": [{"text": "b"}]}\n\ndata: [DONE]\n\n')
            return response
        if self.mode in ("400", "500"):
            return web.json_response({"error": {"message": "no", "type": "x", "param": None, "code": None}},
                                     status=int(self.mode))
        if self.mode == "drop":  # dies mid-request: the connection breaks
            request.transport.close()
        await asyncio.sleep(3600)  # "hang", and "drop" after its close
        raise AssertionError("unreachable")


@contextlib.asynccontextmanager
async def _serving(app: web.Application) -> AsyncIterator[tuple[str, web.AppRunner]]:
    """The app on a free port, with the runner the router and workers use (handler cancellation on)."""
    sock = bind("127.0.0.1", 0)
    runner = make_runner(app)
    await runner.setup()
    try:
        await web.SockSite(runner, sock).start()
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", runner
    finally:
        await runner.cleanup()
        sock.close()


@contextlib.asynccontextmanager
async def _fleet(request_timeout: float = 30.0) -> AsyncIterator[tuple[str, FakePrefill, FakeDecode]]:
    prefill = FakePrefill()
    decode = FakeDecode(prefill)
    async with _serving(prefill.app) as (p_url, _), _serving(decode.app) as (d_url, d_runner):
        decode.runner = d_runner
        config = RouterConfig(workers=((p_url, "prefill"), (d_url, "decode")), disagg_min_tokens=0,
                              health_interval=60, request_timeout=request_timeout)
        async with _serving(build_router_app(config)) as (r_url, _):
            yield r_url, prefill, decode


async def _post(url: str, body: dict = BODY) -> tuple[int, bytes, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/completions", json=body, headers=CLIENT) as r:
            return r.status, await r.read(), dict(r.headers)


async def _released_by_router(url: str) -> float:
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/metrics") as r:
            text = await r.text()
    return next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("infire_router:kv_holds_released_total"))


@pytest.mark.parametrize("mode,status", [("failed", 200), ("400", 400), ("500", 500), ("drop", 502)])
def test_a_hold_the_decode_worker_did_not_import_is_released_before_the_answer(mode, status):
    async def main() -> None:
        async with _fleet() as (router, prefill, decode):
            decode.mode = mode
            got, _, _ = await _post(router)
            assert got == status
            assert prefill.holds == {} and prefill.release_calls == 1  # no waiting: done before the answer
            assert await _released_by_router(router) == 1

    asyncio.run(main())


def test_an_imported_hold_is_the_decode_workers_to_release():
    async def main() -> None:
        async with _fleet() as (router, prefill, _):
            status, _, headers = await _post(router)
            assert status == 200 and headers["x-infire-kv-transfer"] == "imported"
            assert prefill.holds == {} and prefill.release_calls == 1  # the decode worker's, and no other
            assert await _released_by_router(router) == 0

    asyncio.run(main())


def test_a_streamed_answer_releases_the_hold_at_its_headers():
    async def main() -> None:
        async with _fleet() as (router, prefill, decode):
            decode.mode = "stream_failed"
            status, raw, _ = await asyncio.wait_for(_post(router, {**BODY, "stream": True}), 10)
            assert status == 200 and raw.endswith(b"data: [DONE]\n\n") and b'"b"' in raw
            assert prefill.holds == {}

    asyncio.run(main())


def test_a_decode_worker_that_times_out_or_is_gone():
    async def main() -> None:
        async with _fleet(request_timeout=0.5) as (router, prefill, decode):
            decode.mode = "hang"
            status, body, _ = await _post(router)
            assert status == 504 and json.loads(body)["error"]["code"] == "worker_unavailable"
            assert prefill.holds == {}
            prefill.on_prefill = decode.runner.cleanup  # the decode worker dies while the prompt is prefilled
            status, body, _ = await _post(router)
            assert status in (502, 503) and json.loads(body)["error"]["code"] == "worker_unavailable"
            assert prefill.holds == {} and prefill.release_calls == 2

    asyncio.run(main())


def test_a_client_that_leaves_after_the_prefill():
    async def main() -> None:
        async with _fleet() as (router, prefill, decode):
            decode.mode = "hang"
            client = asyncio.create_task(_post(router))
            await asyncio.wait_for(decode.received.wait(), 10)  # prefilled, and sent on to the decode worker
            assert len(prefill.holds) == 1
            client.cancel()  # closes the connection: the router's handler is cancelled
            await asyncio.wait_for(prefill.released.wait(), 5)  # hold timeouts are 30 s by default
            assert prefill.holds == {}

    asyncio.run(main())


def test_a_client_that_leaves_while_the_prefill_answers():
    """The prefill worker has sent its answer's headers (its hold is made and, to it, handed over)
    when the router's client leaves: the router still reads the transfer id and releases the hold."""
    async def main() -> None:
        async with _fleet() as (router, prefill, decode):
            client = asyncio.create_task(_post(router))

            async def answer_in_flight(request: web.Request) -> web.StreamResponse:
                await request.read()
                prefill.holds["hold-1"] = request.headers.get("x-tenant-id")
                response = web.StreamResponse(headers={"Content-Type": "application/json"})
                await response.prepare(request)  # the headers are on their way, the body follows
                client.cancel()
                await asyncio.sleep(0.1)  # the router's handler is cancelled meanwhile
                await response.write(json.dumps({"choices": [{"text": "x"}], "kv_transfer_params": {
                    "do_remote_prefill": True, "transfer_id": "hold-1",
                    "remote_url": str(request.url.origin())}}).encode())
                await response.write_eof()
                return response

            prefill.answer = answer_in_flight
            await asyncio.wait_for(prefill.released.wait(), 5)  # hold timeouts are 30 s by default
            assert prefill.holds == {} and not decode.received.is_set()
            assert await _released_by_router(router) == 1

    asyncio.run(main())


def test_a_client_that_leaves_during_a_long_prefill_stops_it():
    """A prefill still computing when the client leaves is not waited for past the router's short
    grace: its connection closes, so the prefill worker stops the prompt (and releases its own hold)."""
    async def main() -> None:
        async with _fleet() as (router, prefill, _):
            stopped = asyncio.Event()

            async def computing(request: web.Request) -> web.Response:
                try:
                    await asyncio.sleep(3600)
                finally:
                    stopped.set()
                raise AssertionError("unreachable")

            prefill.answer = computing
            client = asyncio.create_task(_post(router))
            await asyncio.sleep(0.3)
            client.cancel()
            await asyncio.wait_for(stopped.wait(), 2)
            assert prefill.release_calls == 0

    asyncio.run(main())


def test_what_the_prefill_is_sent_and_what_is_never_disaggregated():
    """The prefill runs one token of one choice: best_of (valid only as the client's n) is left out;
    a beam search (its beams are prompts of their own) and a salted prompt are never disaggregated."""
    async def main() -> None:
        async with _fleet() as (router, prefill, decode):
            status, _, _ = await _post(router, {**BODY, "n": 2, "best_of": 2, "min_tokens": 2})
            assert status == 200 and decode.local == 0
            (sent,) = prefill.bodies
            assert (sent["n"], sent["max_tokens"]) == (1, 1) and "best_of" not in sent and "min_tokens" not in sent
            status, raw, _ = await _post(router, {**BODY, "n": 2, "use_beam_search": True})
            assert (status, json.loads(raw)["choices"][0]["text"], decode.local) == (200, "local", 1)
            status, raw, _ = await _post(router, {**BODY, "cache_salt": "s"})  # computed where it runs
            assert (status, json.loads(raw)["choices"][0]["text"], decode.local) == (200, "local", 2)
            assert len(prefill.bodies) == 1

    asyncio.run(main())


def test_a_full_prefill_worker_leaves_the_prefill_to_the_decode_worker():
    """429 from the prefill worker is a capacity signal, not the client's fault: the decode worker
    prefills locally, and the prefill worker stays up."""
    async def main() -> None:
        async with _fleet() as (router, prefill, decode):
            async def full(request: web.Request) -> web.Response:
                await request.read()
                return web.json_response({"error": {"message": "the server is at capacity", "type": "rate_limit_error",
                                                    "param": None, "code": "queue_full"}}, status=429)

            prefill.answer = full
            status, raw, _ = await _post(router)
            assert (status, json.loads(raw)["choices"][0]["text"], decode.local) == (200, "local", 1)
            async with aiohttp.ClientSession() as s:
                async with s.get(router + "/health") as r:
                    health = await r.json()
            assert all(w["healthy"] for w in health["workers"]), health

    asyncio.run(main())
