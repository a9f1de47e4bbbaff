"""Building blocks shared by the decoder models: parameters with logical axes, RMSNorm, RoPE."""

from __future__ import annotations

import math
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from infire_jax.errors import ConfigError
from pallas_kernels import cpu_matmul
from infire_jax.models import yarn
from infire_jax.models.config import ModelConfig
from pallas_kernels import placement
from pallas_kernels.metadata import AttentionMetadata, LocalMask


def param(shape: tuple[int, ...], axes: tuple[str, ...], dtype, *, init: str = "normal") -> nnx.Param:
    """A parameter tagged with its logical axis names (`sharding` maps them to mesh axes).

    Models are only ever built abstractly (`nnx.eval_shape`): loaders put real weights in place,
    and `registry` draws random `dummy:` weights following the `init` tag ("normal", "ones", "zeros").
    """
    assert len(shape) == len(axes), (shape, axes)
    return nnx.Param(jnp.zeros(shape, dtype), axes=axes, init=init)


LAYER_LOOPS = ("auto", "scan", "unrolled")
# Steps of up to this many tokens are decode-sized: their kernels are short, so what a loop trip adds
# (its counter, its test, a copy of each small per-layer weight out of its stack) is a visible share.
UNROLL_MAX_TOKENS = 64


def layer_loop_kind(tokens: int) -> str:
    """How the models run their stacked layers in a step of `tokens` tokens: `unrolled` on a GPU for
    decode-sized steps, `scan` otherwise (INFIRE_JAX_LAYER_LOOP=scan|unrolled|auto chooses). A scan
    compiles one layer body whatever the depth; unrolled, a trip's counter, test and slice copies are
    gone (the layer index and per-layer weights become constants or fuse into their consumers: 20 ->
    14 launches a layer of the 8B decode burst, docs/PERFORMANCE.md), for a compile several times
    longer (the 8B burst's 1.4 -> 8.4 s, Llama 4 Scout's 46 s), paid once a program (the executable
    cache). A prompt chunk's matmuls dwarf the loop, so its program keeps the scan."""
    kind = os.environ.get("INFIRE_JAX_LAYER_LOOP", "auto")
    if kind not in LAYER_LOOPS:
        raise ConfigError(f"INFIRE_JAX_LAYER_LOOP={kind!r}; choose one of {LAYER_LOOPS}")
    if kind == "auto":
        return "unrolled" if placement.platform() == "gpu" and tokens <= UNROLL_MAX_TOKENS else "scan"
    return kind


def layer_loop(body: Callable[[Any, Any], tuple[Any, None]], carry: Any, xs: Any, length: int, tokens: int) -> Any:
    """`lax.scan(body, carry, xs)[0]` over `length` layers, or the same trips unrolled
    (`layer_loop_kind`), layer i's ops under the name scope `layer{i}` (bench/program_stats.py counts
    a layer's launches by it). Give per-layer indices in `xs` as numpy arrays, so that unrolled each
    layer's is a constant."""
    if layer_loop_kind(tokens) == "scan":
        return jax.lax.scan(body, carry, xs, length=length)[0]
    for i in range(length):
        with jax.named_scope(f"layer{i}"):
            carry, _ = body(carry, jax.tree.map(lambda a: a[i], xs))
    return carry


def swiglu(gate: Float[Array, "... F"], up: Float[Array, "... F"]) -> Float[Array, "... F"]:
    """silu(gate) * up computed in float32 and rounded once to the inputs' dtype (torch's bfloat16 silu
    computes in float32 too, rounding once more before the product). XLA CPU would otherwise round each
    op of silu to bfloat16 (neg, exp, add, divide, multiply: 11% of a 512-token bfloat16 prefill of the
    default model, docs/PERFORMANCE.md)."""
    f32 = jnp.float32
    return (jax.nn.silu(gate.astype(f32)) * up.astype(f32)).astype(gate.dtype)


def rms_norm(x: Float[Array, "... E"], weight: Float[Array, "E"], eps: float) -> Float[Array, "... E"]:
    """RMSNorm computed in float32, returned in the input dtype (as HF does)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * xf).astype(x.dtype)


def final_logits(h: Float[Array, "S E"], final_norm: Float[Array, "E"], head: Float[Array, "V E"], eps: float,
                 one_device: bool) -> Float[Array, "S V"]:
    """Final norm and LM head (`head_logits`): float32 logits, the head read once in place (on one
    device, a CPU's bfloat16 head goes through the FFI call, where XLA would convert it whole every step)."""
    h = rms_norm(h, final_norm, eps)
    if one_device and cpu_matmul.head_applies(h.shape[0], head):
        return cpu_matmul.head_matmul(h, head)
    return head_logits(h, head)


def head_logits(h: Float[Array, "S E"], head: Float[Array, "V E"]) -> Float[Array, "S V"]:
    """h times the [V, E] head (read in place, never transposed), as float32 logits.

    A float32 head: full precision named on the dot itself, so no caller's context makes it TF32.
    A 16-bit head off the CPU: a dot in the head's dtype (cuBLAS accumulates in float32), its output
    cast to float32 after, as vLLM does. XLA's OperandUpcaster rewrites a dot whose output is wider
    than its operands into float32 operands: on an H100 that converted the whole head to float32
    every step (1.1 ms), then read it again. On the CPU it is the other way round (XLA converts the
    head of a bfloat16-output dot whole, hoisted out of a decode burst): there the dot gives float32.
    """
    dims = (((1,), (1,)), ((), ()))
    if head.dtype == jnp.float32:
        return jax.lax.dot_general(h.astype(jnp.float32), head, dims, precision=jax.lax.Precision.HIGHEST)
    h = h.astype(head.dtype)
    if placement.platform() == "cpu":
        return jax.lax.dot_general(h, head, dims, preferred_element_type=jnp.float32)
    return jax.lax.dot_general(h, head, dims).astype(jnp.float32)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse RoPE frequencies [rotary dims / 2], with linear, Llama-3, YaRN or LongRoPE scaling applied
    (YaRN's and LongRoPE's factor on cos and sin is `rope_cos_sin`'s)."""
    d = cfg.rotary_dim or cfg.head_dim
    if cfg.rope_scaling is not None and cfg.rope_scaling.kind == "yarn":
        return yarn.inv_freq(cfg, d)
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    if cfg.rope_freq_factors is not None:
        inv = inv / np.asarray(cfg.rope_freq_factors, np.float64)
    rs = cfg.rope_scaling
    if rs is not None and rs.kind == "linear":
        inv = inv / rs.factor
    elif rs is not None and rs.kind == "longrope":
        inv = inv / np.asarray(rs.freq_factors, np.float64)
    elif rs is not None and rs.kind == "llama3":
        old = rs.original_max_position_embeddings
        low_wavelen = old / rs.low_freq_factor
        high_wavelen = old / rs.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
        with np.errstate(divide="ignore", invalid="ignore"):  # equal factors (Llama 4 Scout): no medium band
            smooth = (old / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
            smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def rope_cos_sin(cfg: ModelConfig, positions: Int[Array, "T"]) -> tuple[Float[Array, "T half"], Float[Array, "T half"]]:
    """A model's cos and sin tables over its rotary dimensions: `rope_tables` of its frequencies, times
    YaRN's or LongRoPE's attention factor (transformers' `attention_scaling`)."""
    cos, sin = rope_tables(rope_inv_freq(cfg), positions)
    rs = cfg.rope_scaling
    factor = 1.0 if rs is None else yarn.cos_sin_factor(rs) if rs.kind == "yarn" else \
        rs.attention_factor if rs.kind == "longrope" else 1.0
    return (cos * factor, sin * factor) if factor != 1.0 else (cos, sin)


def rope_tables(inv_freq: np.ndarray, positions: Int[Array, "T"]) -> tuple[Float[Array, "T half"], Float[Array, "T half"]]:
    """cos and sin of position * frequency, in float32, computed once per step for all layers."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: Float[Array, "T *H D"], cos: Float[Array, "T half"],
               sin: Float[Array, "T half"]) -> Float[Array, "T *H D"]:
    """Rotary embedding in the HF "rotate half" layout (GGUF's interleaved q/k are unpermuted at load),
    over the first 2 * half dimensions of each head; the rest pass unrotated (a partial rotation)."""
    half = cos.shape[-1]
    xf = x[..., :2 * half].astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    heads = (1,) * (x.ndim - 2)  # [T, H, D], or [T, Hkv, G, D]
    c, s = cos.reshape(cos.shape[0], *heads, half), sin.reshape(sin.shape[0], *heads, half)
    rotated = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)
    return rotated if 2 * half == x.shape[-1] else jnp.concatenate([rotated, x[..., 2 * half:]], axis=-1)


def local_attention_table(cfg: ModelConfig, num_layers: int, stage_axis: str = "pp") -> Int[Array, "L 2"] | None:
    """Each layer's (chunk, window) as an int32 [L, 2] table, for a layer scan over `num_layers` stacked
    layers to scan beside the weights, so that one layer body serves layers of every kind
    (`with_local_mask`); None when every layer is global, so that such a model's programs carry no
    mask code at all. A scan over fewer layers than the (placed) model has is a pipeline stage's, inside
    the mesh's shard_map: it gets the rows of its own stage, the `stage_axis` index's slice."""
    if not cfg.has_local_attention:
        return None
    return stage_rows(jnp.asarray(cfg.local_attention, jnp.int32), num_layers, stage_axis)


def nope_table(cfg: ModelConfig, num_layers: int, stage_axis: str = "pp") -> Int[Array, "L"] | None:
    """Each layer's NoPE flag (1: q and k are not rotated) as an int32 [L] table, a pipeline stage's rows
    as `local_attention_table`'s; None when every layer rotates."""
    if not any(cfg.nope_layers):
        return None
    return stage_rows(jnp.asarray(cfg.nope_layers, jnp.int32), num_layers, stage_axis)


def stage_rows(table: Int[Array, "L ..."], num_layers: int, stage_axis: str = "pp") -> Int[Array, "N ..."]:
    """A per-layer table's rows for a layer scan over `num_layers` stacked layers: all of them, or, for a
    pipeline stage's scan (fewer layers than the table has, inside the mesh's shard_map), the
    `stage_axis` index's slice."""
    if len(table) == num_layers:
        return table
    if len(table) % num_layers:
        raise ConfigError(f"a layer scan over {num_layers} layers is no pipeline stage of the model's {len(table)}")
    return jax.lax.dynamic_slice_in_dim(table, jax.lax.axis_index(stage_axis) * num_layers, num_layers)


def with_local_mask(meta: AttentionMetadata, row: Int[Array, "2"] | None) -> AttentionMetadata:
    """The step's metadata for a layer whose row of `local_attention_table` is `row` (None: unchanged)."""
    return meta if row is None else meta._replace(local=LocalMask(row[0], row[1]))
