"""Which pool pages a prompt's `KVBlocks` carry out of a prefix cache, and which pages imported ones
fill, for a plain pool and for a hybrid KV cache's groups (hybrid_kv_cache.py). No jax here: the
engine reads and writes the pages through its runner.

A plain pool exports every full page of the prompt that its prefix cache holds. A hybrid cache
exports the blocks that a request with this prompt takes as a prefix hit: the full pages before its
last token (a hit leaves that token to compute), each global group's pages of them and each bounded
group's from the first block that computing after them reads (`KVLayout.block_pages`). A prompt that
ends on a page boundary so exports one block fewer than a plain pool would: a bounded group reads
other pages after a hit of k - 1 blocks than after one of k.
"""

from __future__ import annotations

from infire_jax.core.hybrid_kv_cache import HybridKVCacheManager
from infire_jax.core.kv_cache import NULL_PAGE, KVCacheManager
from infire_jax.kv_transfer.blocks import KVLayout


def export_pages(kv: KVCacheManager | HybridKVCacheManager, layout: KVLayout, token_ids: list[int],
                 salt: str | None) -> tuple[list[int], list[int]]:
    """(the exported blocks' tokens, the pool pages to read for them in the payload's order)."""
    ps = layout.page_size
    if layout.groups is None:
        pages = kv.cached_block_pages(token_ids, salt)
        return token_ids[:len(pages) * ps], pages
    hit = kv.cached_block_pages(token_ids[:(len(token_ids) - 1) // ps * ps], salt)
    pages = [hit[i][g] for g, i in layout.block_pages(len(hit))]
    assert NULL_PAGE not in pages, "a prefix hit lacks a page its groups read"
    return token_ids[:len(hit) * ps], pages


def import_pages(kv: KVCacheManager | HybridKVCacheManager, layout: KVLayout, token_ids: list[int],
                 salt: str | None) -> tuple[list[int], list[int]]:
    """Publishes pages for the blocks of `token_ids` that the prefix cache lacks (the managers'
    `import_blocks`); returns (those pages, the payload page each is written from)."""
    targets = kv.import_blocks(token_ids, salt)
    if layout.groups is None:
        return [p for _, p in targets], [i for i, _ in targets]
    index = {place: n for n, place in enumerate(layout.block_pages(len(token_ids) // layout.page_size))}
    pairs = [(page, index[g, i]) for i, pages in targets for g, page in enumerate(pages) if page != NULL_PAGE]
    return [p for p, _ in pairs], [n for _, n in pairs]
