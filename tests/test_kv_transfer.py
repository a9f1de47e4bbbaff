"""A prompt's KV moved between two engines of the real model: the receiver's prefix cache serves it,
and generation from imported pages equals generation from a local prefill."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from infire_jax import Engine, EngineConfig, SamplingParams
from infire_jax.errors import InvalidRequestError

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
