"""A request's images, from the caller's PIL images (or encoded bytes) to rows of the device's
image pool that its prompt's <|patch|> tokens read (runner/image_pool.py).

The prompt is text with one marker per image (Llama 4's `<|image|>`, Gemma 3's `<start_of_image>`),
which becomes the image's placeholder (vision/towers.py), or token ids with the placeholders already in
them (as HF's processor makes them); either way its image tokens (Llama 4's <|patch|>, Gemma 3's
<image_soft_token>) must be exactly the images' tiles' tokens, in order. The
images' pool rows are reserved as the request is added, and freed when it ends.

An image is encoded only when a step is about to compute one of its <|patch|> tokens (`encode`, as
vLLM's scheduler schedules an encoder input with the tokens that need it): one whose tokens are a
prefix-cache hit (the same image in the next turn, or a decode worker's KV pulled from the prefill
worker that encoded it) is never encoded. A request's prefix-cache salt takes a digest of its pixels
(`images_digest`, `salted`), so two images never share KV and the same image does, on any worker
that cut it into the same tiles.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Sequence

import numpy as np
from PIL import Image

from infire_jax.errors import InvalidRequestError
from infire_jax.loaders.tokenizer import Tokenizer
from infire_jax.runner.image_pool import ImagePool
from infire_jax.runner.model_runner import ModelRunner
from infire_jax.vision import preprocess, towers


def images_digest(tiles: Sequence[preprocess.Tiles]) -> str:
    """The digest of a prompt's images, their tiles' pixels in order: what its prefix-cache salt takes."""
    digest = hashlib.sha256()
    for t in tiles:
        digest.update(t.pixels.tobytes())
    return digest.hexdigest()


def salted(salt: str | None, digest: str | None) -> str | None:
    """A prefix-cache salt (tenant, LoRA adapter) with a prompt's images' digest (None: no images)."""
    return salt if digest is None else f"{salt or ''}\0images\0{digest}"


@dataclasses.dataclass
class PendingImage:
    """One image of a request: its pool rows, the prompt positions of its first and last <|patch|>
    tokens, and its tiles until they are encoded (None after)."""

    start: int
    rows: int
    first: int
    last: int
    pixels: np.ndarray | None


class PreparedImages:
    """What `ImageInputs.prepare` made of a request's images: its prompt ids, each prompt token's pool
    row (-1: not an image's), the pixels' digest, and each image's rows and tiles."""

    def __init__(self, ids: list[int], rows: np.ndarray, digest: str, images: list[PendingImage]):
        self.ids, self.rows, self.digest, self.images = ids, rows, digest, images

    @property
    def spans(self) -> list[tuple[int, int]]:
        """The pool rows it holds, as (start, rows)."""
        return [(im.start, im.rows) for im in self.images]


class ImageInputs:
    def __init__(self, pool: ImagePool, runner: ModelRunner, tokenizer: Tokenizer, limit: int):
        self.pool, self.runner, self.tokenizer, self.limit = pool, runner, tokenizer, limit
        self.cfg = pool.cfg

    def tiles(self, image: Image.Image) -> preprocess.Tiles:
        """An image's tiles for this tower (a server makes them off the engine's thread)."""
        return towers.tiles(self.cfg, image)

    def expand(self, text: str, tiles: Sequence[preprocess.Tiles], at: str | None = None) -> str:
        """`text` with each image's marker (`at`, default the tower's own) replaced by its placeholder."""
        return towers.expand(self.cfg, text, [t.grid for t in tiles], at)

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
                text = self.expand(prompt, tiles)
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
        images, rows, at = [], [], 0
        try:
            for t in tiles:
                n, reserved = t.pixels.shape[0] * per_tile, self.pool.rows_for(t.pixels.shape[0])
                images.append(PendingImage(self.pool.reserve(reserved), reserved, int(patches[at]),
                                           int(patches[at + n - 1]), t.pixels))
                rows.append(images[-1].start + np.arange(n, dtype=np.int32))
                at += n
        except BaseException:
            self.release([(im.start, im.rows) for im in images])
            raise
        token_rows = np.full(len(ids), -1, np.int32)
        token_rows[patches] = np.concatenate(rows)
        return PreparedImages(ids, token_rows, images_digest(tiles), images)

    def encode(self, prepared: PreparedImages, start: int, end: int) -> int:
        """Encodes the request's images that prompt positions [start, end) need (a step computes them)
        and that are not encoded yet; returns how many it encoded."""
        count = 0
        for im in prepared.images:
            if im.pixels is not None and im.first < end and im.last >= start:
                self.runner.cache = self.runner.cache._replace(
                    images=self.pool.write(self.runner.cache.images, im.pixels, im.start))
                im.pixels = None
                count += 1
        return count

    def release(self, spans: list[tuple[int, int]]) -> None:
        for start, n in spans:
            self.pool.release(start, n)
