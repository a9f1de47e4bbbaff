"""Images on the device: the vision tower, and the pool where its outputs wait for their prompt.

A request's images get rows of the pool, a [rows, E] array of the device cache
(`DeviceCache.images`), when it is added; an image is encoded into its rows (the checkpoint's tower,
vision/towers.py, jitted per tile bucket) only when a step first computes one of its image tokens
(engine/images.py), so one whose tokens' KV is cached or was imported is never encoded. Each
prompt token that is an image patch carries its pool row (`StepBatch.image_rows`), and the forward
takes the embedding from there instead of the token table, whichever step (chunk) prefills it. The
rows stay the request's until it ends (a preempted request prefills again), then go back to the
free list.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from infire_jax.errors import InvalidRequestError
from infire_jax.vision.towers import TowerConfig, encode_padded, tile_bucket, tile_buckets


@functools.partial(jax.jit, donate_argnums=0)
def _write(pool: Array, rows: Array, start: Array) -> Array:
    return jax.lax.dynamic_update_slice_in_dim(pool, rows.astype(pool.dtype), start, 0)


class ImagePoolFull(InvalidRequestError):
    """The requests in flight hold the image pool's rows: a request can be added once some finish."""


class ImagePool:
    """The tower's weights on the device, and the free rows of the cache's image pool (first fit).
    On a mesh both are replicated (`sharding`: the weights' placement, where pixels go too): every
    device encodes an image and holds the rows, so the sharded forward reads them where it runs."""

    def __init__(self, cfg: TowerConfig, weights: dict, num_rows: int,
                 sharding: jax.sharding.Sharding | None = None):
        self.cfg, self.num_rows, self.weights, self.sharding = cfg, num_rows, weights, sharding
        self._free: list[tuple[int, int]] = [(0, num_rows)]  # (start, rows), sorted by start

    @property
    def free_rows(self) -> int:
        return sum(n for _, n in self._free)

    def reserve(self, rows: int) -> int:
        """The start of `rows` free rows, now the caller's; ImagePoolFull when the requests in flight
        hold them (callers wait for some to finish), InvalidRequestError when the pool is too small."""
        for i, (start, n) in enumerate(self._free):
            if n >= rows:
                self._free[i:i + 1] = [(start + rows, n - rows)] if n > rows else []
                return start
        if rows > self.num_rows:
            raise InvalidRequestError(f"the images need {rows} rows of the device's image pool, which has "
                                      f"{self.num_rows}", param="messages")
        raise ImagePoolFull(f"the images of the requests in flight fill the device's image pool "
                            f"({self.num_rows} rows, {self.free_rows} free, {rows} needed)", param="messages")

    def check_room(self, images: list[np.ndarray]) -> None:
        """ImagePoolFull (or InvalidRequestError) unless the images' tiles ([tiles, C, H, W] each) would
        all be reserved now, first fit in order: checked before any is encoded, so a request that
        waits for rows (the async engine retries it every step) encodes nothing until it fits."""
        free = list(self._free)
        try:
            for pixels in images:
                self.reserve(self.rows_for(pixels.shape[0]))
        finally:
            self._free = free

    def release(self, start: int, rows: int) -> None:
        spans = sorted([*self._free, (start, rows)])
        merged = [spans[0]]
        for s, n in spans[1:]:
            if merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((s, n))
        self._free = merged

    def warmup(self, pool: Float[Array, "P E"]) -> Float[Array, "P E"]:
        """Compiles the encoder at every tile bucket and the pool's write, by running them on blank
        tiles into the pool's first rows (free, and overwritten when reserved): serving an image
        compiles nothing. Returns the pool (donated)."""
        side = self.cfg.image_size
        for bucket in tile_buckets(self.cfg):
            blank = np.zeros((bucket, self.cfg.num_channels, side, side), np.float32)
            encoded = encode_padded(self.cfg, self.weights, blank, self.sharding)
            pool = _write(pool, encoded.reshape(-1, pool.shape[1]), jnp.int32(0))
        return pool

    def write(self, pool: Float[Array, "P E"], pixels: np.ndarray, start: int) -> Float[Array, "P E"]:
        """Encodes an image's tiles ([tiles, C, H, W]) into the rows reserved for them from `start`
        (`reserve(rows_for(tiles))`) of `pool` (donated), and returns the pool. Rows past the image's
        own tokens hold its bucket's blank tiles."""
        rows = self.rows_for(pixels.shape[0])
        embeddings = encode_padded(self.cfg, self.weights, pixels, self.sharding).reshape(rows, -1)
        return _write(pool, embeddings, jnp.int32(start))

    def rows_for(self, tiles: int) -> int:
        """The rows an image of `tiles` tiles takes: its tile bucket's tokens."""
        return tile_bucket(self.cfg, tiles) * self.cfg.tokens_per_tile
