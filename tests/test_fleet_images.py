"""Images across the fleet (issue 48): chat requests with images through a router, a prefill worker
and a decode worker, in this process, on a tiny random Llama 4 with a vision tower.

The prefill worker encodes the image and computes the prompt; the decode worker cuts the image into
tiles itself (its prompt's tokens and the image's digest, which keys the prefix cache, are its own),
pulls the KV of the prompt's full pages and encodes no image whose tokens all arrived that way.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import subprocess
import sys
import types

import aiohttp
import numpy as np
import pytest
from PIL import Image

pytest.importorskip("torch")

ENGINE = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(4, 32), max_model_len=128,
              num_kv_pages=40, limit_mm_per_prompt={"image": 2})
RNG = np.random.default_rng(11)
WIDE, OTHER = (Image.fromarray(RNG.integers(0, 256, (56, 112, 3), dtype=np.uint8)) for _ in range(2))
TAIL = " and now tell me all about it, please."


def data_url(image: Image.Image) -> str:
    png = io.BytesIO()
    image.save(png, format="PNG")
    return "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()


def chat(image: Image.Image, after: str | None) -> list[dict]:
    parts = [{"type": "text", "text": "look:"}, {"type": "image_url", "image_url": {"url": data_url(image)}}]
    return [{"role": "user", "content": parts + ([{"type": "text", "text": after}] if after else [])}]


# (messages, whether the image's tokens lie in the prompt's full pages, the prefill worker's prefix hit)
CASES = [(chat(WIDE, TAIL), True, 0), (chat(OTHER, TAIL), True, 0), (chat(WIDE, None), False, 16)]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Two engines of the checkpoint, the prefill engine's offline answers to CASES (each computed
    afresh, before it serves), then the engines as a prefill and a decode worker behind a router."""
    from llama4_models import image_checkpoint
    from server_utils import AppThread

    from infire_jax import LLM, SamplingParams
    from router.app import RouterConfig, build_router_app
    from server.app import build_app
    from server.endpoints import STATE

    _, path = image_checkpoint(tmp_path_factory.mktemp("vision"))
    prefill, decode = LLM(model=path, **ENGINE), LLM(model=path, **ENGINE)
    want = []
    for messages, _, _ in CASES:
        assert prefill.reset_prefix_cache()
        want += prefill.chat(messages, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1))
    p, d = prefill.engine, decode.engine
    servers = AppThread()
    try:
        servers.run(servers.serve(build_app(p, role="prefill", kv_buffer_bytes=4 << 20, kv_hold_seconds=30)))
        servers.run(servers.serve(build_app(d, role="decode", kv_buffer_bytes=4 << 20)))
        router = RouterConfig(workers=((servers.urls[0], "prefill"), (servers.urls[1], "decode")),
                              disagg_min_tokens=0, health_interval=0.5)
        servers.run(servers.serve(build_router_app(router)))
        yield types.SimpleNamespace(p=p, d=d, want=want, servers=servers, urls=servers.urls,
                                    handoffs=[r.app[STATE].handoff for r in servers.runners[:2]])
    finally:
        servers.close()


def drained(fleet) -> None:
    """No KV hold, staging byte, page or image row is left on either worker."""
    async def wait() -> None:
        for _ in range(200):
            if fleet.handoffs[0].num_holds == 0 and not any(e.has_unfinished() for e in (fleet.p, fleet.d)):
                return
            await asyncio.sleep(0.05)

    fleet.servers.run(wait())
    assert fleet.handoffs[0].num_holds == 0
    for engine in (fleet.p, fleet.d):
        assert engine.kv.num_free_pages == engine.kv.num_usable_pages and not any(engine.kv.pages_in_use())
        assert engine.images.pool.free_rows == engine.images.pool.num_rows


def test_a_chat_image_through_prefill_and_decode_workers_equals_one_engine(fleet):
    """Three chats, each greedy with logprobs, equal the prefill engine's own offline answer: an image
    followed by text, so its tokens lie in the prompt's full pages (the decode worker takes their KV
    and encodes nothing); the same text with another image (the prefill worker's prefix cache, keyed by
    the image, gives it none of the first one's pages); the first image at the prompt's end (its first
    page is the first chat's: a hit), whose tokens reach into the last, partial page that the decode
    worker computes itself, so it encodes that one."""
    p, d = fleet.p, fleet.d
    assert p.stats.images_encoded == 3 and d.stats.images_encoded == 0  # the offline answers'

    async def post(messages: list[dict]) -> tuple[dict, dict]:
        body = {"model": d.model_name, "messages": messages, "max_tokens": 12, "temperature": 0,
                "ignore_eos": True, "logprobs": True, "top_logprobs": 1}
        async with aiohttp.ClientSession() as s:
            async with s.post(fleet.urls[2] + "/v1/chat/completions", json=body,
                              headers={"x-tenant-id": "fleet"}) as r:  # none of the offline run's pages
                assert r.status == 200, await r.text()
                return await r.json(), dict(r.headers)

    ps = d.runner.rc.page_size
    free = [h.free_bytes for h in fleet.handoffs]
    for (messages, in_pages, hit), out in zip(CASES, fleet.want):
        encoded, hits = (p.stats.images_encoded, d.stats.images_encoded), p.kv.hits
        got, headers = fleet.servers.run(post(messages))
        assert headers["x-infire-decode-worker"] == fleet.urls[1]
        assert headers["x-infire-prefill-worker"] == fleet.urls[0]
        assert headers["x-infire-kv-transfer"] == "imported", headers
        n = len(out.prompt_token_ids)
        assert got["usage"]["prompt_tokens"] == n
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // ps * ps
        assert p.kv.hits - hits == hit  # the offline run's pages are another tenant's; the first chat's another image's
        patches = np.flatnonzero(np.asarray(out.prompt_token_ids) == p.images.cfg.image_token_id)
        assert (patches[-1] < (n - 1) // ps * ps) == in_pages
        assert (p.stats.images_encoded, d.stats.images_encoded) == (encoded[0] + 1, encoded[1] + (not in_pages))
        choice, tokens = got["choices"][0], out.outputs[0].token_ids
        assert choice["message"]["content"] == out.outputs[0].text
        np.testing.assert_allclose([e["logprob"] for e in choice["logprobs"]["content"]],
                                   [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens)], rtol=0, atol=1e-4)
    drained(fleet)
    assert [h.free_bytes for h in fleet.handoffs] == free


def test_bench_serve_sends_image_requests_through_the_fleet(fleet, tmp_path):
    """`bench serve --images-per-request 2 --image-size 112x56` against the router: every request is a
    chat with two images, the prefill worker encodes both of each (its own text first: no prefix hit),
    and each request's output has its max_tokens."""
    before = fleet.p.stats.images_encoded
    out = tmp_path / "serve.json"
    proc = subprocess.run(
        [sys.executable, "-m", "infire_jax.bench", "serve", "--base-url", fleet.urls[2], "--num-prompts", "3",
         "--input-len", "3", "--output-len", "4", "--images-per-request", "2", "--image-size", "112x56",
         "--max-concurrency", "2", "--ignore-eos", "--num-warmups", "0", "--json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (r,) = json.loads(out.read_text())["results"]
    assert r["completed"] == 3 and r["failed"] == 0 and r["total_output_tokens"] == 3 * 4
    assert r["total_input_tokens"] > 3 * 2 * 17  # each image's placeholder is 17 tokens
    assert 0 < r["p50_ttft_ms"] < r["p50_e2el_ms"]
    assert fleet.p.stats.images_encoded - before == 3 * 2
    drained(fleet)
