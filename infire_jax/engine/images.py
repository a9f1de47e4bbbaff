"""A request's images, from the caller's PIL images (or encoded bytes) to rows of the device's
image pool that its prompt's <|patch|> tokens read (runner/image_pool.py).

The prompt is text with one `<|image|>` marker per image, which becomes the image's placeholder
(vision/prompt.py), or token ids with the placeholders already in them (as HF's processor makes
them); either way its <|patch|> tokens must be exactly the images' tiles' tokens, in order. The
images are encoded as the request is added, and their rows are freed when it ends. A request's
prefix-cache salt takes a digest of its pixels, so two images never share KV and the same image
in the next turn does.
"""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

import numpy as np
from PIL import Image

from infire_jax.errors import InvalidRequestError
from infire_jax.loaders.tokenizer import Tokenizer
from infire_jax.runner.image_pool import ImagePool
from infire_jax.runner.model_runner import ModelRunner
from infire_jax.vision import preprocess, prompt as placeholders


class PreparedImages:
    """What `ImageInputs.prepare` made of a request's images: its prompt ids, each prompt token's pool
    row (-1: not an image's), the pixels' digest, and the pool rows it holds as (start, rows)."""

    def __init__(self, ids: list[int], rows: np.ndarray, digest: str, spans: list[tuple[int, int]]):
        self.ids, self.rows, self.digest, self.spans = ids, rows, digest, spans


class ImageInputs:
    def __init__(self, pool: ImagePool, runner: ModelRunner, tokenizer: Tokenizer, limit: int):
        self.pool, self.runner, self.tokenizer, self.limit = pool, runner, tokenizer, limit
        self.cfg = pool.cfg

    def tiles(self, image: Image.Image) -> preprocess.Tiles:
        """An image's tiles for this tower (a server makes them off the engine's thread)."""
        return preprocess.tiles(image, self.cfg.image_size, self.cfg.max_patches)

    def _image(self, image: Any) -> Image.Image:
        if isinstance(image, Image.Image):
            return image
        if isinstance(image, (bytes, bytearray)):
            return preprocess.decode(bytes(image))
        raise InvalidRequestError(f"an image must be a PIL image, encoded bytes or preprocess.Tiles, got "
                                  f"{type(image).__name__}", param="multi_modal_data")

    def prepare(self, prompt: str | list[int], images: Sequence[Any]) -> PreparedImages:
        if not images:
            raise InvalidRequestError("multi_modal_data has no image", param="multi_modal_data")
        if len(images) > self.limit:
            raise InvalidRequestError(f"{len(images)} images in one prompt; at most {self.limit} "
                                      "(limit_mm_per_prompt)", param="multi_modal_data")
        tiles = [im if isinstance(im, preprocess.Tiles) else self.tiles(self._image(im)) for im in images]
        per_tile = self.cfg.tokens_per_tile
        if isinstance(prompt, str):
            try:
                text = placeholders.expand(prompt, [t.grid for t in tiles], per_tile)
            except ValueError as e:
                raise InvalidRequestError(str(e), param="prompt") from e
            ids = self.tokenizer.encode(text)
        else:
            ids = list(prompt)
        patches = np.flatnonzero(np.asarray(ids) == self.cfg.image_token_id)
        want = sum(t.pixels.shape[0] for t in tiles) * per_tile
        if len(patches) != want:
            raise InvalidRequestError(f"the prompt has {len(patches)} image patch tokens, its images {want}",
                                      param="prompt")
        self.pool.check_room([t.pixels for t in tiles])
        spans, rows, digest = [], [], hashlib.sha256()
        try:
            for t in tiles:
                pool, start, n = self.pool.add(self.runner.cache.images, t.pixels)
                self.runner.cache = self.runner.cache._replace(images=pool)
                spans.append((start, n))
                rows.append(start + np.arange(t.pixels.shape[0] * per_tile, dtype=np.int32))
                digest.update(t.pixels.tobytes())
        except BaseException:
            self.release(spans)
            raise
        token_rows = np.full(len(ids), -1, np.int32)
        token_rows[patches] = np.concatenate(rows)
        return PreparedImages(ids, token_rows, digest.hexdigest(), spans)

    def release(self, spans: list[tuple[int, int]]) -> None:
        for start, n in spans:
            self.pool.release(start, n)
