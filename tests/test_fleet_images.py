"""Images across the fleet (issue 48): a chat request with an image through a router, a prefill
worker and a decode worker, in this process, on a tiny random Llama 4 with a vision tower.

The prefill worker encodes the image and computes the prompt; the decode worker cuts the image into
tiles itself (its prompt's tokens and the image's digest, which keys the prefix cache, are its own),
pulls the KV of the prompt's full pages and encodes no image whose tokens all arrived that way.
"""

from __future__ import annotations

import asyncio
import base64
import io

import aiohttp
import numpy as np
import pytest
from PIL import Image

pytest.importorskip("torch")

ENGINE = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(4, 32), max_model_len=128,
              num_kv_pages=40, limit_mm_per_prompt={"image": 2})


def data_url(image: Image.Image) -> str:
    png = io.BytesIO()
    image.save(png, format="PNG")
    return "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()


def test_a_chat_image_through_prefill_and_decode_workers_equals_one_engine(tmp_path):
    """Three chats, each greedy with logprobs, equal the prefill engine's own offline answer (before it
    serves): an image followed by text, so its tokens lie in the prompt's full pages (the decode worker
    takes their KV and encodes nothing); the same text with another image (the prefill worker's prefix
    cache, keyed by the image, gives it none of the first one's pages); the first image at the prompt's
    end (its first page is the first chat's: a hit), whose tokens reach into the last, partial page
    that the decode worker computes itself, so it encodes that one. Afterwards both workers hold no
    page, image row or KV hold."""
    from llama4_models import vision_checkpoint
    from server_utils import AppThread

    from infire_jax import LLM, SamplingParams
    from router.app import RouterConfig, build_router_app
    from server.app import build_app
    from server.endpoints import STATE

    _, path = vision_checkpoint(tmp_path / "ckpt")
    prefill, decode = LLM(model=path, **ENGINE), LLM(model=path, **ENGINE)
    rng = np.random.default_rng(11)
    wide, other = (Image.fromarray(rng.integers(0, 256, (56, 112, 3), dtype=np.uint8)) for _ in range(2))
    tail = " and now tell me all about it, please."

    def chat(image, after: str | None) -> list[dict]:
        parts = [{"type": "text", "text": "look:"}, {"type": "image_url", "image_url": {"url": data_url(image)}}]
        return [{"role": "user", "content": parts + ([{"type": "text", "text": after}] if after else [])}]

    # (messages, are the image's tokens in the full pages, the prefill worker's prefix hit in tokens)
    cases = [(chat(wide, tail), True, 0), (chat(other, tail), True, 0), (chat(wide, None), False, 16)]
    want = []
    for messages, _, _ in cases:  # each computed afresh, as the fleet's prefill worker computes it
        assert prefill.reset_prefix_cache()
        want += prefill.chat(messages, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1))
    p, d = prefill.engine, decode.engine
    assert p.stats.images_encoded == 3 and d.stats.images_encoded == 0

    servers = AppThread()
    try:
        servers.run(servers.serve(build_app(p, role="prefill", kv_buffer_bytes=4 << 20, kv_hold_seconds=30)))
        servers.run(servers.serve(build_app(d, role="decode", kv_buffer_bytes=4 << 20)))
        handoffs = [r.app[STATE].handoff for r in servers.runners]
        free = [h.free_bytes for h in handoffs]
        router = RouterConfig(workers=((servers.urls[0], "prefill"), (servers.urls[1], "decode")),
                              disagg_min_tokens=0, health_interval=0.5)
        servers.run(servers.serve(build_router_app(router)))

        async def post(messages: list[dict]) -> tuple[dict, dict]:
            body = {"model": d.model_name, "messages": messages, "max_tokens": 12, "temperature": 0,
                    "ignore_eos": True, "logprobs": True, "top_logprobs": 1}
            async with aiohttp.ClientSession() as s:
                async with s.post(servers.urls[2] + "/v1/chat/completions", json=body,
                                  headers={"x-tenant-id": "fleet"}) as r:  # none of the offline run's pages
                    assert r.status == 200, await r.text()
                    return await r.json(), dict(r.headers)

        ps = d.runner.rc.page_size
        for (messages, in_pages, hit), out in zip(cases, want):
            encoded, hits = (p.stats.images_encoded, d.stats.images_encoded), p.kv.hits
            got, headers = servers.run(post(messages))
            assert headers["x-infire-decode-worker"] == servers.urls[1]
            assert headers["x-infire-prefill-worker"] == servers.urls[0]
            assert headers["x-infire-kv-transfer"] == "imported", headers
            n = len(out.prompt_token_ids)
            assert got["usage"]["prompt_tokens"] == n
            assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // ps * ps
            # the offline run's pages are another tenant's, the first chat's another image's but the third's
            assert p.kv.hits - hits == hit
            patches = np.flatnonzero(np.asarray(out.prompt_token_ids) == p.images.cfg.image_token_id)
            assert (patches[-1] < (n - 1) // ps * ps) == in_pages
            assert (p.stats.images_encoded, d.stats.images_encoded) == (encoded[0] + 1, encoded[1] + (not in_pages))
            choice, tokens = got["choices"][0], out.outputs[0].token_ids
            assert choice["message"]["content"] == out.outputs[0].text
            np.testing.assert_allclose([e["logprob"] for e in choice["logprobs"]["content"]],
                                       [lp[t] for lp, t in zip(out.outputs[0].logprobs, tokens)], rtol=0, atol=1e-4)

        async def drained() -> None:
            for _ in range(200):
                if handoffs[0].num_holds == 0 and [h.free_bytes for h in handoffs] == free:
                    return
                await asyncio.sleep(0.05)

        servers.run(drained())
        assert handoffs[0].num_holds == 0 and [h.free_bytes for h in handoffs] == free
    finally:
        servers.close()
    for engine in (p, d):
        assert engine.kv.num_free_pages == engine.kv.num_usable_pages and not any(engine.kv.pages_in_use())
        assert engine.images.pool.free_rows == engine.images.pool.num_rows
