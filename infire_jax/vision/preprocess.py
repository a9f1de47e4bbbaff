"""An image -> Llama 4's tiles of pixel values, as transformers' Llama4ImageProcessor makes them,
with Pillow and numpy (no torch at run time).

The image is fitted to the best canvas of whole tiles (at most `max_patches` tiles of `tile`
pixels, the canvas that needs the least upscaling, else the least downscaling, the smallest of
equals), resized within it without distortion (never upscaled past one tile's side), padded with
black to the canvas, normalized, and cut into tiles row by row. With more than one tile, the whole
image squeezed to one tile follows them (the global thumbnail). Normalization is done in bfloat16,
rounding after each step, as the HF processor does: `x * (1/255)`, then `(x - 0.5) / 0.5`.
"""

from __future__ import annotations

import base64
import binascii
import collections
import dataclasses
import io

import ml_dtypes
import numpy as np
from PIL import Image, UnidentifiedImageError

from infire_jax.errors import InvalidRequestError

_BF16 = ml_dtypes.bfloat16


class ImageError(InvalidRequestError):
    """An image that cannot be decoded or used (the server answers 400)."""

    def __init__(self, message: str):
        super().__init__(message, param="image")


@dataclasses.dataclass(frozen=True)
class Tiles:
    pixels: np.ndarray  # [tiles, 3, tile, tile] float32 (bfloat16 values), the thumbnail last if any
    grid: tuple[int, int]  # tiles down and across (the processor's aspect ratio)


def supported_resolutions(max_tiles: int, tile: int) -> list[tuple[int, int]]:
    """Every canvas of at most `max_tiles` tiles, (height, width) in pixels, in the processor's order
    (grouped by aspect ratio in the order each ratio first appears, from the most tiles down)."""
    by_ratio: dict[float, list[tuple[int, int]]] = collections.defaultdict(list)
    for count in range(max_tiles, 0, -1):
        for h in sorted(d for d in range(1, count + 1) if count % d == 0):
            by_ratio[h / (count // h)].append((h, count // h))
    return [(h * tile, w * tile) for grids in by_ratio.values() for h, w in grids]


def best_fit(size: tuple[int, int], canvases: list[tuple[int, int]]) -> tuple[int, int]:
    """The canvas to resize an image of `size` (height, width) into: the smallest scale of at least 1
    (limiting side), else the largest below 1; of canvases with that scale, the smallest area (the
    first of equal areas)."""
    h, w = size
    scales = [min(ch / h, cw / w) for ch, cw in canvases]
    up = [s for s in scales if s >= 1]
    chosen = min(up) if up else max(scales)
    fits = [c for c, s in zip(canvases, scales) if s == chosen]
    return min(fits, key=lambda c: c[0] * c[1])


def size_without_distortion(size: tuple[int, int], target: tuple[int, int]) -> tuple[int, int]:
    """The largest (height, width) within `target` with `size`'s aspect ratio (floored on the free side)."""
    h, w = size
    th, tw = target
    if tw / w < th / h:
        return min(int(np.floor(h * (tw / w))), th), tw
    return th, min(int(np.floor(w * (th / h))), tw)


def normalize(rgb: np.ndarray) -> np.ndarray:
    """uint8 [..., 3] -> [3, ...] float32 holding bfloat16 values: x * (1/255), then (x - 0.5) / 0.5,
    each rounded to bfloat16 (the processor's rescale_and_normalize)."""
    x = np.moveaxis(rgb, -1, 0).astype(_BF16).astype(np.float32)
    x = (x * np.float32(1 / 255)).astype(_BF16).astype(np.float32)
    x = (x - np.float32(0.5)).astype(_BF16).astype(np.float32)
    return (x / np.float32(0.5)).astype(_BF16).astype(np.float32)


def data_url_bytes(url: str, max_bytes: int = 20 << 20) -> bytes:
    """The image in a `data:image/<type>;base64,<data>` URL; `ImageError` naming the problem otherwise."""
    head, sep, payload = url.partition(",")
    media = head[len("data:"):] if head.startswith("data:") else ""
    if not sep or not media.endswith(";base64") or not media.startswith("image/"):
        raise ImageError("a data URL must be data:image/<type>;base64,<data>")
    if len(payload) > max_bytes * 4 // 3 + 4:
        raise ImageError(f"the image is larger than {max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"the data URL is not valid base64 ({e})") from e


def decode(data: bytes, max_pixels: int = 64 << 20) -> Image.Image:
    """An encoded image (PNG, JPEG, WebP, ...) as RGB; `ImageError` naming the problem otherwise."""
    try:
        image = Image.open(io.BytesIO(data))
        if image.width * image.height > max_pixels:
            raise ImageError(f"image of {image.width}x{image.height} pixels is larger than {max_pixels} pixels")
        return image.convert("RGB")
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as e:
        raise ImageError(f"cannot decode the image: {e}") from e


def tiles(image: Image.Image, tile: int = 336, max_patches: int = 16) -> Tiles:
    """`image`'s tiles and grid (module docstring)."""
    image = image.convert("RGB")
    size = (image.height, image.width)
    canvas = best_fit(size, supported_resolutions(max_patches, tile))
    limited = tuple(min(max(s, tile), c) for s, c in zip(size, canvas))  # never upscaled past a tile
    new_h, new_w = (max(d, 1) for d in size_without_distortion(size, limited))
    resized = np.asarray(image.resize((new_w, new_h), Image.BILINEAR) if (new_h, new_w) != size else image)
    padded = np.zeros((*canvas, 3), np.uint8)
    padded[:new_h, :new_w] = resized
    rows, cols = canvas[0] // tile, canvas[1] // tile
    x = normalize(padded)  # [3, H, W]
    out = x.reshape(3, rows, tile, cols, tile).transpose(1, 3, 0, 2, 4).reshape(rows * cols, 3, tile, tile)
    if rows * cols > 1:
        thumb = normalize(np.asarray(image.resize((tile, tile), Image.BILINEAR)))
        out = np.concatenate([out, thumb[None]])
    return Tiles(np.ascontiguousarray(out), (rows, cols))
