"""Llama 4's vision tower config, read from a `llama4` checkpoint's `vision_config` as transformers'
Llama4VisionConfig reads it, with the wrapper's image token ids and the text width the projector
maps into. A field the encoder does not implement is refused, naming it."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from infire_jax.errors import UnsupportedModelError
from infire_jax.models.llama4_config import INERT_FIELDS

# Llama4VisionConfig's defaults (transformers 5.x), for fields a checkpoint leaves out.
_DEFAULTS = dict(hidden_size=768, num_hidden_layers=34, num_attention_heads=16, num_channels=3,
                 intermediate_size=5632, vision_output_dim=7680, image_size=448, patch_size=14,
                 pixel_shuffle_ratio=0.5, projector_input_dim=4096, projector_output_dim=4096, rope_theta=10000.0)
_READ = set(_DEFAULTS) | {"model_type", "hidden_act", "rope_parameters", "norm_eps", "multi_modal_projector_bias",
                          "vision_feature_select_strategy", "vision_feature_layer"}
_INERT = {"initializer_range", "projector_dropout", "attention_dropout"} | INERT_FIELDS  # training, bookkeeping


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    image_size: int  # a tile's side, pixels
    patch_size: int
    pixel_shuffle_ratio: float
    projector_input_dim: int
    projector_output_dim: int
    vision_output_dim: int
    text_hidden_size: int
    rope_theta: float
    num_channels: int = 3
    layer_norm_eps: float = 1e-5  # torch.nn.LayerNorm's default: HF builds every norm of the tower with it
    image_token_id: int = 200092  # <|patch|>: the tokens the encoder's outputs replace
    max_patches: int = 16  # the image processor's tiles an image at most (its thumbnail beside them)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_tile(self) -> int:
        """<|patch|> tokens a tile becomes: its patches, pixel-shuffled."""
        return int(self.patches_per_side ** 2 * self.pixel_shuffle_ratio ** 2)


def vision_config(hf: Mapping[str, Any]) -> VisionConfig:
    """The vision tower of a `llama4` HF config (the whole config.json)."""
    vc = hf.get("vision_config")
    if not vc:
        raise UnsupportedModelError("this Llama 4 checkpoint has no vision_config: it serves text only")
    unknown = sorted(set(vc) - _READ - _INERT)
    if unknown:
        raise UnsupportedModelError(f"Llama 4 vision_config fields not implemented: {unknown}")
    get = {**_DEFAULTS, **vc}.get
    rope = vc.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise UnsupportedModelError(f"Llama 4 vision_config rope_parameters={rope!r}: only the default 2-D RoPE")
    if vc.get("hidden_act", "gelu") != "gelu" or vc.get("multi_modal_projector_bias", False):
        raise UnsupportedModelError("Llama 4 vision_config: only gelu and a projector without bias are implemented")
    cfg = VisionConfig(
        hidden_size=get("hidden_size"), num_layers=get("num_hidden_layers"), num_heads=get("num_attention_heads"),
        intermediate_size=get("intermediate_size"), image_size=get("image_size"), patch_size=get("patch_size"),
        pixel_shuffle_ratio=get("pixel_shuffle_ratio"), projector_input_dim=get("projector_input_dim"),
        projector_output_dim=get("projector_output_dim"), vision_output_dim=get("vision_output_dim"),
        text_hidden_size=hf["text_config"]["hidden_size"], rope_theta=float(rope.get("rope_theta", get("rope_theta"))),
        num_channels=get("num_channels"), image_token_id=hf.get("image_token_index", 200092))
    side = cfg.patches_per_side
    if cfg.image_size % cfg.patch_size or side % round(1 / cfg.pixel_shuffle_ratio):
        raise UnsupportedModelError(f"Llama 4 vision: {cfg.image_size}-pixel tiles of {cfg.patch_size}-pixel patches "
                                    f"do not pixel-shuffle by {cfg.pixel_shuffle_ratio}")
    if int(cfg.hidden_size / cfg.pixel_shuffle_ratio ** 2) != cfg.intermediate_size:
        raise UnsupportedModelError("Llama 4 vision: the adapter's input (hidden_size / ratio^2) must equal "
                                    "intermediate_size, as HF's Llama4VisionMLP2 assumes")
    return cfg
