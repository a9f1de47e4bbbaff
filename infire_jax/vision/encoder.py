"""Llama 4's vision tower as a Flax module: tiles of pixels -> the text model's input embeddings for
their <|patch|> tokens.

Per tile (transformers' Llama4VisionModel and Llama4MultiModalProjector, the same arithmetic):
patches of `patch_size` pixels flattened channel-major and projected (no bias); a class embedding
appended last; learned positions; LayerNorm; `num_layers` pre-norm encoder layers (full attention
over the tile's patches with a 2-D RoPE on q and k, a GELU MLP, biases everywhere); LayerNorm; the
class token dropped; pixel shuffle (each 2 x 2 block of patches into one token of 4x the width);
the adapter MLP (two GELU layers, no bias); and the projector into the text width.

The layers' weights are stacked and scanned, as the text model's are. `encode` is jitted per number
of tiles, and the engine calls it with a few fixed counts (`TILE_BUCKETS`), so serving an image
compiles nothing new.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float

from infire_jax.models.layers import param
from infire_jax.vision.config import VisionConfig

# Tile counts an encoder call is padded to: one tile, a full grid of 16 with its thumbnail, between.
TILE_BUCKETS = (1, 4, 8, 17)
# Prompts whose images' encoder outputs the device's image pool holds at once (each image at its most
# tiles); a request beyond them waits for rows (runner/image_pool.py).
IMAGE_POOL_PROMPTS = 4


class VisionTower(nnx.Module):
    """The encoder's and projector's weights, each a parameter with logical axes (as the text
    model's), built abstractly and filled by `weights_from_hf`; `weights()` is the pytree `encode`
    takes. Layer weights are stacked [layers, ...] and scanned."""

    def __init__(self, cfg: VisionConfig, dtype=jnp.float32):
        self.cfg = cfg
        h, n, f = cfg.hidden_size, cfg.num_layers, cfg.intermediate_size
        self.patch_embedding = param((cfg.num_channels * cfg.patch_size ** 2, h), ("patch", "vision"), dtype)
        self.class_embedding = param((h,), ("vision",), dtype)
        self.positions = param((cfg.patches_per_side ** 2 + 1, h), ("patch_pos", "vision"), dtype)
        for name in ("pre_norm", "post_norm"):
            setattr(self, f"{name}_scale", param((h,), ("vision",), dtype, init="ones"))
            setattr(self, f"{name}_bias", param((h,), ("vision",), dtype, init="zeros"))
        shapes = {"attn_norm_scale": (h,), "attn_norm_bias": (h,), "wq": (h, h), "bq": (h,), "wk": (h, h),
                  "bk": (h,), "wv": (h, h), "bv": (h,), "wo": (h, h), "bo": (h,), "mlp_norm_scale": (h,),
                  "mlp_norm_bias": (h,), "fc1": (h, f), "b1": (f,), "fc2": (f, h), "b2": (h,)}
        for name, shape in shapes.items():
            init = "ones" if name.endswith("scale") else "zeros" if len(shape) == 1 else "normal"
            setattr(self, f"layer_{name}", param((n, *shape), ("layers",) + ("vision",) * len(shape), dtype,
                                                 init=init))
        self.adapter_fc1 = param((f, cfg.projector_input_dim), ("vision_mlp", "adapter"), dtype)
        self.adapter_fc2 = param((cfg.projector_output_dim, cfg.projector_output_dim), ("adapter", "adapter_out"),
                                 dtype)
        self.projector = param((cfg.vision_output_dim, cfg.text_hidden_size), ("adapter_out", "embed"), dtype)

    def weights(self) -> dict:
        """The pytree `encode_tiles` takes (`weights_from_hf`'s layout)."""
        v = {k: p.get_value() for k, p in vars(self).items() if isinstance(p, nnx.Param)}
        return {"patch_embedding": v["patch_embedding"], "class_embedding": v["class_embedding"],
                "positions": v["positions"],
                "pre_norm": {"scale": v["pre_norm_scale"], "bias": v["pre_norm_bias"]},
                "post_norm": {"scale": v["post_norm_scale"], "bias": v["post_norm_bias"]},
                "layers": {k[len("layer_"):]: a for k, a in v.items() if k.startswith("layer_")},
                "adapter_fc1": v["adapter_fc1"], "adapter_fc2": v["adapter_fc2"], "projector": v["projector"]}

    def __call__(self, pixels: Float[Array, "N C H W"]) -> Float[Array, "N P E"]:
        """Each tile's <|patch|> embeddings in the text width, [tiles, tokens_per_tile, E]."""
        return encode_tiles(self.cfg, self.weights(), pixels)


def rope_angles(cfg: VisionConfig) -> np.ndarray:
    """[patches + 1, head_dim / 2] angles of the 2-D RoPE: for each patch (x, y) its (x + 1) * f for
    the first half of the frequencies and (y + 1) * f for the second; none for the class token."""
    side, freq_dim = cfg.patches_per_side, cfg.head_dim // 2
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, freq_dim, 2)[:freq_dim // 2].astype(np.float32) / freq_dim)
    idx = np.arange(side * side)
    x, y = (idx % side + 1).astype(np.float32), (idx // side + 1).astype(np.float32)
    angles = np.concatenate([x[:, None] * inv[None], y[:, None] * inv[None]], axis=1)
    return np.concatenate([angles, np.zeros((1, angles.shape[1]), np.float32)]).astype(np.float32)


def _rotate(x: Array, cos: Array, sin: Array) -> Array:
    """RoPE on interleaved (real, imaginary) pairs of the last axis, as HF's complex product."""
    xf = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
    re, im = xf[..., 0], xf[..., 1]
    out = jnp.stack([re * cos - im * sin, re * sin + im * cos], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


def _layer_norm(x: Array, scale: Array, bias: Array, eps: float) -> Array:
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    normed = (xf - mean) * jax.lax.rsqrt(var + eps)
    return (normed * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def _gelu(x: Array) -> Array:
    return jax.nn.gelu(x, approximate=False)  # torch.nn.GELU()'s default, the erf form


def pixel_shuffle(x: Float[Array, "N P C"], ratio: float) -> Float[Array, "N Q D"]:
    """HF's pixel_shuffle, its views and permutes in the same order (row-major reshapes)."""
    n, p, c = x.shape
    side = int(round(p ** 0.5))
    r = round(1 / ratio)
    x = x.reshape(n, side, side // r, c * r).transpose(0, 2, 1, 3)  # [N, w/r, h, c r]
    x = x.reshape(n, side // r, side // r, c * r * r).transpose(0, 2, 1, 3)
    return x.reshape(n, -1, c * r * r)


def encode_tiles(cfg: VisionConfig, w: dict, pixels: Float[Array, "N C H W"]) -> Float[Array, "N P E"]:
    """The tower on `pixels` ([tiles, channels, side, side]) with weights `w` (`VisionTower`'s)."""
    n, c, side, _ = pixels.shape
    p, s = cfg.patch_size, cfg.patches_per_side
    dtype = w["patch_embedding"].dtype
    patches = pixels.reshape(n, c, s, p, s, p).transpose(0, 2, 4, 1, 3, 5).reshape(n, s * s, c * p * p)
    h = patches.astype(dtype) @ w["patch_embedding"]
    h = jnp.concatenate([h, jnp.broadcast_to(w["class_embedding"], (n, 1, h.shape[-1]))], axis=1)
    h = _layer_norm(h + w["positions"], w["pre_norm"]["scale"], w["pre_norm"]["bias"], cfg.layer_norm_eps)
    angles = jnp.asarray(rope_angles(cfg))
    cos, sin = jnp.cos(angles)[None, :, None], jnp.sin(angles)[None, :, None]
    heads, hd, eps = cfg.num_heads, cfg.head_dim, cfg.layer_norm_eps

    def layer(h, lw):
        x = _layer_norm(h, lw["attn_norm_scale"], lw["attn_norm_bias"], eps)
        q = (x @ lw["wq"] + lw["bq"]).reshape(n, -1, heads, hd)
        k = (x @ lw["wk"] + lw["bk"]).reshape(n, -1, heads, hd)
        v = (x @ lw["wv"] + lw["bv"]).reshape(n, -1, heads, hd)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        scores = jnp.einsum("nqhd,nkhd->nhqk", q, k, preferred_element_type=jnp.float32) * hd ** -0.5
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        o = jnp.einsum("nhqk,nkhd->nqhd", probs, v).reshape(n, -1, heads * hd)
        h = h + o @ lw["wo"] + lw["bo"]
        x = _layer_norm(h, lw["mlp_norm_scale"], lw["mlp_norm_bias"], eps)
        return h + _gelu(x @ lw["fc1"] + lw["b1"]) @ lw["fc2"] + lw["b2"], None

    h, _ = jax.lax.scan(layer, h, w["layers"])
    h = _layer_norm(h, w["post_norm"]["scale"], w["post_norm"]["bias"], eps)[:, :-1]
    h = pixel_shuffle(h, cfg.pixel_shuffle_ratio)
    h = _gelu(_gelu(h @ w["adapter_fc1"]) @ w["adapter_fc2"])
    return h @ w["projector"]


def tile_bucket(tiles: int) -> int:
    """The smallest `TILE_BUCKETS` count holding `tiles` (ValueError past the largest)."""
    for b in TILE_BUCKETS:
        if tiles <= b:
            return b
    raise ValueError(f"{tiles} tiles: an encoder call takes at most {TILE_BUCKETS[-1]}")


@functools.partial(jax.jit, static_argnums=0)
def _encode_bucket(cfg: VisionConfig, weights: dict, pixels: Array) -> Array:
    return encode_tiles(cfg, weights, pixels)


def encode_padded(cfg: VisionConfig, weights: dict, pixels: Float[Array, "N C H W"] | np.ndarray,
                  sharding: jax.sharding.Sharding | None = None) -> Float[Array, "B P E"]:
    """`encode_tiles` jitted at the tile bucket B of `pixels`, padded with blank tiles (whose outputs
    follow the image's), so each bucket compiles once. `sharding`: where the pixels go, the weights'
    placement (on a mesh, replicated: every device encodes, and the outputs are on every device)."""
    pixels = np.asarray(pixels, np.float32)
    padded = np.zeros((tile_bucket(pixels.shape[0]), *pixels.shape[1:]), np.float32)
    padded[:pixels.shape[0]] = pixels
    return _encode_bucket(cfg, weights, jax.device_put(padded, sharding))


def device_bytes(cfg: VisionConfig, dtype, sharding: jax.sharding.Sharding | None = None) -> tuple[int, int]:
    """(the tower's weights, the temporaries of an encoder call at the largest tile bucket) on one device,
    from shapes alone (XLA's memory analysis of the compiled call, placed on `sharding` as the engine
    places it: replicated, so whole on each device). A pool sized from device memory leaves room for
    them, since the engine places the tower after sizing it and encodes while a step runs."""
    weights = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                           nnx.eval_shape(lambda: VisionTower(cfg, dtype)).weights())
    side = cfg.image_size
    pixels = jax.ShapeDtypeStruct((TILE_BUCKETS[-1], cfg.num_channels, side, side), jnp.float32, sharding=sharding)
    temporaries = _encode_bucket.lower(cfg, weights, pixels).compile().memory_analysis().temp_size_in_bytes
    return sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(weights)), int(temporaries)


def encode(cfg: VisionConfig, weights: dict, pixels: Float[Array, "N C H W"] | np.ndarray) -> Array:
    """`encode_padded` without the blank tiles' outputs."""
    return encode_padded(cfg, weights, pixels)[:np.shape(pixels)[0]]


# HF parameter names (`Llama4ForConditionalGeneration`: `vision_model.` and `multi_modal_projector.`)
# of each `VisionTower` weight; per-layer ones have `{i}`. Linear weights are [out, in] in HF.
_HF_LAYER = {
    "attn_norm_scale": ("input_layernorm.weight", False), "attn_norm_bias": ("input_layernorm.bias", False),
    "wq": ("self_attn.q_proj.weight", True), "bq": ("self_attn.q_proj.bias", False),
    "wk": ("self_attn.k_proj.weight", True), "bk": ("self_attn.k_proj.bias", False),
    "wv": ("self_attn.v_proj.weight", True), "bv": ("self_attn.v_proj.bias", False),
    "wo": ("self_attn.o_proj.weight", True), "bo": ("self_attn.o_proj.bias", False),
    "mlp_norm_scale": ("post_attention_layernorm.weight", False),
    "mlp_norm_bias": ("post_attention_layernorm.bias", False),
    "fc1": ("mlp.fc1.weight", True), "b1": ("mlp.fc1.bias", False),
    "fc2": ("mlp.fc2.weight", True), "b2": ("mlp.fc2.bias", False),
}


def random_weights(cfg: VisionConfig, dtype, seed: int = 0) -> dict:
    """A `dummy:` model's tower (the pytree `encode` takes), drawn on the device as its text weights are
    (models/registry.py: normal with spread 0.02, norm scales one, biases zero)."""
    from infire_jax.models.registry import random_weight

    tower = nnx.eval_shape(lambda: VisionTower(cfg, dtype))
    params = sorted((k, p) for k, p in vars(tower).items() if isinstance(p, nnx.Param))
    for i, (_, p) in enumerate(params):
        p.set_value(random_weight(i, p, seed, None, None))
    return tower.weights()


def weights_from_hf(cfg: VisionConfig, tensors: dict[str, np.ndarray], dtype=jnp.float32) -> dict:
    """`VisionTower`'s weights (the pytree `encode` takes) from HF tensors by name (numpy arrays)."""
    def t(name: str, transpose: bool = False) -> np.ndarray:
        if name not in tensors:
            raise KeyError(f"the checkpoint has no {name!r}: not a Llama 4 vision tower")
        a = np.asarray(tensors[name], np.float32)
        return a.T if transpose else a

    v = "vision_model."
    layers = {k: jnp.asarray(np.stack([t(f"{v}model.layers.{i}.{name}", tr) for i in range(cfg.num_layers)]), dtype)
              for k, (name, tr) in _HF_LAYER.items()}
    return {
        "patch_embedding": jnp.asarray(t(f"{v}patch_embedding.linear.weight", True), dtype),
        "class_embedding": jnp.asarray(t(f"{v}class_embedding"), dtype),
        "positions": jnp.asarray(t(f"{v}positional_embedding_vlm"), dtype),
        "pre_norm": {"scale": jnp.asarray(t(f"{v}layernorm_pre.weight"), dtype),
                     "bias": jnp.asarray(t(f"{v}layernorm_pre.bias"), dtype)},
        "post_norm": {"scale": jnp.asarray(t(f"{v}layernorm_post.weight"), dtype),
                      "bias": jnp.asarray(t(f"{v}layernorm_post.bias"), dtype)},
        "layers": layers,
        "adapter_fc1": jnp.asarray(t(f"{v}vision_adapter.mlp.fc1.weight", True), dtype),
        "adapter_fc2": jnp.asarray(t(f"{v}vision_adapter.mlp.fc2.weight", True), dtype),
        "projector": jnp.asarray(t("multi_modal_projector.linear_1.weight", True), dtype),
    }
