"""The prefix cache's other half for models with linear-attention layers (Qwen3.5): each layer's
state after a cached prefix. Pure Python: no jax here.

A cached page of KV serves a new request only with the linear state after exactly the tokens it
ends: a DeltaNet's state is the whole prefix, folded. The device keeps `num_snapshots` copies of a
request slot's state (runner/device_memory.py `DeviceCache.linear_snapshots`), each filed under the
hash of the prefix's last full block (core/kv_cache.py's chain, tenant-salted). A snapshot is taken
where a chunk of a prompt ends at one of its request's save points (`save_points`), as vLLM's
prefix caching for such models saves states at block boundaries:
- where its cached KV ended without a state (a branch point: the prompts beside it share up to
  there, as a system prompt or a conversation's earlier turns);
- at its prompt's last block that a later, equal or longer prompt's hit may end on.
The scheduler ends chunks at those points; a later request's hit is cut back to the deepest block that
has a snapshot, which is copied into its slot at admission. Snapshots are evicted least recently used.
"""

from __future__ import annotations

from collections import OrderedDict

from infire_jax.core.kv_cache import extend_block_hashes
from infire_jax.core.request import Request


class LinearStateCache:
    def __init__(self, num_snapshots: int, page_size: int):
        if num_snapshots < 1:
            raise ValueError(f"a linear-state cache needs at least one snapshot, got {num_snapshots}")
        self.num_snapshots = num_snapshots
        self.page_size = page_size
        self.by_hash: dict[bytes, int] = {}  # block hash -> snapshot holding the state after that block
        self._lru: OrderedDict[int, bytes | None] = OrderedDict((i, None) for i in range(num_snapshots))
        self._pending: dict[int, bytes] = {}  # snapshots claimed in the step being planned, not written yet
        self.saves = 0  # snapshots taken

    def clear(self) -> None:
        """Forgets every snapshot (the KV pages they belong to are gone)."""
        self.by_hash.clear()
        self._pending.clear()
        self._lru = OrderedDict((i, None) for i in range(self.num_snapshots))

    def lookup(self, req: Request, num_cached_blocks: int) -> tuple[int, int | None]:
        """(blocks, snapshot): the deepest of the request's first `num_cached_blocks` cached blocks whose
        state is kept, and that snapshot; (0, None) when none is."""
        for i in range(num_cached_blocks - 1, -1, -1):
            snapshot = self.by_hash.get(req.block_hashes[i])
            if snapshot is not None:
                self._lru.move_to_end(snapshot)
                return i + 1, snapshot
        return 0, None

    def save_points(self, req: Request, num_matched_blocks: int, num_hit_blocks: int) -> list[int]:
        """Positions (block ends, after the hit) whose states the request should save: where its cached
        KV ran without a state, and its prompt's last block that a later prompt's hit may end on."""
        points = set()
        if num_matched_blocks > num_hit_blocks:
            points.add(num_matched_blocks * self.page_size)
        last = (req.num_prompt_tokens - 1) // self.page_size  # a later equal prompt's hit (kv_cache.hit_blocks)
        if last > num_hit_blocks:
            points.add(last * self.page_size)
        extend_block_hashes(req, max(points, default=0), self.page_size)
        return sorted(p for p in points if req.block_hashes[p // self.page_size - 1] not in self.by_hash)

    def claim(self, block: bytes) -> int | None:
        """A snapshot to hold the state after the block hashed `block` (the least recently used one, its
        old state forgotten), found by lookups once `publish` says the step that writes it was planned;
        None when that state is kept already."""
        if block in self.by_hash or block in self._pending.values():
            return None
        snapshot, old = self._lru.popitem(last=False)
        if old is not None and self.by_hash.get(old) == snapshot:
            del self.by_hash[old]
        self._pending[snapshot] = self._lru[snapshot] = block
        self.saves += 1
        return snapshot

    def publish(self) -> None:
        """The step that writes the claimed snapshots is planned whole: later steps' hits may use them (a
        hit planned beside the save would restore before the step writes it). A snapshot claimed twice in
        one step holds the later claim's state, as the runner saves in the step's row order."""
        for snapshot, block in self._pending.items():
            self.by_hash[block] = snapshot
        self._pending.clear()
