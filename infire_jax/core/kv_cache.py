"""Host-side page allocator with prefix caching. Pure Python: no jax here.

Pages are reference counted. A full page is published under a hash chain over its tokens, salted
with the tenant in the first block, so a request can reuse the KV of an earlier request's equal
prefix but never another tenant's. Pages nobody references stay cached in an LRU free queue
until they are reused. Pages a request asked to retain (a stated reusable prefix, or a session's
pages) go to a second queue that is evicted only when the first is empty.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from infire_jax.core.request import Request

NULL_PAGE = 0  # never allocated: padding tokens write there (same constant as pallas_kernels)


def block_hash(parent: bytes | None, tokens, salt: str | None) -> bytes:
    """Hash of one full block given its parent's hash; the salt enters the first block only."""
    h = hashlib.sha256()
    if parent is None:
        h.update(b"\x00" if salt is None else b"\x01" + salt.encode())
    else:
        h.update(parent)
    h.update(np.asarray(tokens, np.int64).tobytes())
    return h.digest()


def extend_block_hashes(req: Request, num_tokens: int, page_size: int) -> None:
    """Grows `req.block_hashes` to the full blocks of its first `num_tokens` tokens (slices only: no
    whole-token list per step)."""
    for i in range(len(req.block_hashes), num_tokens // page_size):
        parent = req.block_hashes[-1] if i else None
        req.block_hashes.append(block_hash(parent, req.token_slice(i * page_size, page_size), req.cache_salt))


def block_chain(token_ids: list[int], salt: str | None, page_size: int):
    """(index, hash) of each full block of `token_ids`, down the salted chain."""
    parent = None
    for i in range(len(token_ids) // page_size):
        parent = block_hash(parent, token_ids[i * page_size:(i + 1) * page_size], salt)
        yield i, parent


def hit_blocks(req: Request, page_size: int) -> int:
    """Most full blocks a prefix hit may cover: all but the token the step needs logits for, and for a
    request scoring its prompt (prompt logprobs, an embedding of every position) only the positions
    already scored."""
    n = (req.num_tokens - 1) // page_size
    first = req.first_unscored
    return n if first is None else min(n, first // page_size)


class PoolAccounting:
    """The page counts both KV managers (this one and hybrid_kv_cache.py's) report, from their free
    queues: page 0 is the null page, never handed out."""

    num_pages: int
    page_size: int

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        return len(self._free) + len(self._free_retained)

    @property
    def usage(self) -> float:
        """Fraction of usable pages referenced by requests (cached-but-free pages count as free)."""
        return 1.0 - self.num_free_pages / self.num_usable_pages

    def pages_needed(self, num_tokens: int) -> int:
        """Blocks of `num_tokens` tokens (per group)."""
        return -(-num_tokens // self.page_size)


class KVCacheManager(PoolAccounting):
    def __init__(self, num_pages: int, page_size: int, *, enable_prefix_caching: bool = True):
        if num_pages < 2:
            raise ValueError(f"the KV pool needs at least 2 pages (one is reserved), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = [0] * num_pages
        self.page_hash: list[bytes | None] = [None] * num_pages
        self.cached: dict[bytes, int] = {}  # block hash -> page holding it
        self._free: OrderedDict[int, None] = OrderedDict((p, None) for p in range(1, num_pages))
        self._free_retained: OrderedDict[int, None] = OrderedDict()
        self.queries = 0  # prompt tokens looked up in the prefix cache
        self.hits = 0  # of which found

    def drop_cached(self) -> None:
        """Forgets every cached page: the pool's contents are gone (its model left the device).
        Only when no request holds a page."""
        if any(self.ref_cnt):
            raise RuntimeError("cannot drop the KV cache while requests hold pages")
        self.page_hash = [None] * self.num_pages
        self.cached.clear()
        self._free = OrderedDict((p, None) for p in range(1, self.num_pages))
        self._free_retained.clear()

    # ---- accounting: PoolAccounting ---------------------------------------------------------

    def seq_pages(self, num_tokens: int) -> int:
        """Pages one sequence of `num_tokens` holds (hybrid_kv_cache.py's bounds some groups)."""
        return self.pages_needed(num_tokens)

    @staticmethod
    def held_pages(req: Request) -> int:
        return len(req.pages)

    def pages_in_use(self) -> list[int]:
        """Pages referenced by requests, per group (one group here)."""
        return [self.num_usable_pages - self.num_free_pages]

    # ---- prefix cache -----------------------------------------------------------------------
    def find_cached_prefix(self, req: Request) -> list[int]:
        """Pages holding the longest cached prefix of the request's tokens.

        At least one token is left to compute, since the step needs its logits.
        """
        if not self.enable_prefix_caching:
            return []
        n = hit_blocks(req, self.page_size)
        extend_block_hashes(req, n * self.page_size, self.page_size)
        pages = []
        for h in req.block_hashes[:n]:
            page = self.cached.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def record_query(self, num_tokens: int, num_hit: int) -> None:
        self.queries += num_tokens
        self.hits += num_hit

    def register_full_blocks(self, req: Request) -> None:
        """Publishes the request's newly completed pages so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        full = min(req.num_computed_tokens, req.num_tokens - req.num_pending_tokens) // self.page_size
        if full <= req.num_registered_blocks:
            return
        extend_block_hashes(req, full * self.page_size, self.page_size)
        for i in range(req.num_registered_blocks, full):
            h, page = req.block_hashes[i], req.pages[i]
            if h not in self.cached:
                self.cached[h] = page
                self.page_hash[page] = h
        req.num_registered_blocks = full

    # ---- moving a prompt's pages between engines ------------------------------------------------
    def cached_block_pages(self, token_ids: list[int], salt: str | None) -> list[int]:
        """Pages of the longest cached run of `token_ids`' full blocks (none held back: this is for export)."""
        pages = []
        for _, h in block_chain(token_ids, salt, self.page_size) if self.enable_prefix_caching else ():
            if h not in self.cached:
                break
            pages.append(self.cached[h])
        return pages

    def import_blocks(self, token_ids: list[int], salt: str | None) -> list[tuple[int, int]]:
        """Publishes pages for those full blocks of `token_ids` that are not cached yet, under the hash
        chain computed here, and returns (block index, page) for each: the caller writes their KV now.

        The pages are taken first and released together, so a long import never evicts its own
        blocks; they end up unreferenced in the retained queue (evicted last), like a session's.
        Stops at the first block the pool has no page for: later blocks would be unreachable.
        """
        if not self.enable_prefix_caching:
            return []
        taken, held = [], []
        for i, h in block_chain(token_ids, salt, self.page_size):
            page = self.cached.get(h)
            if page is not None:
                self._take(page)  # held too, so a later block of this import cannot evict it
            elif self.num_free_pages:
                page = self._pop_free()
                self.cached[h] = page
                self.page_hash[page] = h
                taken.append((i, page))
            else:
                break
            held.append(page)
        for page in held:
            self.ref_cnt[page] -= 1
            if self.ref_cnt[page] == 0:
                self._free_retained[page] = None
        return taken

    # ---- allocation -------------------------------------------------------------------------
    def _take(self, page: int) -> None:
        """References a page, taking it out of a free queue if nobody held it."""
        if self.ref_cnt[page] == 0:
            queue = self._free if page in self._free else self._free_retained
            del queue[page]
        self.ref_cnt[page] += 1

    def _pop_free(self) -> int:
        queue = self._free if self._free else self._free_retained
        page, _ = queue.popitem(last=False)
        h = self.page_hash[page]
        if h is not None:  # evict its cached content
            if self.cached.get(h) == page:
                del self.cached[h]
            self.page_hash[page] = None
        self.ref_cnt[page] = 1
        return page

    def new_pages(self, req: Request, num_new_tokens: int) -> int:
        """Pages the request lacks for `num_new_tokens` more tokens."""
        return max(0, self.pages_needed(req.num_computed_tokens + num_new_tokens) - len(req.pages))

    def can_allocate(self, req: Request, num_new_tokens: int, cached_pages: list[int] = (), reserve: int = 0) -> bool:
        """Whether the pages fit while leaving `reserve` pages free (a prefix hit's pages are not new ones:
        those no one holds only leave the free queue, as hybrid_kv_cache.py counts them)."""
        needed = self.new_pages(req, num_new_tokens) - len(cached_pages)
        reclaimed = sum(1 for p in cached_pages if self.ref_cnt[p] == 0)
        return needed <= self.num_free_pages - reclaimed - reserve

    def allocate(self, req: Request, num_new_tokens: int, cached_pages: list[int] = (), reserve: int = 0) -> bool:
        """Gives the request pages for `num_new_tokens` more tokens (after its cached prefix).

        Returns False, changing nothing, when the pool cannot hold them and still keep `reserve` free.
        """
        if cached_pages:
            assert not req.pages and req.num_computed_tokens == 0
            req.num_computed_tokens = len(cached_pages) * self.page_size
        if not self.can_allocate(req, num_new_tokens, cached_pages, reserve):
            if cached_pages:
                req.num_computed_tokens = 0
            return False
        for page in cached_pages:
            self._take(page)
        req.pages.extend(cached_pages)
        req.num_registered_blocks = max(req.num_registered_blocks, len(cached_pages))
        req.pages.extend(self._pop_free() for _ in range(self.new_pages(req, num_new_tokens)))
        return True

    def free(self, req: Request) -> None:
        """Drops the request's references. Tail pages are queued first, so they are evicted first."""
        retain_blocks = req.prefix_hint_tokens // self.page_size
        for i in range(len(req.pages) - 1, -1, -1):
            page = req.pages[i]
            self.ref_cnt[page] -= 1
            if self.ref_cnt[page] == 0:
                retained = self.page_hash[page] is not None and (req.session_id is not None or i < retain_blocks)
                (self._free_retained if retained else self._free)[page] = None
        req.pages = []
        req.num_computed_tokens = 0
        req.num_registered_blocks = 0
