"""The KV of a prompt's full pages, as it travels between engines, and the layout both must share.

A plain pool's payload holds one page per block, every layer in it. A hybrid KV cache (kv_groups.py)
holds one page per block and group, each of `page_layers` layers; a bounded (chunked or window) group
only the blocks a prefix hit of the payload's blocks reads (`KVGroup.first_block` of its end). The
payload's pages go group by group, each group's blocks in order (`KVLayout.block_pages`), so its
shape follows from the layout and the token count alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np

from infire_jax.errors import InvalidRequestError
from infire_jax.core.kv_groups import KVGroup


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """What two engines must agree on for one's pages to be valid in the other's pool."""

    model: str  # a digest of the model config
    dtype: str  # the pool's: pages travel in it (fp8 ones as float8_e4m3fn)
    page_size: int
    # [layers, page_size, kv_heads, head_dim] of one page of k (and of v); a hybrid cache's page holds
    # `page_layers` layers of one group.
    page_shape: tuple[int, ...]
    # One page of v where it differs from k's (an MLA pool: latent in k, rotary key in v); None: as k.
    v_page_shape: tuple[int, ...] | None = None
    # A digest of an fp8 pool's scales (pallas_kernels/kv_quant.py): fp8 codes mean nothing under other
    # scales. None for a pool in a value dtype.
    kv_scales: str | None = None
    # A hybrid KV cache's groups of layers (kv_groups.py), which say which pages a payload carries;
    # None: one group of every layer, every page kept.
    groups: tuple[KVGroup, ...] | None = None

    @classmethod
    def of(cls, config_dict: dict, dtype: str, page_size: int, page_shape: tuple[int, ...],
           v_page_shape: tuple[int, ...] | None = None, kv_scales: np.ndarray | None = None,
           groups: tuple[KVGroup, ...] | None = None) -> "KVLayout":
        digest = hashlib.sha256(json.dumps(config_dict, sort_keys=True).encode()).hexdigest()[:16]
        v = None if v_page_shape is None or tuple(v_page_shape) == tuple(page_shape) else tuple(v_page_shape)
        scales = None if kv_scales is None else hashlib.sha256(
            np.ascontiguousarray(kv_scales, np.float32).tobytes()).hexdigest()[:16]
        return cls(digest, dtype, page_size, tuple(page_shape), v, scales, None if groups is None else tuple(groups))

    def block_pages(self, num_blocks: int) -> list[tuple[int, int]]:
        """(group, block) of each page a payload of `num_blocks` blocks carries, in its order."""
        if self.groups is None:
            return [(0, i) for i in range(num_blocks)]
        end = num_blocks * self.page_size
        return [(g, i) for g, group in enumerate(self.groups)
                for i in range(group.first_block(end, self.page_size) if group.bounded else 0, num_blocks)]

    def payload_shapes(self, num_blocks: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The k and v arrays of a payload of `num_blocks` blocks: [layers, pages, page_size, heads, dim]."""
        pages = len(self.block_pages(num_blocks))
        k_page, v_page = self.page_shape, self.v_page_shape or self.page_shape
        return (k_page[0], pages, *k_page[1:]), (v_page[0], pages, *v_page[1:])

    def payload_nbytes(self, num_blocks: int) -> int:
        """The bytes of k and v of a payload of `num_blocks` blocks."""
        itemsize = numpy_dtype(self.dtype).itemsize
        return sum(int(np.prod(shape)) * itemsize for shape in self.payload_shapes(num_blocks))

    def check_compatible(self, other: "KVLayout") -> None:
        if self.groups != other.groups:  # before the page shape, which follows the groups
            raise InvalidRequestError(f"the KV pages do not fit this engine: its layers are grouped as "
                                      f"{describe_groups(other.groups)} in the transfer and "
                                      f"{describe_groups(self.groups)} here (both engines need the same "
                                      f"hybrid_kv_cache setting)", param="kv_transfer")
        for field in dataclasses.fields(self):
            mine, theirs = getattr(self, field.name), getattr(other, field.name)
            if mine != theirs:
                raise InvalidRequestError(f"the KV pages do not fit this engine: {field.name} is {theirs!r} "
                                          f"in the transfer and {mine!r} here", param="kv_transfer")


@dataclasses.dataclass
class KVBlocks:
    """Full pages of a prompt's KV: block i holds tokens [i * page_size, (i + 1) * page_size), and
    the payload's pages are `layout.block_pages(num_blocks)` (one per block for a plain pool).

    The receiver recomputes the hash chain from `token_ids` and `tenant`, so pages land under the
    same tenant-salted keys a local prefill would have made, and a sender cannot plant pages
    under another tenant's keys.
    """

    layout: KVLayout
    token_ids: list[int]  # the blocks' tokens: len(token_ids) == num_blocks * page_size
    tenant: str | None
    k: np.ndarray  # [layers, pages, page_size, kv_heads, head_dim]
    v: np.ndarray

    @property
    def num_blocks(self) -> int:
        return len(self.token_ids) // self.layout.page_size

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def check(self) -> None:
        """The payload is self-consistent: whole blocks of tokens, and shapes that match the layout."""
        if len(self.token_ids) % self.layout.page_size:
            raise InvalidRequestError(f"{len(self.token_ids)} tokens for blocks of {self.layout.page_size}: not a "
                                      f"whole number of blocks", param="kv_transfer")
        want, want_v = self.layout.payload_shapes(self.num_blocks)
        if self.k.shape != want or self.v.shape != want_v:
            raise InvalidRequestError(f"KV blocks of shape {self.k.shape} / {self.v.shape}, expected {want} / "
                                      f"{want_v}", param="kv_transfer")


def numpy_dtype(name: str) -> np.dtype:
    """numpy's dtype of that name, ml_dtypes' for bfloat16 and float8_e4m3fn."""
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, name, name))


def describe_groups(groups: tuple[KVGroup, ...] | None) -> str:
    """A layout's groups for an error: each group's kind and layers."""
    if groups is None:
        return "one group of every layer (every page kept)"
    return "; ".join(f"{g.kind} layers {list(g.layers)}" for g in groups)


def groups_to_json(groups: tuple[KVGroup, ...] | None) -> list | None:
    """A layout's groups as `kv_transfer_params` carry them: [[chunk, window, [layers]], ...]."""
    return None if groups is None else [[g.chunk, g.window, list(g.layers)] for g in groups]


def groups_from_json(value) -> tuple[KVGroup, ...] | None:
    """`groups_to_json`'s inverse; ValueError when `value` is not of that form."""
    if value is None:
        return None
    try:
        groups = tuple(KVGroup(int(c), int(w), tuple(int(layer) for layer in layers)) for c, w, layers in value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"malformed KV groups {value!r}") from e
    if not groups:
        raise ValueError("no KV groups")
    return groups
