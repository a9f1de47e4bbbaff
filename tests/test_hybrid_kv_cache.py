"""The hybrid KV cache on the host (core/kv_groups.py, core/hybrid_kv_cache.py): the group layout, pages freed as
sequences cross chunk boundaries and windows slide, prefix hits per group, tenants, preemption and the
page accounting. Pure host logic, no device."""

from __future__ import annotations

from collections import Counter

import pytest

from infire_jax.core.hybrid_kv_cache import HybridKVCacheManager
from infire_jax.core.kv_cache import NULL_PAGE
from infire_jax.core.kv_groups import KVGroup, KVGroupLayout, choose_page_layers
from infire_jax.core.request import Request, Status
from infire_jax.sample.sampling_params import SamplingParams
from infire_jax.core.scheduler import Scheduler

PS = 4
GLOBAL, CHUNK, WINDOW = (0, 0), (16, 0), (0, 6)


def make_req(rid: str, tokens: list[int], *, max_tokens: int = 8, salt: str | None = None,
             arrival: float = 0.0) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens, seed=0,
                   cache_salt=salt, arrival_time=arrival)


def manager(num_pages: int, *kinds: tuple[int, int]) -> HybridKVCacheManager:
    return HybridKVCacheManager(num_pages, PS, KVGroupLayout.of(list(kinds), len(kinds)))


def check_accounting(kv: HybridKVCacheManager, reqs: list[Request]) -> None:
    """Every reference belongs to a request's page list, and every page is either held or free."""
    refs = Counter(p for r in reqs for pages in r.group_pages for p in pages if p != NULL_PAGE)
    assert [kv.ref_cnt[p] for p in range(1, kv.num_pages)] == [refs.get(p, 0) for p in range(1, kv.num_pages)]
    assert sum(kv.pages_in_use()) + kv.num_free_pages == kv.num_usable_pages
    held = Counter(kv.page_group[p] for p in refs)
    assert kv.pages_in_use() == [held.get(g, 0) for g in range(kv.layout.num_groups)]
    for r in reqs:  # a group holds every block from its start on, none before
        assert kv.held_pages(r) == sum(p != NULL_PAGE for pages in r.group_pages for p in pages)
        assert all(p == NULL_PAGE for pages, start in zip(r.group_pages, r.group_start) for p in pages[:start])


def compute(kv: HybridKVCacheManager, req: Request, n: int, cached=()) -> None:
    """One step of n tokens for the request: pages, then its KV counts as computed and is published;
    a step reaching the last known token samples the next."""
    assert kv.allocate(req, n, cached)
    req.num_computed_tokens += n
    if req.num_computed_tokens == req.num_tokens:
        req.output_token_ids.append(7)
    kv.register_full_blocks(req)


def live(pages: list[int]) -> list[int]:
    return [i for i, p in enumerate(pages) if p != NULL_PAGE]


# ---- the layout --------------------------------------------------------------------------------

def test_layout_groups_equal_sizes_by_kind():
    scout = [GLOBAL if (i + 1) % 4 == 0 else (8192, 0) for i in range(48)]  # every 4th layer global
    lay = KVGroupLayout.of(scout, 48)
    assert (lay.page_layers, lay.num_groups, lay.padding_layers) == (12, 4, 0)
    assert [g.bounded for g in lay.groups] == [False, True, True, True]
    assert lay.groups[0].layers == tuple(range(3, 48, 4))
    table = lay.layer_table()
    for g, group in enumerate(lay.groups):
        for index, layer in enumerate(group.layers):
            assert tuple(table[layer]) == (index, g)
    qwen = KVGroupLayout.of([GLOBAL] * 21 + [(0, 4096)] * 7, 28)  # max_window_layers=21
    assert (qwen.page_layers, qwen.num_groups, qwen.padding_layers) == (7, 4, 0)
    # 7 global and 4 window layers: s = 1 would make 11 groups; 4 layers a page pads one.
    odd = KVGroupLayout.of([GLOBAL] * 7 + [WINDOW] * 4, 11)
    assert (odd.page_layers, odd.num_groups, odd.padding_layers) == (4, 3, 1) and choose_page_layers([7, 4], 8) == 4
    assert sorted(int(x) for x in odd.layer_table()[:, 1]) == [0] * 4 + [1] * 3 + [2] * 4
    for plain in (KVGroupLayout.of([], 5), KVGroupLayout.of([CHUNK] * 5, 5, hybrid=False)):
        assert plain == KVGroupLayout.single(5) and not plain.bounded and plain.page_layers == 5
    assert KVGroupLayout.of([WINDOW] * 3, 3).groups == (KVGroup(0, 6, (0, 1, 2)),)


def test_pipeline_layout_keeps_each_stages_layers_in_its_share_of_a_page():
    """On pp stages a page's indices split like the layers: a group holds at stage k's indices stage k's
    layers only, and a layer's table row gives its index within its stage's share."""
    from sharding.plan import spread_layers

    slots = spread_layers([WINDOW, WINDOW, GLOBAL, GLOBAL, WINDOW], (2, 3))  # stages of 2 and 3 layers, 3 slots each
    assert slots == (WINDOW, WINDOW, WINDOW, GLOBAL, GLOBAL, WINDOW)  # stage 0's padding slot beside its layers
    # (global, window) layers per stage: (0, 3) and (2, 1). One layer a stage a page pads 4 places in 5
    # groups; two pad 6 (1 + 2 groups of 4 places), three 6 too.
    lay = KVGroupLayout.of(slots, 6, stages=2)
    assert lay.groups == (KVGroup(*GLOBAL, (-1, 3)), KVGroup(*GLOBAL, (-1, 4)), KVGroup(*WINDOW, (0, 5)),
                          KVGroup(*WINDOW, (1,)), KVGroup(*WINDOW, (2,)))
    assert (lay.page_layers, lay.padding_layers) == (2, 4) and choose_page_layers([(0, 2), (3, 1)], 8) == 1
    assert lay.layer_table().tolist() == [[0, 2], [0, 3], [0, 4], [0, 0], [0, 1], [0, 2]]
    assert KVGroupLayout.of(slots, 6, stages=2, max_groups=4).page_layers == 6  # padding 6 either way: 2 groups
    assert KVGroupLayout.of(slots, 6, stages=1).groups == (KVGroup(*GLOBAL, (3, 4)), KVGroup(*WINDOW, (0, 1)),
                                                           KVGroup(*WINDOW, (2, 5)))
    alternating = KVGroupLayout.of([GLOBAL, WINDOW] * 4, 8, stages=2)  # no padding: one global, one window group
    assert (alternating.page_layers, alternating.num_groups, alternating.padding_layers) == (4, 2, 0)
    assert alternating.layer_table().tolist() == [[0, 0], [0, 1], [1, 0], [1, 1]] * 2
    with pytest.raises(ValueError, match="equal pipeline stages"):
        KVGroupLayout.of(slots, 6, stages=4)


def test_first_visible_matches_the_kernels_mask():
    import jax.numpy as jnp

    from pallas_kernels.metadata import LocalMask, first_visible

    pos = list(range(0, 70))
    for c, w in ((16, 0), (0, 6), (12, 5), (0, 0)):
        want = first_visible(LocalMask(jnp.int32(c), jnp.int32(w)), jnp.asarray(pos, jnp.int32)).tolist()
        assert [KVGroup(c, w, ()).first_visible(p) for p in pos] == want


# ---- pages freed as a sequence moves on ---------------------------------------------------------

def test_chunked_group_frees_pages_behind_each_chunk_boundary():
    kv = manager(64, GLOBAL, CHUNK)
    a = make_req("a", list(range(20)), max_tokens=64)
    compute(kv, a, 10)  # a chunked prefill: the second part starts mid-chunk at 10
    assert [len(p) for p in a.group_pages] == [3, 3]
    compute(kv, a, 10)  # first token 10 sees from 0: nothing freed yet
    assert live(a.group_pages[1]) == [0, 1, 2, 3, 4]
    check_accounting(kv, [a])
    compute(kv, a, 1)  # position 20 sees from 16 = block 4: blocks 0-3 go
    assert live(a.group_pages[0]) == list(range(6)) and live(a.group_pages[1]) == [4, 5]
    assert a.pages is a.group_pages[0]
    check_accounting(kv, [a])
    for _ in range(11):  # decode up to position 31, still chunk 16..31
        compute(kv, a, 1)
    assert live(a.group_pages[1]) == [4, 5, 6, 7]
    compute(kv, a, 1)  # position 32: a new chunk, the old one's pages go
    assert live(a.group_pages[1]) == [8]
    check_accounting(kv, [a])
    kv.free(a)
    assert kv.num_free_pages == kv.num_usable_pages and not any(kv.ref_cnt)


def test_prompt_crossing_several_chunks_in_one_step_keeps_every_page_of_the_step():
    kv = manager(64, GLOBAL, CHUNK)
    a = make_req("a", list(range(50)), max_tokens=8)
    assert kv.new_pages(a, 50) == 2 * 13
    compute(kv, a, 50)  # its queries read back to 0, 16, 32 and 48: the step holds all 13 blocks
    assert live(a.group_pages[1]) == list(range(13))
    assert kv.can_allocate(a, 1)  # the next token (50) sees from 48: blocks 0-11 go
    assert live(a.group_pages[1]) == [12]
    check_accounting(kv, [a])


def test_window_group_keeps_the_pages_of_the_last_w_tokens():
    kv = manager(64, WINDOW, GLOBAL)  # the global kind comes first whatever the layer order
    assert [g.kind for g in kv.groups] == ["global", "window 6"]
    a = make_req("a", list(range(9)), max_tokens=64)
    compute(kv, a, 9)
    for pos in range(9, 40):
        compute(kv, a, 1)  # the query at `pos` saw keys pos-5 .. pos
        first = max(0, pos - 5) // PS
        assert live(a.group_pages[1]) == list(range(first, pos // PS + 1)), pos
        assert len(live(a.group_pages[1])) <= kv.groups[1].max_blocks(pos + 1, PS)
    check_accounting(kv, [a])


def test_a_long_sequence_holds_a_bounded_number_of_chunk_pages():
    kv = manager(400, GLOBAL, CHUNK)
    a = make_req("a", list(range(5)), max_tokens=1000)
    compute(kv, a, 5)
    most = 0
    for _ in range(600):
        compute(kv, a, 1)
        most = max(most, len(live(a.group_pages[1])))
    assert len(live(a.group_pages[0])) == kv.pages_needed(605)
    # A chunk on page boundaries: 4 pages at most (the bound's one more is for a window's straddling span).
    assert most == 16 // PS == kv.groups[1].max_blocks(10_000, PS) - 1
    assert kv.seq_pages(605) == kv.pages_needed(605) + kv.groups[1].max_blocks(605, PS)


def test_a_burst_or_verifying_step_frees_by_its_first_token():
    """A step of several tokens (a burst's pages are given up front) frees only what its first token
    no longer sees: the burst's later tokens see no earlier keys."""
    kv = manager(64, GLOBAL, CHUNK)
    a = make_req("a", list(range(14)), max_tokens=64)
    compute(kv, a, 14)
    assert kv.allocate(a, 4)  # positions 14..17 in one launch: 14 still sees from 0
    assert live(a.group_pages[1]) == [0, 1, 2, 3, 4]


# ---- prefix hits, per group ---------------------------------------------------------------------

def evict_all_free_pages(kv: HybridKVCacheManager) -> None:
    """Another tenant's long prompt takes every free page, then gives them back: what was cached is gone."""
    pages = kv.num_free_pages
    assert pages % kv.layout.num_groups == 0
    hog = make_req("hog", list(range(10_000, 10_000 + PS * pages)), salt="other")
    assert kv.allocate(hog, PS * (pages // kv.layout.num_groups)) and kv.num_free_pages == 0
    kv.free(hog)


def test_hit_needs_every_page_its_chunk_group_reads():
    kv = manager(49, GLOBAL, CHUNK)
    a = make_req("a", list(range(40)), max_tokens=64)
    compute(kv, a, 40)
    compute(kv, a, 1)  # at 40: chunk blocks 0-7 are freed (still cached until evicted)
    # While cached, a copy of 30 tokens takes 7 blocks: the chunk group's 4..6 are found.
    b = make_req("b", list(range(30)) + [99])
    hit = kv.find_cached_prefix(b)
    assert len(hit) == 7 and [blk[1] == NULL_PAGE for blk in hit] == [True] * 4 + [False] * 3
    evict_all_free_pages(kv)
    # Now the chunk group lacks blocks 4..6: the hit falls back to the chunk's start (16 tokens),
    # where the chunk group reads nothing before the first token to compute.
    hit = kv.find_cached_prefix(b)
    assert len(hit) == 4 and all(blk[1] == NULL_PAGE for blk in hit)
    assert [blk[0] for blk in hit] == a.group_pages[0][:4]
    compute(kv, b, b.num_tokens - 16, hit)
    assert b.num_computed_tokens == 31 and live(b.group_pages[1]) == [4, 5, 6, 7]
    assert b.group_pages[0][:4] == a.group_pages[0][:4] and kv.ref_cnt[a.group_pages[0][0]] == 2
    check_accounting(kv, [a, b])
    # In the first chunk nothing is left to fall back on: no hit at all.
    c = make_req("c", list(range(12)) + [98])
    assert kv.find_cached_prefix(c) == []


def test_partial_hit_where_the_global_run_is_longer_than_a_window_allows():
    kv = manager(64, GLOBAL, WINDOW)
    a = make_req("a", list(range(33)), max_tokens=4)
    compute(kv, a, 33)
    kv.free(a)
    b = make_req("b", list(range(33)) + [5])
    assert len(kv.find_cached_prefix(b)) == 8  # everything cached: all 8 full blocks
    # Evict the window group's block 6 only (a page at the tail of the free queue goes first).
    victim = kv.cached[1, b.block_hashes[6]]
    kv._free.move_to_end(victim, last=False)
    taker = make_req("t", [1, 2, 3], salt="x")
    assert kv.allocate(taker, 1) and taker.group_pages[0][0] == victim
    # k = 8 reads window blocks 6, 7 (from 27); k = 7 reads 5, 6 (from 23): both need block 6. k = 6 reads
    # from 19 = block 4, held: a shorter hit.
    hit = kv.find_cached_prefix(b)
    assert len(hit) == 6 and [blk[1] != NULL_PAGE for blk in hit] == [False] * 4 + [True] * 2
    check_accounting(kv, [taker])


def test_tenants_stay_apart():
    kv = manager(64, GLOBAL, CHUNK)
    a = make_req("a", list(range(20)), salt="alice")
    compute(kv, a, 20)
    assert kv.find_cached_prefix(make_req("b", list(range(20)) + [1], salt="bob")) == []
    assert kv.find_cached_prefix(make_req("c", list(range(20)) + [1])) == []
    assert len(kv.find_cached_prefix(make_req("d", list(range(20)) + [1], salt="alice"))) == 5


def test_allocation_failure_changes_nothing_but_invisible_pages():
    kv = manager(12, GLOBAL, CHUNK)  # 11 usable
    a = make_req("a", list(range(18)), max_tokens=64)
    compute(kv, a, 18)  # 5 + 5 pages
    before = (list(kv.ref_cnt), kv.num_free_pages)
    b = make_req("b", list(range(50, 62)))
    assert not kv.allocate(b, 12)
    assert (list(kv.ref_cnt), kv.num_free_pages) == before and b.group_pages == [] and b.num_computed_tokens == 0
    # a's next token (18) sees from 16: its chunk blocks 0-3 are freed on asking, even when refused.
    assert not kv.can_allocate(a, 4, reserve=10) and kv.num_free_pages == 5


# ---- the manager under the scheduler --------------------------------------------------------------

def step(sched: Scheduler) -> None:
    out = sched.schedule()
    sched.commit(out)
    for s in out.seqs:
        if s.samples:
            s.req.num_pending_tokens -= s.num_steps
            s.req.output_token_ids.extend([7] * s.num_steps)
            if len(s.req.output_token_ids) >= s.req.max_tokens:
                sched.finish(s.req, Status.FINISHED_LENGTH)


def test_preemption_frees_every_group_and_the_request_resumes():
    kv = manager(13, GLOBAL, CHUNK)  # 12 usable pages
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=32, num_decode_steps=1)
    sched.growth_ratio = 0.1
    a = make_req("a", list(range(7)), max_tokens=20, arrival=0)
    b = make_req("b", list(range(10, 17)), max_tokens=20, arrival=1)
    sched.add(a)
    sched.add(b)
    for _ in range(40):
        step(sched)
        check_accounting(kv, sched.running)
        if sched.num_preemptions:
            break
    assert b.status is Status.WAITING and b.group_pages == [] and b.num_computed_tokens == 0
    while sched.num_unfinished:
        step(sched)
        check_accounting(kv, sched.running)
    assert len(a.output_token_ids) == len(b.output_token_ids) == 20
    assert kv.num_free_pages == kv.num_usable_pages and kv.pages_in_use() == [0, 0]


def test_reservations_count_a_bounded_group_by_its_chunk():
    """Admission reserves what each sequence is expected to hold: a chunked group's few pages, not a
    second copy of the whole context."""
    kv = manager(200, GLOBAL, CHUNK)
    assert kv.seq_pages(400) == 100 + 5
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
    reqs = [make_req(f"r{i}", list(range(100 * i, 100 * i + 8)), max_tokens=300, arrival=i) for i in range(3)]
    for r in reqs:
        sched.add(r)
    step(sched)
    # Expected: 8 + 0.5 * 300 = 158 tokens, 40 global pages + 5 chunk pages each: three fit in 199
    # pages beside each other (with a copy of the context per group, two would not).
    assert len(sched.running) == 3


def test_kv_transfer_blocks_follow_the_hit_rule():
    kv = manager(64, GLOBAL, CHUNK)
    ids = list(range(36))
    a = make_req("a", ids)
    compute(kv, a, 36)
    exported = kv.cached_block_pages(ids, None)
    assert len(exported) == 9 and [b[1] != NULL_PAGE for b in exported] == [False] * 8 + [True]
    other = manager(64, GLOBAL, CHUNK)
    written = other.import_blocks(ids, None)
    assert [i for i, _ in written] == list(range(9))
    assert [pages[1] != NULL_PAGE for _, pages in written] == [False] * 8 + [True]
    assert not any(other.ref_cnt) and other.num_free_pages == other.num_usable_pages
    hit = other.find_cached_prefix(make_req("b", ids + [3]))
    assert len(hit) == 9 and [p for p, _ in hit] == [pages[0] for _, pages in written]
    assert other.import_blocks(ids, None) == []  # already cached


@pytest.mark.parametrize("kinds", [(GLOBAL, CHUNK), (WINDOW,), (GLOBAL, GLOBAL, WINDOW, (8, 3))])
def test_random_traffic_leaves_no_page_behind(kinds):
    import random

    rng = random.Random(0)
    kv = HybridKVCacheManager(40, PS, KVGroupLayout.of(list(kinds), len(kinds)))
    sched = Scheduler(kv, max_num_seqs=6, max_num_batched_tokens=24, num_decode_steps=3)
    for i in range(120):
        base = rng.choice([0, 1000, 2000])
        sched.add(make_req(f"r{i}", list(range(base, base + rng.randint(1, 30))), max_tokens=rng.randint(1, 25),
                           salt=rng.choice([None, "t"]), arrival=i))
        for _ in range(rng.randint(0, 3)):
            step(sched)
            check_accounting(kv, sched.running)
        if sched.running and rng.random() < 0.2:  # a disconnect
            sched.finish(rng.choice(sched.running), Status.FINISHED_ABORTED)
    while sched.num_unfinished:
        step(sched)
    check_accounting(kv, [])
    assert kv.num_free_pages == kv.num_usable_pages and not any(kv.ref_cnt)
