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

from infire_jax.errors import UnsupportedModelError
from infire_jax.vision.preprocess import Tiles

BOI, EOI, SOFT = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
MARKER = BOI  # where an image goes in a text prompt


# preprocessor_config.json's fields whose values `tiles` implements (the published files' and the
# processor's defaults); a file that sets another value is refused naming the field.
_PROCESSOR = {"do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True, "resample": 2,
              "rescale_factor": 1 / 255, "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "do_pan_and_scan": False}


def check_processor(pp: dict, side: int) -> None:
    """UnsupportedModelError naming a field of a checkpoint's preprocessor_config.json that `tiles` does
    not honour (pan-and-scan among them); a field left out or null takes the default."""
    for field, want in _PROCESSOR.items():
        got = pp.get(field)
        if got is not None and not (np.allclose(got, want) if field in ("image_mean", "image_std", "rescale_factor")
                                    else bool(got) == want if isinstance(want, bool) else got == want):
            raise UnsupportedModelError(f"Gemma 3 images: preprocessor_config.json {field}={got!r} is not "
                                        f"implemented (only {want!r})")
    size = pp.get("size") or {}
    if (size.get("height", side), size.get("width", side)) != (side, side):
        raise UnsupportedModelError(f"Gemma 3 images: preprocessor_config.json size={size!r}, the tower takes "
                                    f"{side} x {side}")


def tiles(image: Image.Image, side: int) -> Tiles:
    """`image`'s pixel values ([1, 3, side, side] float32) as one tile (module docstring)."""
    resized = np.asarray(image.convert("RGB").resize((side, side), Image.BILINEAR))
    x = (np.moveaxis(resized, -1, 0).astype(np.float64) * (1 / 255)).astype(np.float32)
    x = (x - np.float32(0.5)) / np.float32(0.5)
    return Tiles(np.ascontiguousarray(x[None], np.float32), (1, 1))


def image_tokens(tokens_per_image: int) -> list[str]:
    """An image's placeholder, as special-token strings and the newlines around it."""
    return ["\n\n", BOI] + [SOFT] * tokens_per_image + [EOI, "\n\n"]
