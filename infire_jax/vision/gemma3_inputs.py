"""An image -> Gemma 3's pixel values and prompt placeholder, as transformers' Gemma3ImageProcessor (its
defaults, which the published checkpoints keep) and Gemma3Processor make them, with Pillow and numpy.

Pixels: the image in RGB, resized to the tower's square (`image_size`) with Pillow's bilinear filter,
then `x * (1/255)` (float64, stored float32) and `(x - 0.5) / 0.5` in float32. Pan-and-scan (extra
crops of a wide image) is off by default in the processor and not implemented here: an image is one
tile, grid (1, 1).

Prompt: the chat template renders an image as `<start_of_image>`; the processor replaces each with
`\\n\\n<start_of_image>`, `mm_tokens_per_image` x `<image_soft_token>`, `<end_of_image>\\n\\n`. The
projector's outputs replace the `<image_soft_token>` tokens.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from infire_jax.vision.preprocess import Tiles

BOI, EOI, SOFT = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
MARKER = BOI  # where an image goes in a text prompt


def tiles(image: Image.Image, side: int) -> Tiles:
    """`image`'s pixel values ([1, 3, side, side] float32) as one tile (module docstring)."""
    resized = np.asarray(image.convert("RGB").resize((side, side), Image.BILINEAR))
    x = (np.moveaxis(resized, -1, 0).astype(np.float64) * (1 / 255)).astype(np.float32)
    x = (x - np.float32(0.5)) / np.float32(0.5)
    return Tiles(np.ascontiguousarray(x[None], np.float32), (1, 1))


def image_tokens(tokens_per_image: int) -> list[str]:
    """An image's placeholder, as special-token strings and the newlines around it."""
    return ["\n\n", BOI] + [SOFT] * tokens_per_image + [EOI, "\n\n"]
