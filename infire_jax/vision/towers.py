"""The vision towers the engine serves, chosen by the checkpoint's model_type: Llama 4's (vision/encoder.py:
tiles and a thumbnail, pixel-shuffled) and Gemma 3's (vision/gemma3_encoder.py: SigLIP on one square
image, average-pooled). The image pool, the engine's image inputs and the prompt paths call these with
the tower's config, which picks the tower; everything past them (pool rows, the prefix-cache salt, the
step's embedding rows) is the same for both.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np
from jaxtyping import Array, Float
from PIL import Image

from infire_jax.vision import encoder as llama4, gemma3_encoder as gemma3, gemma3_inputs, preprocess, prompt
from infire_jax.vision.config import VisionConfig, vision_config as llama4_config
from infire_jax.vision.gemma3_encoder import Gemma3VisionConfig

TowerConfig = VisionConfig | Gemma3VisionConfig
MODEL_TYPES = ("llama4", "gemma3")  # config.json model_types whose vision_config is served
# Where each tower's tensors are, by name prefix (Gemma 3 also as transformers 4.5x saved them, under `model.`).
PREFIXES = {"llama4": ("vision_model.", "multi_modal_projector."),
            "gemma3": ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                       "model.multi_modal_projector.")}


def _tower(cfg: TowerConfig):
    return gemma3 if isinstance(cfg, Gemma3VisionConfig) else llama4


def vision_config(hf: Mapping[str, Any]) -> TowerConfig:
    """The tower of an HF config.json with a `vision_config` (`MODEL_TYPES`)."""
    return gemma3.vision_config(hf) if hf.get("model_type") == "gemma3" else llama4_config(hf)


def prefixes(cfg: TowerConfig) -> tuple[str, ...]:
    return PREFIXES["gemma3" if isinstance(cfg, Gemma3VisionConfig) else "llama4"]


def tile_buckets(cfg: TowerConfig) -> tuple[int, ...]:
    """The tile counts an encoder call is padded to: the programs compiled at warmup."""
    return _tower(cfg).TILE_BUCKETS


def tile_bucket(cfg: TowerConfig, tiles: int) -> int:
    """The smallest of `tile_buckets` holding `tiles` (ValueError past the largest)."""
    for b in tile_buckets(cfg):
        if tiles <= b:
            return b
    raise ValueError(f"{tiles} tiles: an encoder call takes at most {tile_buckets(cfg)[-1]}")


def pool_rows(cfg: TowerConfig, images: int) -> int:
    """Rows a pool needs to hold `images` images of the most tiles at once."""
    return images * tile_buckets(cfg)[-1] * cfg.tokens_per_tile


def encode_padded(cfg: TowerConfig, weights: dict, pixels: Float[Array, "N C H W"] | np.ndarray,
                  sharding: jax.sharding.Sharding | None = None) -> Float[Array, "B P E"]:
    """The tower's outputs for `pixels` padded to their tile bucket B (jitted once a bucket)."""
    return _tower(cfg).encode_padded(cfg, weights, pixels, sharding)


def device_bytes(cfg: TowerConfig, dtype, sharding: jax.sharding.Sharding | None = None) -> tuple[int, int]:
    """(the weights, the largest encoder call's temporaries) on one device."""
    return _tower(cfg).device_bytes(cfg, dtype, sharding)


def weights_from_hf(cfg: TowerConfig, tensors: dict[str, np.ndarray], dtype) -> dict:
    return _tower(cfg).weights_from_hf(cfg, tensors, dtype)


def tiles(cfg: TowerConfig, image: Image.Image) -> preprocess.Tiles:
    """An image's pixel values as the tower's HF image processor makes them."""
    if isinstance(cfg, Gemma3VisionConfig):
        return gemma3_inputs.tiles(image, cfg.image_size)
    return preprocess.tiles(image, cfg.image_size, cfg.max_patches)


def marker(cfg: TowerConfig) -> str:
    """Where an image goes in a text prompt, as the model's chat template writes it."""
    return gemma3_inputs.MARKER if isinstance(cfg, Gemma3VisionConfig) else prompt.IMAGE


def image_tokens(cfg: TowerConfig, grid: tuple[int, int]) -> list[str]:
    """An image's placeholder (its tiles' `grid`), as its HF processor expands a marker."""
    if isinstance(cfg, Gemma3VisionConfig):
        return gemma3_inputs.image_tokens(cfg.tokens_per_image)
    return prompt.image_tokens(grid, cfg.tokens_per_tile)


def expand(cfg: TowerConfig, text: str, grids: list[tuple[int, int]], at: str | None = None) -> str:
    """`text` with its i-th marker (`at`: the chat paths' `prompt.IMAGE`; default the tower's own)
    replaced by image i's placeholder; ValueError unless the counts match."""
    return prompt.replace_markers(text, at or marker(cfg), ["".join(image_tokens(cfg, g)) for g in grids])
