"""The hybrid KV cache in the engine: a tiny random Llama with global and chunked layers, its chunked
groups freeing pages as sequences cross chunk boundaries, against the same model with every page kept
in one group (`hybrid_kv_cache=False`; the kernels mask the same way, so tokens and logprobs must be
equal). Prompts crossing several chunks in one step, chunked prefill with a step boundary mid-chunk,
decode and decode bursts across boundaries, preemption, prefix-cache hits; the pages a long sequence
holds; no page leaks after 500 mixed requests with disconnects; no compiles after warmup; a prompt's
KV moved to another engine (each group's pages) serving it as a full prefix hit, and the same through
a router, a prefill and a decode worker over HTTP; `bench latency --import-context` on this cache."""

from __future__ import annotations

import random

import numpy as np
import pytest

from infire_jax import LLM, SamplingParams
from infire_jax.engine.engine import Engine, EngineConfig
from infire_jax.core.hybrid_kv_cache import HybridKVCacheManager
from infire_jax.core.kv_cache import NULL_PAGE, KVCacheManager
from infire_jax.loaders.dummy import dummy_tokenizer
from infire_jax.loaders.weights import LoadedModel
from infire_jax.models.config import ModelConfig

CHUNK = 12  # a step boundary at 32 tokens (the budget) falls mid-chunk
PS = 4
G, C = (0, 0), (CHUNK, 0)
CONFIG = ModelConfig(architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=6,
                     num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=4096,
                     local_attention=(G, C, C, G, C, C))
ENGINE = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(4, 32), max_model_len=256,
              page_size=PS, num_kv_pages=120, num_decode_steps=4)


def make_llm(hybrid: bool) -> LLM:
    loaded = LoadedModel(config=CONFIG, tokenizer=dummy_tokenizer(CONFIG), name="tiny-chunked", weights=None,
                         random_seed=3)
    return LLM(engine=Engine(EngineConfig(**ENGINE, hybrid_kv_cache=hybrid), loaded=loaded))


@pytest.fixture(scope="module")
def llms() -> tuple[LLM, LLM]:
    """(the hybrid cache, every page kept)."""
    return make_llm(True), make_llm(False)


@pytest.fixture(scope="module")
def receiver() -> Engine:
    """A second hybrid engine: KV moved from the first lands here."""
    return make_llm(True).engine


def prompts(seed: int, lengths) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in lengths]


def assert_same(outs_a, outs_b) -> None:
    """Equal tokens; logprobs equal but for float32 rounding where the two engines batched a step's
    tokens differently (admission reserves fewer pages for the hybrid cache; a preempted request is
    recomputed in other steps)."""
    for a, b in zip(outs_a, outs_b):
        a, b = a.outputs[0], b.outputs[0]
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose([lp[t].logprob for lp, t in zip(a.logprobs, a.token_ids)],
                                   [lp[t].logprob for lp, t in zip(b.logprobs, b.token_ids)], rtol=0, atol=1e-5)


def test_engine_builds_the_groups(llms):
    hybrid, kept = (llm.engine for llm in llms)
    assert isinstance(hybrid.kv, HybridKVCacheManager) and isinstance(kept.kv, KVCacheManager)
    groups = hybrid.runner.rc.kv_groups
    assert (groups.page_layers, [g.kind for g in groups.groups]) == (2, ["global", "chunk 12", "chunk 12"])
    assert hybrid.runner.cache.k_pages.shape[0] == 2 and kept.runner.cache.k_pages.shape[0] == 6
    assert hybrid.pool_sizing.page_bytes * 3 == kept.pool_sizing.page_bytes
    assert "chunk 12" in hybrid.pool_sizing.describe() and "KV tokens that fit" in hybrid.pool_sizing.describe()


def test_prompts_across_chunks_bursts_and_decodes_match_every_page_kept(llms):
    """30 tokens cross two chunk boundaries in one step; 70 and 45 are prefilled in 32-token steps
    (boundaries mid-chunk, beside other rows); 48 tokens each are decoded across boundaries, in
    bursts once every row decodes."""
    hybrid, kept = llms
    ps = prompts(0, (30, 70, 5, 45))
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, logprobs=1)
    steps = hybrid.engine.stats.steps
    outs = hybrid.generate(ps, params)
    assert hybrid.engine.stats.steps - steps < sum(len(o.outputs[0].token_ids) for o in outs)  # bursts ran
    assert_same(outs, kept.generate(ps, params))
    assert hybrid.engine.kv.num_free_pages == hybrid.engine.kv.num_usable_pages


def test_preempted_requests_resume_with_the_same_tokens(llms):
    hybrid, kept = llms
    ps = prompts(1, (60, 50, 55, 40, 62))
    params = SamplingParams(max_tokens=90, temperature=0, ignore_eos=True, logprobs=1)
    before = hybrid.engine.scheduler.num_preemptions
    hybrid.engine.scheduler.growth_ratio = 0.1  # admit optimistically: the pool must run out
    outs = hybrid.generate(ps, params)
    assert hybrid.engine.scheduler.num_preemptions > before
    assert_same(outs, kept.generate(ps, params))


def test_prefix_hit_matches_a_full_prefill(llms):
    """A second prompt sharing 41 tokens: the hit ends where every group holds what the rest reads
    (the chunked groups' pages from the chunk start), so at least the chunk start is reused."""
    hybrid, kept = llms
    (shared,) = prompts(2, (41,))
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=1)
    hybrid.generate([shared + [7]], params)
    second = [shared + [9, 10, 11]]
    out = hybrid.generate(second, params)
    assert out[0].num_cached_tokens >= (41 // CHUNK) * CHUNK
    assert_same(out, kept.generate(second, params))


def test_a_long_sequence_holds_its_chunk_pages_only(llms):
    engine = llms[0].engine
    kv, groups = engine.kv, engine.runner.rc.kv_groups
    (ids,) = prompts(3, (20,))
    rid, _ = engine.add_request(ids, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    req = engine._requests[rid][0]
    most = [0] * groups.num_groups
    while engine.has_unfinished():
        engine.step()
        if req.group_pages and req.num_computed_tokens > 20:  # decoding (in bursts of up to 4 tokens)
            held = [sum(p != NULL_PAGE for p in pages) for pages in req.group_pages]
            assert held[0] == len(req.group_pages[0]) >= kv.pages_needed(req.num_computed_tokens)  # all kept
            most = [max(m, h) for m, h in zip(most, held)]
    assert most[0] >= 200 // PS
    assert 0 < most[1] == most[2] <= groups.groups[1].max_blocks(10_000, PS, engine.runner.rc.decode_steps) == 5


def test_no_page_leaks_after_500_mixed_requests_with_disconnects(llms):
    """Short and longer prompts (some prefilled over several steps), shared prefixes, tenants, n=2,
    stop tokens; a fifth are aborted: before their first step, mid-prefill or mid-stream."""
    engine = llms[0].engine
    kv = engine.kv
    rng = random.Random(0)
    base = prompts(4, (40,))[0]
    live: list[str] = []
    done = 0
    aborted = {"mid-prefill": 0, "mid-stream": 0}
    for i in range(500):
        n = rng.choice([3, 8, 20, 45, 90])
        ids = (base[:rng.choice([0, 13, 26])] + prompts(100 + i, (n,))[0])[:100]
        params = SamplingParams(max_tokens=rng.randint(1, 12), temperature=rng.choice([0.0, 1.0]), seed=i,
                                n=2 if i % 50 == 0 else 1, stop_token_ids=[rng.randrange(512)] if i % 7 == 0 else None)
        rid, _ = engine.add_request(ids, params, tenant=rng.choice([None, "a", "b"]))
        live.append(rid)
        for _ in range(rng.randint(0, 3)):
            for d in engine.step():
                if d.finish_reason is not None and d.request_id in live and d.index == 0:
                    live.remove(d.request_id)
                    done += 1
        if live and rng.random() < 0.2:
            rid = live.pop(rng.randrange(len(live)))
            req = engine._requests[rid][0]
            if req.num_computed_tokens and req.num_computed_tokens < req.num_prompt_tokens:
                aborted["mid-prefill"] += 1
            elif req.output_token_ids:
                aborted["mid-stream"] += 1
            engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    assert done > 250 and aborted["mid-prefill"] > 3 and aborted["mid-stream"] > 10
    assert engine.num_running == engine.num_waiting == 0
    assert kv.num_free_pages == kv.num_usable_pages and not any(kv.ref_cnt) and kv.pages_in_use() == [0, 0, 0]
    assert engine.compiles_since_warmup == 0


def test_metrics_report_each_groups_pages_and_the_context_that_fits(llms):
    from infire_jax.engine.async_engine import AsyncEngine
    from server.metrics import _EngineCollector

    engine = llms[0].engine
    (ids,) = prompts(5, (30,))
    rid, _ = engine.add_request(ids, SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(3):
        engine.step()
    collector = _EngineCollector()
    snapshot = AsyncEngine(engine, max_queue=1)._take_snapshot()
    collector.add("tiny", lambda: snapshot, engine.pool_sizing)
    families = {f.name: f for f in collector.collect()}
    samples = families["infire:kv_cache_group_pages_in_use"].samples
    held = {(s.labels["group"], s.labels["kind"]): s.value for s in samples}
    in_use = engine.kv.pages_in_use()
    assert held == {("0", "global"): in_use[0], ("1", "chunk 12"): in_use[1], ("2", "chunk 12"): in_use[2]}
    assert in_use[0] > in_use[1] > 0
    tokens = {s.labels["sequences"]: s.value for s in families["infire:kv_pool_context_tokens"].samples}
    # 119 usable pages: a 32-token step's 8 pages in each chunked group, 4 (12 tokens, a page more for
    # a straddling span) per sequence in each, the rest global at 4 tokens a page.
    assert tokens["1"] == (119 - 2 * 8 - 2 * 4) * PS
    assert tokens["8"] == ((119 - 16) // 8 - 8) * PS
    engine.abort(rid)
    while engine.has_unfinished():
        engine.step()


def _greedy(engine: Engine, prompt: list[int], tenant: str) -> tuple[list[int], list[float], int]:
    """Greedy tokens, their logprobs and the prefix-cache hit of one request."""
    rid, _ = engine.add_request(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1),
                                tenant=tenant)
    tokens, lps, cached = [], [], None
    while engine.has_unfinished():
        for d in engine.step():
            tokens += d.token_ids
            lps += [lp[t] for lp, t in zip(d.logprobs, d.token_ids)]
            cached = d.num_cached_tokens
    return tokens, lps, cached


def test_kv_transfer_moves_every_groups_pages(llms, receiver):
    """A 47-token prompt (four chunks of 12) prefilled on the hybrid engine A and exported: its 11 full
    pages before the last token in the global group, and in each chunked group the 2 pages from the
    chunk holding token 44 (what computing after them reads), crossing Mooncake into engine B. B
    finds the whole run cached in every group and continues exactly as A did; a receiver whose layers
    are grouped otherwise (every page kept) is refused; no page stays held on either side."""
    from infire_jax.errors import InvalidRequestError
    from infire_jax.kv_transfer.mooncake import MooncakeTransport

    a, kept, b = llms[0].engine, llms[1].engine, receiver
    (prompt,) = prompts(11, (47,))
    want, want_lp, cached = _greedy(a, prompt, "pd")
    assert cached == 0  # a full prefill: the single-engine reference
    blocks = a.export_prompt_kv(prompt, tenant="pd")
    groups = a.runner.rc.kv_groups.groups
    assert blocks.layout.groups == groups and [g.kind for g in groups] == ["global", "chunk 12", "chunk 12"]
    assert blocks.num_blocks == 11 and blocks.token_ids == prompt[:44]
    assert blocks.k.shape == (2, 11 + 2 + 2, PS, 2, 16) == blocks.v.shape

    src, dst = MooncakeTransport(1 << 20), MooncakeTransport(1 << 20)
    held = src.hold(blocks)
    region = dst.reserve(blocks.nbytes)
    dst.fetch(held, region)
    src.release(held)
    arrived = dst.received(region, b.kv_layout, blocks.token_ids, blocks.tenant)
    with pytest.raises(InvalidRequestError, match="grouped as .*chunk 12 layers .* here"):
        kept.import_prompt_kv(arrived)
    free = b.kv.num_free_pages
    assert b.import_prompt_kv(arrived) == 15
    dst.release(region)
    assert b.import_prompt_kv(blocks) == 0  # every group's pages are cached already
    assert b.kv.num_free_pages == free  # cached, unreferenced

    got, got_lp, cached = _greedy(b, prompt, "pd")
    assert cached == 44  # every full page before the last token: the hit is whole in every group
    assert got == want
    np.testing.assert_allclose(got_lp, want_lp, rtol=0, atol=1e-5)
    assert _greedy(b, prompt, "other")[2] == 0  # another tenant's chain
    for engine in (a, b, kept):
        assert engine.kv.num_free_pages == engine.kv.num_usable_pages and not any(engine.kv.pages_in_use())


def test_decode_worker_checks_a_hybrid_payloads_groups_and_bytes(llms):
    """kv_transfer_params carry the layout's groups: a decode worker whose layers are grouped otherwise
    answers 400 naming both groupings; the bytes it expects are those of each group's pages."""
    from infire_jax.engine.async_engine import AsyncEngine
    from infire_jax.kv_transfer.blocks import groups_to_json
    from server.errors import APIError
    from server.kv_handoff import KVHandoff, tokens_digest

    a, kept = llms[0].engine, llms[1].engine
    (prompt,) = prompts(12, (33,))
    _greedy(a, prompt, None)
    blocks = a.export_prompt_kv(prompt)
    assert blocks.num_blocks == 8 and blocks.k.shape[1] == 8 + 2 * 2  # the chunk from token 24: blocks 6, 7
    layout = blocks.layout
    params = {"layout": {"model": layout.model, "dtype": layout.dtype, "page_size": PS,
                         "page_shape": list(layout.page_shape), "v_page_shape": None, "kv_scales": None,
                         "groups": groups_to_json(layout.groups)},
              "num_tokens": 8 * PS, "tokens_digest": tokens_digest(prompt[:8 * PS]), "remote_engine_id": "x",
              "remote_address": 0, "num_bytes": blocks.nbytes, "lora_digest": None}

    def check(engine: Engine, changes: dict) -> int:
        handoff = KVHandoff(AsyncEngine(engine, max_queue=0), "decode", buffer_bytes=1 << 20, host="127.0.0.1",
                            hold_seconds=1.0)
        return handoff._check({**params, **changes}, prompt, None)[1]

    assert check(a, {}) == 8 * PS
    with pytest.raises(APIError, match=r"grouped as global layers \[0, 3\]; chunk 12 layers \[1, 2\]; .* on the "
                                       r"prefill worker and one group of every layer \(every page kept\) here"):
        check(kept, {})
    with pytest.raises(APIError, match="num_bytes"):
        check(a, {"num_bytes": blocks.nbytes // 12 * 8})  # a page a block: the plain pool's size
    with pytest.raises(APIError, match="layout.groups"):
        check(a, {"layout": {**params["layout"], "groups": [[12, 0]]}})


def test_bench_latency_imports_long_contexts(llms):
    """`bench latency --import-context`: each prompt's pages before its last are imported with random
    values and found cached (measure raises otherwise), so only the last page is prefilled; the chunked
    groups' KV read per decode step stays flat as the context doubles while the global group's grows;
    a pool too small for the batch's contexts says so."""
    from infire_jax.bench import latency, roofline
    from infire_jax.bench.common import BenchError

    engine = llms[0].engine
    peaks = roofline.DevicePeaks("cpu", "cpu", 1e10, 1e11, "float32", 1 << 20, 64)
    rows = {n: latency.measure(engine, peaks, batch=2, input_len=n, output_len=10, iters=1, warmup=0, seed=0,
                               import_context=True) for n in (61, 121)}
    for n, r in rows.items():  # the last token of the prompt and its page's other tokens: (n - 1) % PS + 1 each
        tail = (n - 1) % PS + 1
        assert r["prefill_flops"] == 2 * roofline.forward_flops(CONFIG, tail, n - tail)
    kv = {n: r["decode_kv_mb_per_step"] for n, r in rows.items()}
    local = {n: kv[n] * rows[n]["local_kv_share"] for n in kv}
    assert local[61] == pytest.approx(local[121]) and kv[121] - local[121] > 1.8 * (kv[61] - local[61])
    with pytest.raises(BenchError, match="cannot hold 4 x 200 tokens"):
        latency.measure(engine, peaks, batch=4, input_len=200, output_len=2, iters=1, warmup=0, seed=0,
                        import_context=True)
    assert engine.kv.num_free_pages == engine.kv.num_usable_pages


def test_http_fleet_disaggregates_with_every_groups_pages(llms, receiver):
    """Over HTTP, as the fleet runs: router -> prefill worker (the first hybrid engine) -> each group's
    pages over Mooncake -> decode worker (the second), for prompts across chunks (and one shorter than
    a page: nothing to move). Each answer equals the engine with every page kept (tokens, logprobs
    within 1e-5), the decode worker's hit is every full page before the last token in every group, and
    nothing is left held (`disaggregate_over_http`). It takes the engines over, so it comes last."""
    from server_utils import disaggregate_over_http

    cases = prompts(13, (47, 30, 3))
    want = [_greedy(llms[1].engine, p, None)[:2] for p in cases]
    disaggregate_over_http(llms[0].engine, receiver, cases, want, max_tokens=12, atol=1e-5)
