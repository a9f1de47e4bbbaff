"""The hybrid KV cache: a page allocator for models whose chunked or sliding-window layers only see part
of the context (kv_groups.py groups the layers). Pure Python: no jax here.

Every group of layers has its own page list per request (`Request.group_pages`, the null page where a
page was freed; `Request.pages` is group 0's) and its own page table on the device, and all groups
draw from one free pool, so one long conversation and many short ones both use the whole pool.

- A global group keeps every page of a sequence.
- A bounded group (chunk C or window W) frees the pages wholly before the first key that the next
  computed token sees (`KVGroup.first_block` of `num_computed_tokens`), as soon as the manager sees the
  request again (`can_allocate` / `allocate`). Freeing goes by the first token the step computes, so
  no query of the step (a prefill chunk's first token, a decode burst's first step, a verifying
  step's known token) loses a page it reads: later tokens see no earlier keys than the first.
- Pages are reference counted and published under the hash chain of kv_cache.py (the tenant salts
  the first block), per group: the prefix cache maps (group, block hash) -> page. A prefix hit of k
  blocks is taken only where every group holds what computing from token k * page_size reads: a
  global group all k blocks, a bounded group the blocks from `first_block(k * page_size)` to k.
  Otherwise the longest shorter hit that satisfies every group is taken, down to none; a hit that
  ends on a chunk boundary needs no page of the chunked group at all.

Unreferenced pages stay cached in the LRU free queues of kv_cache.py (retained ones, a stated
reusable prefix or a session's, evicted last); a freed page forgets its group when it is reused.
"""

from __future__ import annotations

from collections import OrderedDict

from infire_jax.core.kv_cache import (NULL_PAGE, KVCacheManager, PoolAccounting, block_chain, extend_block_hashes,
                                 hit_blocks)
from infire_jax.core.kv_groups import KVGroupLayout
from infire_jax.core.request import Request

PrefixHit = list[tuple[int, ...]]  # per cached block, the page of each group (NULL_PAGE: the group needs none)


class HybridKVCacheManager(PoolAccounting):
    """The interface of kv_cache.KVCacheManager (the scheduler and the engine call either), over the
    groups of `layout`. Prefix hits are lists of per-group page tuples instead of pages."""

    def __init__(self, num_pages: int, page_size: int, layout: KVGroupLayout, *,
                 enable_prefix_caching: bool = True):
        if num_pages < 2:
            raise ValueError(f"the KV pool needs at least 2 pages (one is reserved), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.layout = layout
        self.groups = layout.groups
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = [0] * num_pages
        self.page_key: list[tuple[int, bytes] | None] = [None] * num_pages  # (group, block hash) it is cached as
        self.page_group = [-1] * num_pages  # the group a referenced page belongs to
        self.cached: dict[tuple[int, bytes], int] = {}
        self._in_use = [0] * layout.num_groups  # referenced pages per group
        self._free: OrderedDict[int, None] = OrderedDict((p, None) for p in range(1, num_pages))
        self._free_retained: OrderedDict[int, None] = OrderedDict()
        self.queries = 0
        self.hits = 0

    def drop_cached(self) -> None:
        """Forgets every cached page (the pool's contents are gone); only when no request holds a page."""
        if any(self.ref_cnt):
            raise RuntimeError("cannot drop the KV cache while requests hold pages")
        self.page_key = [None] * self.num_pages
        self.page_group = [-1] * self.num_pages
        self.cached.clear()
        self._free = OrderedDict((p, None) for p in range(1, self.num_pages))
        self._free_retained.clear()

    # ---- accounting (and PoolAccounting's) -------------------------------------------------
    def pages_in_use(self) -> list[int]:
        """Pages referenced by requests, per group."""
        return list(self._in_use)

    def seq_pages(self, num_tokens: int) -> int:
        """Pages one decoding sequence of `num_tokens` holds at most, over every group."""
        return self.layout.seq_blocks(num_tokens, self.page_size)

    @staticmethod
    def held_pages(req: Request) -> int:
        """A request's pages over its groups: each group holds every block from its `group_start` on."""
        return sum(len(pages) - start for pages, start in zip(req.group_pages, req.group_start))

    # ---- pages ------------------------------------------------------------------------------
    def _take(self, page: int) -> None:
        """References a page of a known group, taking it out of a free queue if nobody held it."""
        if self.ref_cnt[page] == 0:
            del (self._free if page in self._free else self._free_retained)[page]
            self._in_use[self.page_group[page]] += 1
        self.ref_cnt[page] += 1

    def _pop_free(self, group: int) -> int:
        queue = self._free if self._free else self._free_retained
        page, _ = queue.popitem(last=False)
        key = self.page_key[page]
        if key is not None:  # evict its cached content
            if self.cached.get(key) == page:
                del self.cached[key]
            self.page_key[page] = None
        self.ref_cnt[page] = 1
        self.page_group[page] = group
        self._in_use[group] += 1
        return page

    def _release(self, page: int, retain: bool) -> None:
        """Drops one reference; an unreferenced page joins a free queue, still cached."""
        self.ref_cnt[page] -= 1
        if self.ref_cnt[page] == 0:
            self._in_use[self.page_group[page]] -= 1
            retained = retain and self.page_key[page] is not None
            (self._free_retained if retained else self._free)[page] = None

    def _retains(self, req: Request, block: int) -> bool:
        return req.session_id is not None or block < req.prefix_hint_tokens // self.page_size

    def _drop_invisible(self, req: Request) -> None:
        """Frees each bounded group's pages wholly before what the request's next token sees."""
        pos = req.num_computed_tokens
        for g, group in enumerate(self.groups):
            if not group.bounded or not req.group_pages:
                continue
            pages = req.group_pages[g]
            stop = min(group.first_block(pos, self.page_size), len(pages))
            for i in range(req.group_start[g], stop):
                if pages[i] != NULL_PAGE:
                    self._release(pages[i], self._retains(req, i))
                    pages[i] = NULL_PAGE
            req.group_start[g] = max(req.group_start[g], stop)

    # ---- prefix cache -----------------------------------------------------------------------
    def _longest_hit(self, hashes: list[bytes]) -> PrefixHit:
        """The longest run of `hashes`' blocks that every group holds what computing after it reads."""
        ps, cached = self.page_size, self.cached
        k = len(hashes)
        for g, group in enumerate(self.groups):
            if not group.bounded:
                run = 0
                while run < k and (g, hashes[run]) in cached:
                    run += 1
                k = run
        bounded = [(g, group) for g, group in enumerate(self.groups) if group.bounded]
        while k > 0:  # a miss at block j rules out every k' in (j, k]: they read block j too
            missing = None
            for g, group in bounded:
                for j in range(k - 1, group.first_block(k * ps, ps) - 1, -1):
                    if (g, hashes[j]) not in cached:
                        missing = j
                        break
                if missing is not None:
                    break
            if missing is None:
                break
            k = missing
        firsts = [group.first_block(k * ps, ps) if group.bounded else 0 for group in self.groups]
        return [tuple(cached[g, h] if i >= firsts[g] else NULL_PAGE for g in range(len(self.groups)))
                for i, h in enumerate(hashes[:k])]

    def find_cached_prefix(self, req: Request) -> PrefixHit:
        """The longest usable cached prefix of the request's tokens, leaving at least one to compute."""
        if not self.enable_prefix_caching:
            return []
        n = hit_blocks(req, self.page_size)
        extend_block_hashes(req, n * self.page_size, self.page_size)
        return self._longest_hit(req.block_hashes[:n])

    def record_query(self, num_tokens: int, num_hit: int) -> None:
        self.queries += num_tokens
        self.hits += num_hit

    def register_full_blocks(self, req: Request) -> None:
        """Publishes the request's newly completed blocks, in every group that still holds them."""
        if not self.enable_prefix_caching:
            return
        full = min(req.num_computed_tokens, req.num_tokens - req.num_pending_tokens) // self.page_size
        if full <= req.num_registered_blocks:
            return
        extend_block_hashes(req, full * self.page_size, self.page_size)
        for i in range(req.num_registered_blocks, full):
            h = req.block_hashes[i]
            for g, pages in enumerate(req.group_pages):
                page = pages[i] if i < len(pages) else NULL_PAGE
                if page != NULL_PAGE and (g, h) not in self.cached:
                    self.cached[g, h] = page
                    self.page_key[page] = (g, h)
        req.num_registered_blocks = full

    # ---- moving a prompt's pages between engines ------------------------------------------------
    def cached_block_pages(self, token_ids: list[int], salt: str | None) -> PrefixHit:
        """The longest usable cached run of `token_ids`' full blocks, per group (for export)."""
        if not self.enable_prefix_caching:
            return []
        return self._longest_hit([h for _, h in block_chain(token_ids, salt, self.page_size)])

    def import_blocks(self, token_ids: list[int], salt: str | None) -> list[tuple[int, tuple[int, ...]]]:
        """Publishes pages for the full blocks of `token_ids` that each group needs after them (a
        bounded group: those its last block's successor reads) and does not cache yet; returns (block
        index, each group's new page or NULL_PAGE) for the caller to write. As kv_cache's: pages
        taken first and released together (to the retained queue); stops at the first block the
        pool cannot hold."""
        if not self.enable_prefix_caching:
            return []
        chain = list(block_chain(token_ids, salt, self.page_size))
        end = len(chain) * self.page_size
        firsts = [group.first_block(end, self.page_size) if group.bounded else 0 for group in self.groups]
        taken, held = [], []
        for i, h in chain:
            wanted = [g for g in range(len(self.groups)) if i >= firsts[g]]
            if sum((g, h) not in self.cached for g in wanted) > self.num_free_pages:
                break
            pages = [NULL_PAGE] * len(self.groups)
            for g in wanted:
                page = self.cached.get((g, h))
                if page is not None:
                    self._take(page)
                else:
                    page = pages[g] = self._pop_free(g)
                    self.cached[g, h] = page
                    self.page_key[page] = (g, h)
                held.append(page)
            if any(p != NULL_PAGE for p in pages):
                taken.append((i, tuple(pages)))
        for page in held:
            self._release(page, retain=True)
        return taken

    # ---- allocation -------------------------------------------------------------------------
    def _init_lists(self, req: Request) -> None:
        if not req.group_pages:
            req.group_pages = [[] for _ in self.groups]
            req.group_start = [0] * len(self.groups)
            req.pages = req.group_pages[0]

    def new_pages(self, req: Request, num_new_tokens: int) -> int:
        """Pages the request lacks, over its groups, for `num_new_tokens` more tokens."""
        end = self.pages_needed(req.num_computed_tokens + num_new_tokens)
        if not req.group_pages:
            return len(self.groups) * end
        return sum(max(0, end - len(pages)) for pages in req.group_pages)

    def can_allocate(self, req: Request, num_new_tokens: int, cached_pages: PrefixHit = (), reserve: int = 0) -> bool:
        """Whether the pages fit while leaving `reserve` free (after freeing what the request no longer sees)."""
        self._drop_invisible(req)
        if cached_pages:
            end = self.pages_needed(req.num_computed_tokens + num_new_tokens)
            needed = len(self.groups) * max(0, end - len(cached_pages))
            reclaimed = sum(1 for block in cached_pages for p in block if p != NULL_PAGE and self.ref_cnt[p] == 0)
        else:
            needed, reclaimed = self.new_pages(req, num_new_tokens), 0
        return needed <= self.num_free_pages - reclaimed - reserve

    def allocate(self, req: Request, num_new_tokens: int, cached_pages: PrefixHit = (), reserve: int = 0) -> bool:
        """Gives every group of the request pages for `num_new_tokens` more tokens (after its cached
        prefix). Returns False, changing nothing but pages it could no longer see, when the pool
        cannot hold them and still keep `reserve` free."""
        if cached_pages:
            assert not req.group_pages and req.num_computed_tokens == 0
            req.num_computed_tokens = len(cached_pages) * self.page_size
        if not self.can_allocate(req, num_new_tokens, cached_pages, reserve):
            if cached_pages:
                req.num_computed_tokens = 0
            return False
        self._init_lists(req)
        if cached_pages:
            k = len(cached_pages)
            for g, group in enumerate(self.groups):
                req.group_pages[g].extend(block[g] for block in cached_pages)
                req.group_start[g] = group.first_block(k * self.page_size, self.page_size) if group.bounded else 0
            for block in cached_pages:
                for page in block:
                    if page != NULL_PAGE:
                        self._take(page)
            req.num_registered_blocks = max(req.num_registered_blocks, k)
        end = self.pages_needed(req.num_computed_tokens + num_new_tokens)
        for g, pages in enumerate(req.group_pages):
            pages.extend(self._pop_free(g) for _ in range(end - len(pages)))
        return True

    def free(self, req: Request) -> None:
        """Drops the request's references, tail blocks first (so they are evicted first)."""
        lists = req.group_pages
        for i in range(max((len(p) for p in lists), default=0) - 1, -1, -1):
            retain = self._retains(req, i)
            for pages in lists:
                if i < len(pages) and pages[i] != NULL_PAGE:
                    self._release(pages[i], retain)
        req.group_pages, req.group_start, req.pages = [], [], []
        req.num_computed_tokens = 0
        req.num_registered_blocks = 0


def kv_cache_manager(num_pages: int, page_size: int, kv_groups: KVGroupLayout | None, *,
                     enable_prefix_caching: bool = True) -> KVCacheManager | HybridKVCacheManager:
    """The engine's page allocator: the hybrid one where some group of layers frees pages, else the plain one."""
    if kv_groups is None or not kv_groups.bounded:
        return KVCacheManager(num_pages, page_size, enable_prefix_caching=enable_prefix_caching)
    return HybridKVCacheManager(num_pages, page_size, kv_groups, enable_prefix_caching=enable_prefix_caching)
