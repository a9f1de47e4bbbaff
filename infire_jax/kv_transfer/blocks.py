"""The KV of a prompt's full pages, as it travels between engines, and the layout both must share."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np

from infire_jax.errors import InvalidRequestError


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """What two engines must agree on for one's pages to be valid in the other's pool."""

    model: str  # a digest of the model config
    dtype: str  # the pool's: pages travel in it (fp8 ones as float8_e4m3fn)
    page_size: int
    page_shape: tuple[int, ...]  # [layers, page_size, kv_heads, head_dim] of one page of k (and of v)
    # One page of v where it differs from k's (an MLA pool: latent in k, rotary key in v); None: as k.
    v_page_shape: tuple[int, ...] | None = None
    # A digest of an fp8 pool's scales (pallas_kernels/kv_quant.py): fp8 codes mean nothing under other
    # scales. None for a pool in a value dtype.
    kv_scales: str | None = None

    @classmethod
    def of(cls, config_dict: dict, dtype: str, page_size: int, page_shape: tuple[int, ...],
           v_page_shape: tuple[int, ...] | None = None, kv_scales: np.ndarray | None = None) -> "KVLayout":
        digest = hashlib.sha256(json.dumps(config_dict, sort_keys=True).encode()).hexdigest()[:16]
        v = None if v_page_shape is None or tuple(v_page_shape) == tuple(page_shape) else tuple(v_page_shape)
        scales = None if kv_scales is None else hashlib.sha256(
            np.ascontiguousarray(kv_scales, np.float32).tobytes()).hexdigest()[:16]
        return cls(digest, dtype, page_size, tuple(page_shape), v, scales)

    def check_compatible(self, other: "KVLayout") -> None:
        for field in dataclasses.fields(self):
            mine, theirs = getattr(self, field.name), getattr(other, field.name)
            if mine != theirs:
                raise InvalidRequestError(f"the KV pages do not fit this engine: {field.name} is {theirs!r} "
                                          f"in the transfer and {mine!r} here", param="kv_transfer")


@dataclasses.dataclass
class KVBlocks:
    """Full pages of a prompt's KV: block i holds tokens [i * page_size, (i + 1) * page_size).

    The receiver recomputes the hash chain from `token_ids` and `tenant`, so pages land under the
    same tenant-salted keys a local prefill would have made, and a sender cannot plant pages
    under another tenant's keys.
    """

    layout: KVLayout
    token_ids: list[int]  # the blocks' tokens: len(token_ids) == num_blocks * page_size
    tenant: str | None
    k: np.ndarray  # [layers, num_blocks, page_size, kv_heads, head_dim]
    v: np.ndarray

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def check(self) -> None:
        """The payload is self-consistent: shapes match the layout and the token count."""
        k_page = self.layout.page_shape
        v_page = self.layout.v_page_shape or k_page
        want = (k_page[0], self.num_blocks, *k_page[1:])
        want_v = (v_page[0], self.num_blocks, *v_page[1:])
        if self.k.shape != want or self.v.shape != want_v:
            raise InvalidRequestError(f"KV blocks of shape {self.k.shape} / {self.v.shape}, expected {want} / "
                                      f"{want_v}", param="kv_transfer")
        if len(self.token_ids) != self.num_blocks * self.layout.page_size:
            raise InvalidRequestError(f"{len(self.token_ids)} tokens for {self.num_blocks} blocks of "
                                      f"{self.layout.page_size}", param="kv_transfer")
