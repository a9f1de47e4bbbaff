"""Kept quantized routed experts (quant/grouped.py) are dequantized one expert per row tile inside the
grouped matmul (models/moe.py), never as the layer's whole stack.

Correctness: the per-tile result equals, bit for bit, the same MoE MLP run on `dequantize()` of the
whole stack, and both grouped matmuls (tiled, ragged_dot) on kept experts agree with a float64 numpy
MoE over the experts dequantized independently (numpy's own nibble and scale arithmetic). Memory: XLA's own figures (`memory_analysis().temp_size_in_bytes` of the compiled MLP)
stay far below the layer's experts in full precision, and do not grow when the expert count doubles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infire_jax.models.config import ModelConfig
from infire_jax.models.moe import Routing, moe_mlp, routed_mlp
from infire_jax.quant.grouped import GroupedLayout, dequantize_kept

LAYOUTS = {"int4": GroupedLayout("int4", 32, jnp.bfloat16), "fp8": GroupedLayout("fp8", 32, jnp.float32)}


def _cfg(experts: int, hidden: int, width: int, k: int) -> ModelConfig:
    return ModelConfig(architecture="qwen3_moe", vocab_size=300, hidden_size=hidden, intermediate_size=0,
                       num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, num_experts=experts,
                       num_experts_per_tok=k, moe_intermediate_size=width, norm_topk_prob=True)


def _shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    x, e, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    return {"w_gate_up": (x, e, 2, f), "w_down": (x, f, e)}


def _random_parts(rng, layout: GroupedLayout, name: str, shape: tuple[int, ...]) -> dict[str, jax.Array]:
    """Every int4 nibble value (random words), or fp8 values of a normal weight; positive scales."""
    parts = {}
    for part, (part_shape, dtype) in layout.part_shapes(f"moe_layers.{name}", shape).items():
        if part == "packed":
            parts[part] = jnp.asarray(rng.integers(-2 ** 31, 2 ** 31, part_shape, dtype=np.int64).astype(np.int32))
        elif part == "fp8":
            parts[part] = jnp.asarray(rng.normal(0, 2, part_shape), dtype)
        else:
            parts[part] = jnp.asarray(rng.uniform(0.005, 0.015, part_shape), dtype)
    return parts


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_per_tile_experts_equal_the_whole_stack_dequantized(kind, dtype):
    """Bitwise: each element is dequantize()'s float32 product cast to `dtype` either way, and each tile's
    matmuls get the same operands in the same shapes as when they slice the dequantized stack, so XLA
    runs the same dots. (Whether those dots are right is the next test's.)"""
    cfg = _cfg(experts=16, hidden=256, width=128, k=4)
    rng = np.random.default_rng(7)
    lp = {name: _random_parts(rng, LAYOUTS[kind], name, shape) for name, shape in _shapes(cfg).items()}
    lp["router"] = jnp.asarray(rng.normal(0, 1, (cfg.hidden_size, cfg.num_experts)), dtype)
    x = jnp.asarray(rng.normal(0, 1, (64, cfg.hidden_size)), dtype)
    kept = jax.jit(lambda lp, x: moe_mlp(lp, x, cfg=cfg, impl="tiled"))(lp, x)
    whole = jax.jit(lambda lp, x: moe_mlp(dequantize_kept(lp, x.dtype), x, cfg=cfg, impl="tiled"))(lp, x)
    assert kept.dtype == dtype and float(jnp.max(jnp.abs(whole.astype(jnp.float32)))) > 0.01
    np.testing.assert_array_equal(np.asarray(kept.astype(jnp.float32)), np.asarray(whole.astype(jnp.float32)))


def _dequantized_f64(parts: dict[str, jax.Array], input_axis: int) -> np.ndarray:
    """A kept weight in float64, by numpy alone: int4 words hold 8 consecutive inputs (low nibble first,
    stored q + 8), fp8 values are exact in float64; each input times its group's scale."""
    scale = np.moveaxis(np.asarray(parts["scale"].astype(jnp.float32), np.float64), input_axis, -1)
    if "packed" in parts:
        words = np.moveaxis(np.asarray(parts["packed"]), input_axis, -1).astype(np.int64) & 0xFFFFFFFF
        q = ((words[..., None] >> (4 * np.arange(8))) & 0xF).reshape(*words.shape[:-1], -1) - 8.0
    else:
        q = np.moveaxis(np.asarray(parts["fp8"].astype(jnp.float32), np.float64), input_axis, -1)
    return np.moveaxis(q * np.repeat(scale, q.shape[-1] // scale.shape[-1], axis=-1), -1, input_axis)


def _moe_f64(x: np.ndarray, w_gate_up: np.ndarray, w_down: np.ndarray, experts: np.ndarray,
             weights: np.ndarray) -> np.ndarray:
    """Each token through each of its experts' SwiGLU, one at a time, summed with its routing weights."""
    y = np.zeros_like(x)
    for t, j in np.ndindex(experts.shape):
        gate, up = np.einsum("e,ecf->cf", x[t], w_gate_up[experts[t, j]])
        y[t] += weights[t, j] * ((gate / (1 + np.exp(-gate)) * up) @ w_down[experts[t, j]])
    return y


@pytest.mark.parametrize("impl", ["tiled", "ragged_dot"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_grouped_experts_on_kept_weights_match_a_float64_moe(kind, dtype, impl):
    """Kept experts through the grouped matmul (per tile, or ragged_dot on the stack it dequantizes)
    against a float64 numpy MoE, for a fixed routing with groups of every size: experts unused,
    some over several tiles. Tolerance: float32 rounding, or bfloat16's (weights, activations and
    each product rounded to 8 bits)."""
    cfg = _cfg(experts=16, hidden=256, width=128, k=4)
    rng = np.random.default_rng(8)
    lp = {name: _random_parts(rng, LAYOUTS[kind], name, shape) for name, shape in _shapes(cfg).items()}
    x = jnp.asarray(rng.normal(0, 1, (64, cfg.hidden_size)), dtype)
    popularity = np.arange(cfg.num_experts, 0, -1.0) ** 2
    popularity[5] = 0  # expert 5 gets no row
    experts = np.stack([rng.choice(cfg.num_experts, cfg.num_experts_per_tok, replace=False,
                                   p=popularity / popularity.sum()) for _ in range(x.shape[0])]).astype(np.int32)
    weights = rng.dirichlet(np.ones(cfg.num_experts_per_tok), x.shape[0]).astype(np.float32)
    got = jax.jit(lambda lp, x, r: routed_mlp(lp, x, r, impl=impl))(
        lp, x, Routing(jnp.asarray(weights), jnp.asarray(experts)))
    want = _moe_f64(np.asarray(x.astype(jnp.float32), np.float64), _dequantized_f64(lp["w_gate_up"], -3),
                    _dequantized_f64(lp["w_down"], -2), experts, weights.astype(np.float64))
    err = np.max(np.abs(np.asarray(got.astype(jnp.float32), np.float64) - want)) / np.max(np.abs(want))
    assert got.dtype == dtype and err < (1e-5 if dtype == jnp.float32 else 2e-2), err


def _temp_bytes(fn, cfg: ModelConfig, tokens: int, dtype) -> int:
    """XLA's temporaries of `fn(lp, x)` compiled for kept-int4 experts (shapes only, nothing allocated)."""
    layout = LAYOUTS["int4"]
    lp = {name: {p: jax.ShapeDtypeStruct(s, d) for p, (s, d) in layout.part_shapes(f"moe_layers.{name}", shape).items()}
          for name, shape in _shapes(cfg).items()}
    lp["router"] = jax.ShapeDtypeStruct((cfg.hidden_size, cfg.num_experts), dtype)
    x = jax.ShapeDtypeStruct((tokens, cfg.hidden_size), dtype)
    return jax.jit(fn).lower(lp, x).compile().memory_analysis().temp_size_in_bytes


def test_kept_experts_temporaries_are_one_expert_not_the_layer():
    """64 then 128 int4 experts of hidden 1024 and width 512, 256 tokens top-8, in bfloat16 (the serving
    dtype). Dequantizing the whole stack first needs at least the layer's experts in bfloat16 (201 MB
    at 64 experts); per tile the temporaries are the dispatched rows and one expert (about 19 MB),
    and doubling the experts adds less than one expert in float32 (6 MB), where the whole-stack path
    doubles."""
    dtype, tokens, temps = jnp.bfloat16, 256, {}
    for experts in (64, 128):
        cfg = _cfg(experts=experts, hidden=1024, width=512, k=8)
        layer_bytes = experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size * jnp.dtype(dtype).itemsize
        whole = _temp_bytes(lambda lp, x: moe_mlp(dequantize_kept(lp, x.dtype), x, cfg=cfg), cfg, tokens, dtype)
        temps[experts] = _temp_bytes(lambda lp, x: moe_mlp(lp, x, cfg=cfg), cfg, tokens, dtype)
        assert whole >= layer_bytes, (experts, whole, layer_bytes)  # the measure sees a whole-layer copy
        assert temps[experts] < layer_bytes / 8, (experts, temps[experts], layer_bytes)
    one_expert_f32 = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4
    assert temps[128] < temps[64] + one_expert_f32, temps


def test_plain_bf16_experts_are_not_widened_whole_on_cpu():
    """Plain bfloat16 expert stacks: XLA:CPU widens a bf16 dot operand to float32; unless each trip's
    slice is tied to its expert index it widens the whole stack, hoisted out of the loop (a float32
    copy of every expert). The temporaries stay one expert's, whatever the expert count (on any
    backend: a GPU runs bf16 dots natively and widens nothing)."""
    temps = {}
    for experts in (64, 128):
        cfg = _cfg(experts=experts, hidden=1024, width=512, k=8)
        lp = {name: jax.ShapeDtypeStruct(shape, jnp.bfloat16) for name, shape in _shapes(cfg).items()}
        lp["router"] = jax.ShapeDtypeStruct((cfg.hidden_size, experts), jnp.bfloat16)
        x = jax.ShapeDtypeStruct((8, cfg.hidden_size), jnp.bfloat16)
        temps[experts] = jax.jit(lambda lp, x: moe_mlp(lp, x, cfg=cfg)).lower(lp, x).compile(
        ).memory_analysis().temp_size_in_bytes
    one_expert_f32 = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4
    assert temps[64] < 2 * one_expert_f32 and temps[128] < temps[64] + one_expert_f32, temps
