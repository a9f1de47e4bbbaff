"""A prompt's KV moved between two engines of the real model: the receiver's prefix cache serves it,
and generation from imported pages equals generation from a local prefill. Last, the same engines
as a prefill and a decode worker in this process: no hold outlives a transfer that cannot happen."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from typing import Callable

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from infire_jax import Engine, EngineConfig, SamplingParams
from infire_jax.errors import InvalidRequestError
from server_utils import AppThread

PS = 16
CONFIG = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
              kv_cache_memory=48 << 20)
PROMPT = [1] + [100 + (7 * i) % 3000 for i in range(70)]  # 71 tokens: 4 full pages and a tail


@pytest.fixture(scope="module")
def pair() -> tuple[Engine, Engine]:
    return Engine(EngineConfig(**CONFIG)), Engine(EngineConfig(**CONFIG))


def run(engine: Engine, prompt, *, tenant=None, max_tokens=24) -> tuple[list[int], list[dict], int]:
    """Greedy tokens, logprobs and the prefix-cache hit of one request."""
    rid, _ = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=3,
                                                       ignore_eos=True), tenant=tenant)
    tokens, logprobs, cached = [], [], None
    while engine.has_unfinished():
        for d in engine.step():
            assert d.request_id == rid
            tokens += d.token_ids
            logprobs += d.logprobs
            cached = d.num_cached_tokens
    return tokens, logprobs, cached


def test_imported_pages_serve_the_prompt_exactly(pair):
    sender, receiver = pair
    want, want_lp, cached = run(sender, PROMPT, tenant="t1")  # the prefill, which caches 4 full pages
    assert cached == 0
    blocks = sender.export_prompt_kv(PROMPT, tenant="t1")
    assert blocks.num_blocks == 4 and blocks.token_ids == PROMPT[:4 * PS]
    assert blocks.nbytes == 2 * 30 * 4 * PS * 3 * 64 * 4  # k and v, 30 layers, 3 kv heads of 64, float32

    free = receiver.kv.num_free_pages
    assert receiver.import_prompt_kv(blocks) == 4
    assert receiver.kv.num_free_pages == free  # imported pages are cached but unreferenced
    assert receiver.import_prompt_kv(blocks) == 0  # already cached: nothing written twice
    again = receiver.export_prompt_kv(PROMPT, tenant="t1")
    np.testing.assert_array_equal(again.k, blocks.k)  # the receiver's pool holds the same bytes
    np.testing.assert_array_equal(again.v, blocks.v)

    got, got_lp, cached = run(receiver, PROMPT, tenant="t1")
    assert cached == 4 * PS  # only the 7-token tail was computed here
    assert got == want
    for a, b in zip(got_lp, want_lp):
        assert a.keys() == b.keys()
        np.testing.assert_allclose([a[t] for t in a], [b[t] for t in a], atol=1e-5)
    assert receiver.kv.usage == 0 and receiver.kv.num_free_pages == free  # nothing leaked


def test_tenants_stay_apart_across_engines(pair):
    sender, receiver = pair
    prompt = [1] + [200 + i for i in range(40)]
    run(sender, prompt, tenant="alpha", max_tokens=2)
    assert sender.export_prompt_kv(prompt, tenant="beta").num_blocks == 0  # another tenant's chain
    receiver.import_prompt_kv(sender.export_prompt_kv(prompt, tenant="alpha"))
    assert run(receiver, prompt, tenant="beta", max_tokens=2)[2] == 0
    assert run(receiver, prompt, tenant="alpha", max_tokens=2)[2] == 2 * PS


def test_mismatched_or_malformed_blocks_are_refused(pair):
    sender, receiver = pair
    run(sender, PROMPT, tenant="t2", max_tokens=1)
    blocks = sender.export_prompt_kv(PROMPT, tenant="t2")
    other = dataclasses.replace(blocks, layout=dataclasses.replace(blocks.layout, page_size=32))
    with pytest.raises(InvalidRequestError, match="page_size is 32 in the transfer and 16 here"):
        receiver.import_prompt_kv(other)
    with pytest.raises(InvalidRequestError, match="dtype"):
        receiver.import_prompt_kv(dataclasses.replace(blocks, layout=dataclasses.replace(blocks.layout,
                                                                                          dtype="bfloat16")))
    with pytest.raises(InvalidRequestError, match="expected"):
        receiver.import_prompt_kv(dataclasses.replace(blocks, k=blocks.k[:, :2]))
    with pytest.raises(InvalidRequestError, match="tokens for"):
        receiver.import_prompt_kv(dataclasses.replace(blocks, token_ids=blocks.token_ids[:-1]))
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        receiver.import_prompt_kv(dataclasses.replace(blocks, token_ids=[10 ** 6] * len(blocks.token_ids)))
    assert receiver.kv.usage == 0


# ---- over Mooncake --------------------------------------------------------------------------------

def test_blocks_cross_mooncake_and_serve_the_prompt(pair):
    """Sender engine -> its staging buffer -> Mooncake read (TCP, loopback) -> receiver's staging
    buffer -> receiver's prefix cache: the bytes arrive intact, the prompt is served from them, and
    every region is returned."""
    from infire_jax.kv_transfer.mooncake import MooncakeTransport

    sender, receiver = pair
    prompt = [1] + [300 + (11 * i) % 2000 for i in range(100)]  # 6 full pages
    want = run(sender, prompt, tenant="mc")[0]
    blocks = sender.export_prompt_kv(prompt, tenant="mc")
    src, dst = MooncakeTransport(16 << 20), MooncakeTransport(16 << 20)
    held = src.hold(blocks)  # control message 1: the prefill side names the held region
    region = dst.reserve(blocks.nbytes)
    assert dst.fetch(held, region) > 0
    src.release(held)  # control message 2: fetched, the sender's region is free again
    arrived = dst.received(region, blocks.layout, blocks.token_ids, blocks.tenant)
    np.testing.assert_array_equal(arrived.k, blocks.k)
    np.testing.assert_array_equal(arrived.v, blocks.v)
    assert receiver.import_prompt_kv(arrived) == 6
    dst.release(region)  # imported: the receiver's region is free again
    assert dst._free == [(0, 16 << 20)] and src._free == [(0, 16 << 20)]
    got, _, cached = run(receiver, prompt, tenant="mc")
    assert cached == 6 * PS and got == want
    with pytest.raises(InvalidRequestError, match="no room in the KV staging buffer"):
        dst.reserve(17 << 20)


# ---- in-process workers: a hold nobody can use is released, not left to expire --------------------

HOLD_S = 60  # far beyond every deadline below: a hold that is gone was released, not expired
LONG = [1] + [400 + (13 * i) % 2500 for i in range(100)]  # 6 full pages: more than the decode buffer holds


class _Watch:
    """Hooks on the prefill worker: the task of its latest generation request, and, when `stall` is
    set, its next answer held back before the first byte (the hold is made, the client has no id)."""

    def __init__(self):
        self.task: asyncio.Task | None = None
        self.stall = False
        self.stalled = False

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        if request.path == "/v1/completions":
            self.task = asyncio.current_task()
        return await handler(request)

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        if self.stall and request.path == "/v1/completions":
            self.stall, self.stalled = False, True
            await asyncio.Event().wait()  # until the client leaves and the handler is cancelled


@pytest.fixture(scope="module")
def workers(pair):
    """The pair as a prefill worker (16 MiB staging buffer) and a decode worker (4 MiB: room for
    PROMPT's 4 pages, not LONG's 6). Their engine threads take the engines over: these tests come last."""
    from server.app import build_app

    sender, receiver = pair
    prefill = build_app(sender, role="prefill", kv_buffer_bytes=16 << 20, kv_hold_seconds=HOLD_S)
    watch = _Watch()
    prefill.middlewares.append(watch.middleware)
    prefill.on_response_prepare.append(watch.on_prepare)
    w = AppThread()
    try:
        w.run(w.serve(prefill))
        w.run(w.serve(build_app(receiver, role="decode", kv_buffer_bytes=4 << 20)))
        w.watch, w.model = watch, sender.model_name
        yield w
    finally:
        w.close()


def _handoff(w: AppThread, i: int):
    from server.endpoints import STATE

    return w.runners[i].app[STATE].handoff


async def _post(url: str, body: dict) -> tuple[int, dict, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/completions", json=body) as r:
            return r.status, await r.json(), dict(r.headers)


async def _until(predicate: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"waited {seconds}s for {what}"
        await asyncio.sleep(0.02)


def _prefill_body(w: AppThread, prompt: list[int]) -> dict:
    return {"model": w.model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True}}


def test_a_client_that_leaves_while_the_hold_is_made_leaves_none(workers):
    """The client goes away while the prompt's pages are copied into the staging buffer (the copy
    ends only after the handler's cancel here): the region is returned as soon as it does."""
    from infire_jax.kv_transfer.mooncake import MooncakeTransport

    handoff = _handoff(workers, 0)
    copying, gate = threading.Event(), threading.Event()

    def slow_hold(blocks):
        region = MooncakeTransport.hold(handoff.transport, blocks)
        copying.set()
        gate.wait(60)
        return region

    async def main() -> None:
        free = handoff.free_bytes
        client = asyncio.create_task(_post(workers.urls[0], _prefill_body(workers, PROMPT)))
        await _until(copying.is_set, 120, "the prefill and its copy into the staging buffer")
        assert handoff.free_bytes < free
        client.cancel()  # closes the connection
        await _until(workers.watch.task.done, 5, "the worker to cancel the handler")
        gate.set()
        await _until(lambda: handoff.free_bytes == free, 5, "the region to come back")
        assert handoff.num_holds == 0  # never registered: no half-made hold

    handoff.transport.hold = slow_hold
    try:
        workers.run(main())
    finally:
        gate.set()
        del handoff.transport.hold


def test_a_client_that_leaves_before_the_answer_leaves_no_hold(workers):
    """The hold is made, the answer that names it is not written yet: a client that leaves then has
    the hold released at once (the expiry is a minute away)."""
    handoff = _handoff(workers, 0)

    async def main() -> None:
        free = handoff.free_bytes
        workers.watch.stall = True
        client = asyncio.create_task(_post(workers.urls[0], _prefill_body(workers, PROMPT)))
        await _until(lambda: workers.watch.stalled, 120, "the prefill's answer")
        assert handoff.num_holds == 1 and handoff.free_bytes < free
        client.cancel()
        await _until(lambda: handoff.num_holds == 0 and handoff.free_bytes == free, 5, "the hold's release")
        assert workers.watch.task.done()

    workers.run(main())


def _another_engine(params: dict) -> dict:
    return {**params, "remote_engine_id": "127.0.0.1:1"}  # nothing listens there: the Mooncake read fails


@pytest.mark.parametrize("case,prompt,change,extra,status,outcome", [
    ("no room in the decode buffer", LONG, None, {}, 200, "failed"),
    ("the read fails", PROMPT, _another_engine, {}, 200, "failed"),
    ("params of another prompt", PROMPT, None, {"prompt": [1] + PROMPT[2:]}, 400, None),
    ("refused before the pull", PROMPT, None, {"min_tokens": 8}, 400, None),
    ("imported", PROMPT, None, {}, 200, "imported"),
])
def test_a_decode_worker_releases_the_hold_it_does_not_import(workers, case, prompt, change, extra, status, outcome):
    """No router in between, as behind vLLM's proxies: the decode worker answers (computing the
    prompt itself, or refusing the request) and the prefill worker's hold is gone within seconds."""
    handoff = _handoff(workers, 0)

    async def main() -> None:
        free = handoff.free_bytes
        got, pre, _ = await _post(workers.urls[0], _prefill_body(workers, prompt))
        assert got == 200, pre
        params = pre["kv_transfer_params"]
        assert handoff.num_holds == 1 and handoff.free_bytes == free - params["num_bytes"]
        body = {"model": workers.model, "prompt": prompt, "max_tokens": 4, "temperature": 0,
                "kv_transfer_params": change(params) if change else params, **extra}
        got, answer, headers = await _post(workers.urls[1], body)
        assert got == status, answer
        assert headers.get("x-infire-kv-transfer") == outcome
        await _until(lambda: handoff.num_holds == 0 and handoff.free_bytes == free, 5, f"the release ({case})")
        assert _handoff(workers, 1).free_bytes == 4 << 20  # the decode worker's region came back too

    workers.run(main())
