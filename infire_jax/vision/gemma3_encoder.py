"""Gemma 3's vision tower and projector: an image's pixels -> the text model's input embeddings for its
`<image_soft_token>` tokens.

Per image (transformers' SiglipVisionModel and Gemma3MultiModalProjector, the same arithmetic): patches
of `patch_size` pixels flattened channel-major and projected with a bias (the conv as a matmul); learned
positions; `num_layers` pre-norm encoder layers (full attention over the patches with biased q/k/v/o, a
GELU-tanh MLP, LayerNorms with biases); the post LayerNorm; the patch grid average-pooled to
`mm_tokens_per_image` tokens; Gemma's RMSNorm (1 + w); a linear map (no bias) into the text width.

One image is one encoder call (`TILE_BUCKETS` = (1,): Gemma 3 does not tile an image, pan-and-scan
being off), jitted once, so serving an image compiles nothing new. The layers' weights are stacked and
scanned, as Llama 4's tower's are (vision/encoder.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from infire_jax.errors import UnsupportedModelError
from infire_jax.models.llama4_config import INERT_FIELDS
from infire_jax.vision.encoder import _layer_norm

TILE_BUCKETS = (1,)  # images an encoder call takes: one, the only count the engine calls it with

# SiglipVisionConfig's defaults (transformers 5.x), for fields a checkpoint leaves out.
_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                 num_channels=3, image_size=224, patch_size=16, layer_norm_eps=1e-6)
_READ = set(_DEFAULTS) | {"model_type", "hidden_act"}
# Inert at inference; `vision_use_head`: SigLIP's pooling head, which Gemma 3 never runs (its features
# are the last hidden state), so its tensors are left unread.
_INERT = {"attention_dropout", "initializer_range", "projection_dim", "num_image_tokens",
          "vision_use_head"} | INERT_FIELDS


@dataclasses.dataclass(frozen=True)
class Gemma3VisionConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    image_size: int  # the square an image is resized to, pixels
    patch_size: int
    tokens_per_image: int  # mm_tokens_per_image: the pooled grid's tokens
    text_hidden_size: int
    layer_norm_eps: float = 1e-6
    num_channels: int = 3
    image_token_id: int = 262144  # <image_soft_token>: the tokens the projector's outputs replace

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_tile(self) -> int:
        """An image's (its one tile's) `<image_soft_token>` tokens."""
        return self.tokens_per_image

    @property
    def pool_kernel(self) -> int:
        """The side of the square of patches averaged into one token."""
        return self.patches_per_side // math.isqrt(self.tokens_per_image)


def vision_config(hf: Mapping[str, Any]) -> Gemma3VisionConfig:
    """The vision tower of a `gemma3` HF config (the whole config.json)."""
    vc = hf.get("vision_config")
    if not vc:
        raise UnsupportedModelError("this Gemma 3 checkpoint has no vision_config: it serves text only")
    unknown = sorted(set(vc) - _READ - _INERT)
    if unknown:
        raise UnsupportedModelError(f"Gemma 3 vision_config fields not implemented: {unknown}")
    if vc.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise UnsupportedModelError(f"Gemma 3 vision_config hidden_act={vc['hidden_act']!r}: only "
                                    "gelu_pytorch_tanh is implemented")
    get = {**_DEFAULTS, **vc}.get
    text = hf.get("text_config") or {}
    image_token = hf.get("image_token_id", hf.get("image_token_index", 262144))
    cfg = Gemma3VisionConfig(
        hidden_size=get("hidden_size"), num_layers=get("num_hidden_layers"), num_heads=get("num_attention_heads"),
        intermediate_size=get("intermediate_size"), image_size=get("image_size"), patch_size=get("patch_size"),
        tokens_per_image=hf.get("mm_tokens_per_image", 256), text_hidden_size=text.get("hidden_size", 2304),
        layer_norm_eps=float(get("layer_norm_eps")), num_channels=get("num_channels"), image_token_id=image_token)
    side, per_side = cfg.patches_per_side, math.isqrt(cfg.tokens_per_image)
    if cfg.image_size % cfg.patch_size or per_side ** 2 != cfg.tokens_per_image or side % per_side:
        raise UnsupportedModelError(f"Gemma 3 vision: {side} x {side} patches do not average-pool to "
                                    f"mm_tokens_per_image={cfg.tokens_per_image} (a square grid dividing them)")
    return cfg


def _gelu_tanh(x: Array) -> Array:
    return jax.nn.gelu(x, approximate=True)  # gelu_pytorch_tanh


def encode_images(cfg: Gemma3VisionConfig, w: dict, pixels: Float[Array, "N C H W"]) -> Float[Array, "N P E"]:
    """The tower and projector on `pixels` ([images, channels, side, side]) with weights `w`
    (`weights_from_hf`'s): [images, tokens_per_image, text width]."""
    n, c, _, _ = pixels.shape
    p, s, heads, hd, eps = cfg.patch_size, cfg.patches_per_side, cfg.num_heads, cfg.head_dim, cfg.layer_norm_eps
    dtype = w["patch_embedding"].dtype
    patches = pixels.reshape(n, c, s, p, s, p).transpose(0, 2, 4, 1, 3, 5).reshape(n, s * s, c * p * p)
    h = patches.astype(dtype) @ w["patch_embedding"] + w["patch_bias"] + w["positions"]

    def layer(h, lw):
        x = _layer_norm(h, lw["attn_norm_scale"], lw["attn_norm_bias"], eps)
        q, k, v = ((x @ lw[f"w{t}"] + lw[f"b{t}"]).reshape(n, -1, heads, hd) for t in "qkv")
        scores = jnp.einsum("nqhd,nkhd->nhqk", q, k, preferred_element_type=jnp.float32) * hd ** -0.5
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        o = jnp.einsum("nhqk,nkhd->nqhd", probs, v).reshape(n, -1, heads * hd)
        h = h + o @ lw["wo"] + lw["bo"]
        x = _layer_norm(h, lw["mlp_norm_scale"], lw["mlp_norm_bias"], eps)
        return h + _gelu_tanh(x @ lw["fc1"] + lw["b1"]) @ lw["fc2"] + lw["b2"], None

    h, _ = jax.lax.scan(layer, h, w["layers"])
    h = _layer_norm(h, w["post_norm"]["scale"], w["post_norm"]["bias"], eps)
    t, k = s // cfg.pool_kernel, cfg.pool_kernel  # the pooled grid's side, the averaged square's
    pooled = h.astype(jnp.float32).reshape(n, t, k, t, k, -1).mean(axis=(2, 4)).reshape(n, t * t, -1)
    normed = pooled * jax.lax.rsqrt(jnp.mean(jnp.square(pooled), axis=-1, keepdims=True) + eps)
    normed = (normed * (1.0 + w["soft_emb_norm"].astype(jnp.float32))).astype(dtype)
    return normed @ w["projector"]


@functools.partial(jax.jit, static_argnums=0)
def _encode_bucket(cfg: Gemma3VisionConfig, weights: dict, pixels: Array) -> Array:
    return encode_images(cfg, weights, pixels)


def encode_padded(cfg: Gemma3VisionConfig, weights: dict, pixels: Float[Array, "N C H W"] | np.ndarray,
                  sharding: jax.sharding.Sharding | None = None) -> Float[Array, "N P E"]:
    """`encode_images` jitted, on one image at a time (`TILE_BUCKETS`); `sharding`: where the pixels go
    (the weights' placement)."""
    pixels = np.asarray(pixels, np.float32)
    if pixels.shape[0] not in TILE_BUCKETS:
        raise ValueError(f"{pixels.shape[0]} images: Gemma 3's encoder takes {TILE_BUCKETS[-1]} a call")
    return _encode_bucket(cfg, weights, jax.device_put(pixels, sharding))


def weight_shapes(cfg: Gemma3VisionConfig) -> dict:
    """Each weight's shape, in `encode_images`'s pytree layout."""
    h, f, n = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    layer = {"attn_norm_scale": (h,), "attn_norm_bias": (h,), "wq": (h, h), "bq": (h,), "wk": (h, h), "bk": (h,),
             "wv": (h, h), "bv": (h,), "wo": (h, h), "bo": (h,), "mlp_norm_scale": (h,), "mlp_norm_bias": (h,),
             "fc1": (h, f), "b1": (f,), "fc2": (f, h), "b2": (h,)}
    return {"patch_embedding": (cfg.num_channels * cfg.patch_size ** 2, h), "patch_bias": (h,),
            "positions": (cfg.patches_per_side ** 2, h), "layers": {k: (n, *s) for k, s in layer.items()},
            "post_norm": {"scale": (h,), "bias": (h,)}, "soft_emb_norm": (h,),
            "projector": (h, cfg.text_hidden_size)}


def device_bytes(cfg: Gemma3VisionConfig, dtype, sharding: jax.sharding.Sharding | None = None) -> tuple[int, int]:
    """(the tower's weights, an encoder call's temporaries) on one device, from shapes alone (as
    vision/encoder.py's `device_bytes`: the engine sizes the KV pool leaving room for them)."""
    weights = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, dtype, sharding=sharding), weight_shapes(cfg),
                           is_leaf=lambda x: isinstance(x, tuple))
    side = cfg.image_size
    pixels = jax.ShapeDtypeStruct((TILE_BUCKETS[-1], cfg.num_channels, side, side), jnp.float32, sharding=sharding)
    temporaries = _encode_bucket.lower(cfg, weights, pixels).compile().memory_analysis().temp_size_in_bytes
    return sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(weights)), int(temporaries)


# HF names under `vision_tower.encoder.layers.{i}.` of each stacked layer weight (transposed:
# a Linear's [out, in]).
_HF_LAYER = {
    "attn_norm_scale": ("layer_norm1.weight", False), "attn_norm_bias": ("layer_norm1.bias", False),
    "wq": ("self_attn.q_proj.weight", True), "bq": ("self_attn.q_proj.bias", False),
    "wk": ("self_attn.k_proj.weight", True), "bk": ("self_attn.k_proj.bias", False),
    "wv": ("self_attn.v_proj.weight", True), "bv": ("self_attn.v_proj.bias", False),
    "wo": ("self_attn.out_proj.weight", True), "bo": ("self_attn.out_proj.bias", False),
    "mlp_norm_scale": ("layer_norm2.weight", False), "mlp_norm_bias": ("layer_norm2.bias", False),
    "fc1": ("mlp.fc1.weight", True), "b1": ("mlp.fc1.bias", False),
    "fc2": ("mlp.fc2.weight", True), "b2": ("mlp.fc2.bias", False),
}


def weights_from_hf(cfg: Gemma3VisionConfig, tensors: dict[str, np.ndarray], dtype=jnp.float32) -> dict:
    """The pytree `encode_images` takes, from HF tensors by name, in any of the layouts: Google's published
    (`vision_tower.vision_model.*`, `multi_modal_projector.*`), transformers 4.5x's (the same under
    `model.`) and transformers 5's (`vision_tower.*`, SigLIP's `vision_model.` dropped)."""
    named = {k.removeprefix("model.").replace("vision_tower.vision_model.", "vision_tower."): v
             for k, v in tensors.items()}

    def t(name: str, transpose: bool = False) -> np.ndarray:
        if name not in named:
            raise KeyError(f"the checkpoint has no {name!r}: not a Gemma 3 vision tower")
        a = np.asarray(named[name], np.float32)
        return a.T if transpose else a

    v = "vision_tower."
    conv = t(f"{v}embeddings.patch_embedding.weight")  # [hidden, C, p, p]: flattened channel-major as the patches
    layers = {k: np.stack([t(f"{v}encoder.layers.{i}.{name}", tr) for i in range(cfg.num_layers)])
              for k, (name, tr) in _HF_LAYER.items()}
    w = {"patch_embedding": conv.reshape(conv.shape[0], -1).T, "patch_bias": t(f"{v}embeddings.patch_embedding.bias"),
         "positions": t(f"{v}embeddings.position_embedding.weight"), "layers": layers,
         "post_norm": {"scale": t(f"{v}post_layernorm.weight"), "bias": t(f"{v}post_layernorm.bias")},
         "soft_emb_norm": t("multi_modal_projector.mm_soft_emb_norm.weight"),
         "projector": t("multi_modal_projector.mm_input_projection_weight")}  # already [vision, text]
    shapes = jax.tree.leaves(weight_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    for got, want in zip(jax.tree.leaves(w), shapes):
        if got.shape != want:
            raise UnsupportedModelError(f"Gemma 3 vision tower: a weight of shape {got.shape}, the config's {want}")
    return jax.tree.map(lambda a: jnp.asarray(a, dtype), w)
