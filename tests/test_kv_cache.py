"""Page allocator, prefix cache and scheduler: pure host logic, no device."""

from __future__ import annotations

from infire_jax.core.kv_cache import KVCacheManager, block_hash
from infire_jax.core.request import Request, Status
from infire_jax.sample.sampling_params import SamplingParams
from infire_jax.core.scheduler import GROWTH_RATIO_INIT, GROWTH_RATIO_MIN, GROWTH_RATIO_STEP, Scheduler

PS = 4


def make_req(rid: str, tokens: list[int], *, max_tokens: int = 8, salt: str | None = None, priority: int = 0,
             hint: int = 0, session: str | None = None, arrival: float = 0.0) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens, seed=0,
                   cache_salt=salt, priority=priority, prefix_hint_tokens=hint, session_id=session,
                   arrival_time=arrival)


def run_prefill(kv: KVCacheManager, req: Request) -> None:
    """Admits a request, computes its whole prompt, and publishes its full pages."""
    cached = kv.find_cached_prefix(req)
    assert kv.allocate(req, req.num_tokens - len(cached) * PS, cached)
    req.num_computed_tokens = req.num_tokens
    kv.register_full_blocks(req)


def test_hash_chain_is_salted_in_first_block_only():
    a = block_hash(None, [1, 2, 3, 4], None)
    assert a != block_hash(None, [1, 2, 3, 4], "tenant-a") != block_hash(None, [1, 2, 3, 4], "tenant-b")
    assert block_hash(a, [5, 6, 7, 8], None) == block_hash(a, [5, 6, 7, 8], "ignored-after-first")
    assert block_hash(a, [5, 6, 7, 8], None) != block_hash(None, [5, 6, 7, 8], None)


def test_prefix_reuse_and_refcounts():
    kv = KVCacheManager(16, PS)
    a = make_req("a", list(range(10)))
    run_prefill(kv, a)
    assert len(a.pages) == 3 and kv.num_free_pages == 12
    b = make_req("b", list(range(10)) + [99, 98])
    cached = kv.find_cached_prefix(b)
    assert cached == a.pages[:2]  # two full pages shared; the partial third is not cached
    assert kv.allocate(b, b.num_tokens - 8, cached)
    assert kv.ref_cnt[a.pages[0]] == 2 and b.num_computed_tokens == 8
    kv.free(a)
    assert kv.ref_cnt[b.pages[0]] == 1
    kv.free(b)
    assert kv.num_free_pages == 15 and kv.usage == 0.0


def test_at_least_one_token_is_left_to_compute():
    kv = KVCacheManager(16, PS)
    a = make_req("a", list(range(8)))
    run_prefill(kv, a)
    kv.free(a)
    again = make_req("a2", list(range(8)))
    assert len(kv.find_cached_prefix(again)) == 1  # 8 tokens = 2 full pages, but the last token is recomputed


def test_tenants_never_share_pages():
    kv = KVCacheManager(32, PS)
    t1 = make_req("t1", list(range(12)), salt="alice")
    run_prefill(kv, t1)
    assert kv.find_cached_prefix(make_req("t2", list(range(12)), salt="bob")) == []
    assert kv.find_cached_prefix(make_req("t2", list(range(12)), salt=None)) == []
    assert len(kv.find_cached_prefix(make_req("t1b", list(range(12)), salt="alice"))) == 2


def test_eviction_is_lru_and_tail_first():
    kv = KVCacheManager(7, PS)  # 6 usable pages
    a = make_req("a", list(range(12)))  # 3 pages
    run_prefill(kv, a)
    pages_a = list(a.pages)
    kv.free(a)
    b = make_req("b", list(range(100, 112)))
    run_prefill(kv, b)
    kv.free(b)
    # Both are cached and free. One new page must evict a's tail page first.
    c = make_req("c", list(range(200, 203)))
    assert kv.allocate(c, 3)
    assert c.pages == [pages_a[2]]
    assert len(kv.find_cached_prefix(make_req("a2", list(range(12)) + [0]))) == 2
    assert len(kv.find_cached_prefix(make_req("b2", list(range(100, 112)) + [0]))) == 3


def test_prefix_hint_and_session_pages_are_evicted_last():
    kv = KVCacheManager(7, PS)
    hinted = make_req("h", list(range(12)), hint=8)
    run_prefill(kv, hinted)
    pages_h = list(hinted.pages)
    kv.free(hinted)
    plain = make_req("p", list(range(50, 62)))
    run_prefill(kv, plain)
    kv.free(plain)
    # Take 4 pages: the 3 plain ones and the un-hinted tail of the hinted request go first.
    big = make_req("big", list(range(300, 316)))
    assert kv.allocate(big, 16)
    assert set(pages_h[:2]).isdisjoint(big.pages)
    assert len(kv.find_cached_prefix(make_req("h2", list(range(12)) + [1]))) == 2
    kv.free(big)
    sess = make_req("s", list(range(400, 409)), session="chat-1")
    run_prefill(kv, sess)
    pages_s = list(sess.pages[:2])  # its two full, cached pages
    kv.free(sess)
    assert all(p in kv._free_retained for p in pages_s)
    assert sess.pages == [] and kv.usage == 0.0


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(4, PS)  # 3 usable pages
    a = make_req("a", list(range(8)))
    run_prefill(kv, a)
    before = (list(kv.ref_cnt), kv.num_free_pages)
    b = make_req("b", list(range(50, 62)))
    assert not kv.allocate(b, 12)
    assert (list(kv.ref_cnt), kv.num_free_pages) == before and b.pages == [] and b.num_computed_tokens == 0


# ---- scheduler --------------------------------------------------------------------------------

def step(sched: Scheduler, sampled: int = 7):
    """Plans, commits, and reports one token for every row that sampled (like the engine)."""
    out = sched.schedule()
    sched.commit(out)
    for s in out.seqs:
        if s.samples:
            s.req.num_pending_tokens -= 1
            s.req.output_token_ids.append(sampled)
            if len(s.req.output_token_ids) >= s.req.max_tokens:
                sched.finish(s.req, Status.FINISHED_LENGTH)
    return out


def test_chunked_prefill_and_decodes_share_the_budget():
    kv = KVCacheManager(64, PS)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=8)
    short = make_req("short", [1, 2, 3], max_tokens=5, arrival=0)
    long = make_req("long", list(range(20)), max_tokens=2, arrival=1)
    sched.add(short)
    sched.add(long)
    out = step(sched)
    assert [(s.req.request_id, s.num_tokens) for s in out.seqs] == [("short", 3), ("long", 5)]
    out = step(sched)  # the decode goes first, the long prompt continues in a chunk
    assert [(s.req.request_id, s.num_tokens, s.samples) for s in out.seqs] == [("short", 1, True), ("long", 7, False)]
    out = step(sched)
    assert [(s.req.request_id, s.num_tokens, s.samples) for s in out.seqs] == [("short", 1, True), ("long", 7, False)]
    out = step(sched)
    assert [(s.req.request_id, s.num_tokens, s.samples) for s in out.seqs] == [("short", 1, True), ("long", 1, True)]


def test_priority_orders_admission():
    kv = KVCacheManager(64, PS)
    sched = Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=16)
    sched.add(make_req("late-low", [1, 2], priority=5, arrival=0))
    sched.add(make_req("urgent", [3, 4], priority=-1, arrival=1))
    assert step(sched).seqs[0].req.request_id == "urgent"


def test_preemption_by_recompute_when_pages_run_out():
    kv = KVCacheManager(5, PS)  # 4 usable pages
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=32)
    sched.growth_ratio = GROWTH_RATIO_MIN  # the most optimistic admission: b is let in, and must yield later
    a = make_req("a", list(range(7)), max_tokens=6, arrival=0)
    b = make_req("b", list(range(10, 17)), max_tokens=6, arrival=1)
    sched.add(a)
    sched.add(b)
    step(sched)  # both prefilled: 2 pages each, pool full
    step(sched)  # position 7 still fits in the second page
    out = step(sched)  # position 8 needs a new page -> b (latest arrival) is preempted
    assert out.preempted == [b] and b.status is Status.WAITING and b.pages == [] and b.num_computed_tokens == 0
    assert [s.req for s in out.seqs] == [a]
    while a.status is Status.RUNNING:
        step(sched)
    # b is readmitted and recomputes prompt + its 2 generated tokens (its first page still cached).
    out = step(sched)
    re = out.seqs[0]
    assert re.req is b and (re.start, re.num_tokens) == (4, 5) and re.reset_slot and re.samples
    while not b.is_finished:
        step(sched)
    assert len(b.output_token_ids) == 6 and kv.num_free_pages == 4


def test_admission_keeps_room_for_expected_growth():
    """Same pool and requests as above, at the starting growth estimate: b (2 prompt pages, a third
    expected) does not fit beside a's expected growth, so it waits instead of being preempted."""
    kv = KVCacheManager(5, PS)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=32)
    a = make_req("a", list(range(7)), max_tokens=6, arrival=0)
    b = make_req("b", list(range(10, 17)), max_tokens=6, arrival=1)
    sched.add(a)
    sched.add(b)
    assert [s.req for s in step(sched).seqs] == [a] and b.status is Status.WAITING
    while not a.is_finished:
        assert b.status is Status.WAITING
        step(sched)
    while not b.is_finished:
        step(sched)
    assert sched.num_preemptions == 0 and len(b.output_token_ids) == 6


def test_growth_ratio_rises_on_preemption_and_decays_without():
    kv = KVCacheManager(5, PS)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=32)
    assert sched.growth_ratio == GROWTH_RATIO_INIT
    sched.growth_ratio = GROWTH_RATIO_MIN
    for r in (make_req("a", list(range(7)), max_tokens=6, arrival=0),
              make_req("b", list(range(10, 17)), max_tokens=6, arrival=1)):
        sched.add(r)
    ratios = []
    while sched.num_unfinished:
        before = sched.num_preemptions
        step(sched)
        ratios.append((sched.num_preemptions - before, sched.growth_ratio))
    bumped = [r for n, r in ratios if n]
    assert len(bumped) == 1 and abs(bumped[0] - (GROWTH_RATIO_MIN + GROWTH_RATIO_STEP)) < 1e-9
    quiet = [r for n, r in ratios[ratios.index((1, bumped[0])) + 1:]]
    assert all(x > y for x, y in zip(quiet, quiet[1:]))  # slowly back down after it


def _serve_all(sched: Scheduler, reqs: list[Request]) -> int:
    for r in reqs:
        sched.add(r)
    while sched.num_unfinished:
        step(sched)
    assert all(len(r.output_token_ids) == r.max_tokens for r in reqs)
    return sched.num_preemptions


def test_no_preemption_storm_at_high_concurrency(monkeypatch):
    """1000/1000 at concurrency 256, scaled to 100/100: 256 requests need 12,800 pages of 4 tokens at
    full length, the pool has 2,000. Admitting whatever fits now (a growth estimate of 0) preempts
    over a hundred times, as the first H100 run did; the growth estimate keeps it to a few."""
    def make():
        sched = Scheduler(KVCacheManager(2001, PS), max_num_seqs=256, max_num_batched_tokens=512)
        return sched, [make_req(f"r{i}", list(range(i, i + 100)), max_tokens=100, arrival=i) for i in range(256)]

    with monkeypatch.context() as m:
        import infire_jax.core.scheduler as scheduler

        m.setattr(scheduler, "GROWTH_RATIO_INIT", 0.0)
        m.setattr(scheduler, "GROWTH_RATIO_MIN", 0.0)
        m.setattr(scheduler, "GROWTH_RATIO_STEP", 0.0)
        greedy = _serve_all(*make())
    assert greedy > 100
    assert _serve_all(*make()) <= 20


def test_build_batch_lays_out_a_mixed_step():
    """Decodes (one from the device), a prompt chunk and padding: every array, position by position."""
    import numpy as np

    from infire_jax.runner.batch import TOKEN_OUTPUT, TOKEN_PAD, TOKEN_PROMPT, build_batch
    from infire_jax.runner.buckets import StepShape

    kv = KVCacheManager(64, PS)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=8)
    a = make_req("a", [11, 12, 13], max_tokens=4, arrival=0)
    a.params = SamplingParams(max_tokens=4, temperature=0.5, top_k=3, top_p=0.9, min_p=0.1, repetition_penalty=1.2,
                              presence_penalty=0.3, frequency_penalty=0.4, logprobs=2, min_tokens=3)
    a.seed = (7 << 32) | 5
    a.min_tokens_stop_ids = (2, 9)
    b = make_req("b", list(range(20, 30)), max_tokens=2, arrival=1)
    sched.add(a)
    sched.add(b)
    step(sched)  # a's prompt (3) and b's first chunk (5)
    out = sched.schedule()  # a decodes its sampled token; b continues with a chunk of 5 (positions 5-9)
    sched.commit(out)
    assert [(s.req, s.start, s.num_tokens) for s in out.seqs] == [(a, 3, 1), (b, 5, 5)]
    batch = build_batch(out, StepShape(8, 4), page_size=PS, pages_per_seq=4, dummy_slot=4)
    m = batch.meta
    np.testing.assert_array_equal(batch.token_ids, [7, 25, 26, 27, 28, 29, 0, 0])  # a's token 7 was read back
    np.testing.assert_array_equal(batch.from_device, [False] * 8)
    np.testing.assert_array_equal(batch.token_kind, [TOKEN_OUTPUT] + [TOKEN_PROMPT] * 5 + [TOKEN_PAD] * 2)
    np.testing.assert_array_equal(m.positions, [3, 5, 6, 7, 8, 9, 0, 0])
    pa, pb = a.pages, b.pages
    want_slots = [pa[0] * PS + 3] + [pb[p // PS] * PS + p % PS for p in range(5, 10)] + [2, 3]  # padding: null page
    np.testing.assert_array_equal(m.slot_mapping, want_slots)
    np.testing.assert_array_equal(m.seq_ids, [0, 1, 1, 1, 1, 1, 4, 4])
    np.testing.assert_array_equal(m.page_table, [pa + [0] * (4 - len(pa)), pb + [0] * (4 - len(pb)), [0] * 4, [0] * 4])
    np.testing.assert_array_equal(m.kv_lens, [4, 10, 0, 0])
    np.testing.assert_array_equal(m.cu_q_lens, [0, 1, 6, 6, 6])
    assert int(m.num_seqs) == 2
    np.testing.assert_array_equal(batch.logits_indices, [0, 5, 0, 0])
    np.testing.assert_array_equal(batch.row_slots, [a.slot, b.slot, 4, 4])
    np.testing.assert_array_equal(batch.reset_rows, [False] * 4)
    np.testing.assert_array_equal(batch.sample_rows, [True, True, False, False])
    sp = batch.sampling
    np.testing.assert_allclose(sp.temperature, [0.5, 1, 0, 0])  # b: the OpenAI default
    np.testing.assert_array_equal(sp.top_k, [3, 0, 0, 0])
    np.testing.assert_allclose(sp.top_p, [0.9, 1, 1, 1])
    np.testing.assert_allclose(sp.min_p, [0.1, 0, 0, 0])
    np.testing.assert_allclose(sp.repetition_penalty, [1.2, 1, 1, 1])
    np.testing.assert_allclose(sp.presence_penalty, [0.3, 0, 0, 0])
    np.testing.assert_allclose(sp.frequency_penalty, [0.4, 0, 0, 0])
    np.testing.assert_array_equal(sp.seed, [[5, 7], [0, 0], [0, 0], [0, 0]])
    np.testing.assert_array_equal(sp.step, [1, 0, 0, 0])
    np.testing.assert_array_equal(sp.want_logprobs, [True, False, False, False])
    assert sp.suppress_ids.shape[0] == 4 and list(sp.suppress_ids[0, :2]) == [2, 9] and (sp.suppress_ids[1:] == -1).all()
    assert sp.temperature.dtype == np.float32 and sp.seed.dtype == np.uint32 and m.kv_lens.dtype == np.int32


def test_import_blocks_publishes_a_prefix_and_never_evicts_its_own_pages():
    kv = KVCacheManager(4, PS)  # 3 usable pages
    tokens = list(range(5 * PS))  # 5 full blocks: only the first 3 find a page
    taken = kv.import_blocks(tokens, "t")
    assert [i for i, _ in taken] == [0, 1, 2] and len({p for _, p in taken}) == 3
    assert kv.cached_block_pages(tokens, "t") == [p for _, p in taken]
    assert kv.cached_block_pages(tokens, None) == []  # the chain is salted with the tenant
    assert kv.num_free_pages == 3 and kv.usage == 0  # cached, unreferenced, evictable
    assert kv.import_blocks(tokens[:3 * PS], "t") == []  # already there
    req = make_req("r", tokens[:3 * PS] + [7], salt="t")
    assert kv.find_cached_prefix(req) == [p for _, p in taken]  # a request finds them like any cached prefix


def test_import_blocks_keeps_the_cached_part_of_its_own_chain():
    """Block 0 is cached already and sits first in the LRU queue; importing blocks 1 and 2 into a full
    pool must evict other pages, not block 0, or the imported chain would start with a hole."""
    kv = KVCacheManager(4, PS)  # 3 usable pages
    tokens = list(range(3 * PS))
    first = kv.import_blocks(tokens[:PS], "t")
    other = kv.import_blocks([9] * 2 * PS, "u")  # fills the pool
    assert kv.num_free_pages == 3 and len(first) == 1 and len(other) == 2
    taken = kv.import_blocks(tokens, "t")
    assert [i for i, _ in taken] == [1, 2]
    assert kv.cached_block_pages(tokens, "t") == [first[0][1]] + [p for _, p in taken]
    assert kv.cached_block_pages([9] * 2 * PS, "u") == []  # the other tenant's pages were the ones evicted


def test_build_batch_arrays_are_never_64_bit():
    """The step programs are compiled for 32-bit arguments (jax without x64): a 64-bit array of a
    batch (a verifying step's logits indices were int64) misses the executable cache's argument
    check on every start, which then compiles the program again."""
    import jax
    import numpy as np

    from infire_jax.core.scheduler import SchedulerOutput
    from infire_jax.runner.batch import build_batch
    from infire_jax.runner.buckets import StepShape

    for num_spec in (0, 3):
        batch = build_batch(SchedulerOutput([], []), StepShape(8, 4), page_size=PS, pages_per_seq=4, dummy_slot=4,
                            num_spec=num_spec, lora=True)
        wide = [str(x.dtype) for x in jax.tree.leaves(batch) if np.asarray(x).dtype.itemsize == 8]
        assert not wide, (num_spec, wide)
