"""Model construction: architecture -> module class, and loaded weights -> a placed nnx state."""

from __future__ import annotations

import functools
import math
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from infire_jax.compression.resident import ResidentLayout, compress_resident
from infire_jax.errors import UnsupportedModelError
from infire_jax.models.config import ModelConfig
from infire_jax.models.xla_options import ONCE_OVER_WEIGHTS
from infire_jax.models.deepseek import DeepseekV3
from infire_jax.models.gemma3 import Gemma3
from infire_jax.models.gemma4 import Gemma4
from infire_jax.models.glm4_moe import Glm4Moe
from infire_jax.models.gpt_oss import GptOss
from infire_jax.models.llama import Llama
from infire_jax.models.llama4 import Llama4
from infire_jax.models.qwen3_5 import Qwen3_5
from infire_jax.models.palette_kernels import kernel_coding
from infire_jax.quant.resident import QuantLayout
from sharding.plan import ShardPlan

# The Llama-architecture families differ by flags (bias, qk-norm, MoE); the DeepSeek-V3 family has its own module.
MODEL_CLASSES = {"llama": Llama, "qwen2": Llama, "qwen3": Llama, "mixtral": Llama, "qwen3_moe": Llama,
                 "deepseek_v3": DeepseekV3,  # MLA + DeepSeek MoE (models/deepseek.py)
                 "llama4": Llama4,  # chunked / NoPE attention, interleaved dense and MoE layers (models/llama4.py)
                 "gpt_oss": GptOss,  # attention sinks, windowed and full layers, clamped-SwiGLU experts (models/gpt_oss.py)
                 "gemma3": Gemma3,  # windowed and global layers, sandwich norms, GELU MLP (models/gemma3.py)
                 "gemma4": Gemma4,  # Gemma 3's traits, two layer shapes, an optional MoE block (models/gemma4.py)
                 "glm4_moe": Glm4Moe,  # GQA with a partial rotation, DeepSeek-V3's MoE (models/glm4_moe.py)
                 "minimax_m2": Glm4Moe,  # the same, q/k normed over all heads, a MoE every layer
                 "qwen3_5": Qwen3_5}  # Gated DeltaNet layers, a gated attention layer closing each group


def abstract_model(cfg: ModelConfig, dtype, resident: dict[str, ResidentLayout] | None = None) -> nnx.Module:
    cls = MODEL_CLASSES.get(cfg.architecture)
    if cls is None:
        raise UnsupportedModelError(f"unsupported architecture {cfg.architecture!r}")
    return nnx.eval_shape(lambda: cls(cfg, dtype=dtype, resident=resident))


def _place(w: np.ndarray, dtype, sharding: jax.sharding.Sharding | None) -> jax.Array:
    """Puts one weight on its devices; each process materialises only the shards it holds."""
    if sharding is None:
        return jax.device_put(np.asarray(w, dtype=dtype))
    return jax.make_array_from_callback(w.shape, sharding, lambda idx: np.asarray(w[idx], dtype=dtype))


# A dummy's fp8 values are random bytes, the two NaN codes made 0 (a float draw cast to e4m3 is slow to
# compile and run on CPU); their root mean square, over the codes, scales them to the float draw's spread.
_FP8_CODES = np.where((np.arange(256) & 0x7F) == 0x7F, 0, np.arange(256)).astype(np.uint8)
FP8_CODE_RMS = float(np.sqrt(np.mean(np.square(_FP8_CODES.view(jnp.float8_e4m3fn).astype(np.float64)))))
DRAW_CHUNK_ELEMENTS = 1 << 28  # a random draw's temporaries take ~24 bytes an element (XLA CPU): ~6 GiB a chunk


def random_weight(index: int, var: nnx.Param, seed: int, sharding, slot_mask: np.ndarray | None) -> jax.Array:
    """One `dummy:` weight, drawn on its devices by a small program (peak memory: one weight, and one
    chunk's temporaries). Padding slots of short pipeline stages are zero, which makes them identity
    layers."""
    mask = None if slot_mask is None else tuple(bool(b) for b in np.asarray(slot_mask).reshape(-1))
    chunks = draw_chunks(math.prod(var.shape)) if sharding is None else 1  # sharded: each device its shard
    return weight_draw(tuple(var.shape), np.dtype(var.dtype), var.get_metadata()["init"], sharding, mask, chunks)(
        np.uint32(seed), np.uint32(index))


@functools.lru_cache(maxsize=512)
def weight_draw(shape: tuple[int, ...], dtype, init: str, sharding, slot_mask: tuple[bool, ...] | None,
                chunks: int):
    """The jitted program that draws a `dummy:` weight of this shape, kind and placement from (seed,
    weight index), in `chunks` pieces: one program per kind of weight, shared by every weight and
    model that has it."""

    def values(key, shape):
        if init == "ones":
            return jnp.ones(shape, jnp.float32)
        if init == "zeros":
            return jnp.zeros(shape, jnp.float32)
        if init == "int8":  # quantized values (quant/resident.py DUMMY_INIT), drawn a byte each
            return jnp.maximum(jax.lax.bitcast_convert_type(jax.random.bits(key, shape, jnp.uint8), jnp.int8), -127)
        if init == "int8-scale":  # uniform values times this have the normal draw's spread, 0.02
            return jnp.full(shape, 0.02 * 3 ** 0.5 / 127, jnp.float32)
        if init == "fp8":  # every e4m3 value alike: random bytes, NaN codes 0
            bits = jax.random.bits(key, shape, jnp.uint8)
            return jax.lax.bitcast_convert_type(jnp.where(bits & 0x7F == 0x7F, 0, bits).astype(jnp.uint8),
                                                jnp.float8_e4m3fn)
        if init == "fp8-scale":
            return jnp.full(shape, 0.02 / FP8_CODE_RMS, jnp.float32)
        if init == "uint8-bits":  # two random FP4 values a byte (MXFP4)
            return jax.random.bits(key, shape, jnp.uint8)
        if init == "mxfp4-scale":  # e8m0 127 - 7: 2^-7 (quant/grouped.py DUMMY_INIT)
            return jnp.full(shape, 120, jnp.uint8)
        if init == "int4-words":  # eight random nibbles a word
            return jax.lax.bitcast_convert_type(jax.random.bits(key, shape, jnp.uint32), jnp.int32)
        if init == "int4-zero":
            return jnp.full(shape, 8, jnp.float32)
        if init == "int4-scale":  # nibbles 0..15 less 8 have a spread of sqrt(255 / 12)
            return jnp.full(shape, 0.02 / (255 / 12) ** 0.5, jnp.float32)
        return 0.02 * jax.random.normal(key, shape, jnp.float32)

    def draw(seed, index):
        key = jax.random.fold_in(jax.random.key(seed), index)
        if chunks == 1:
            w = values(key, shape).astype(dtype)
        else:  # one chunk's temporaries at a time (whole: 86 GB for 4 layers of Scout's stacked experts)
            w = jax.lax.map(lambda k: values(k, (math.prod(shape) // chunks,)).astype(dtype),
                            jax.random.split(key, chunks)).reshape(shape)
        if slot_mask is not None:
            w = jnp.where(np.array(slot_mask).reshape(-1, *[1] * (len(shape) - 1)), w, jnp.zeros((), dtype))
        return w

    return jax.jit(draw, out_shardings=sharding, compiler_options=ONCE_OVER_WEIGHTS)


def draw_chunks(num_elements: int, limit: int | None = None) -> int:
    """Into how many equal chunks a one-device draw of `num_elements` is cut so that each holds at most
    `limit` (default DRAW_CHUNK_ELEMENTS): the least divisor of the count that does (1: drawn whole)."""
    least = -(-num_elements // (limit or DRAW_CHUNK_ELEMENTS))
    for n in range(least, min(num_elements, 64 * least) + 1):
        if num_elements % n == 0:
            return n
    return 1


def abstract_placement(cfg: ModelConfig, dtype, plan: ShardPlan | None,
                       resident: dict[str, ResidentLayout] | None = None
                       ) -> tuple[nnx.GraphDef, nnx.FlatState, dict[tuple, jax.sharding.Sharding | None]]:
    """The placed model's structure, shapes and each weight's sharding (None: the default device),
    with no weight read: what a checkpoint restore targets and what `build_state` fills."""
    if plan is not None:
        cfg = plan.effective_config(cfg)
    graphdef, abstract = nnx.split(abstract_model(cfg, dtype, resident))
    flat = nnx.to_flat_state(abstract)
    return graphdef, flat, {path: plan.sharding(var.axes) if plan else None for path, var in flat}


def abstract_state(cfg: ModelConfig, dtype, plan: ShardPlan | None,
                   quantized: Mapping[str, QuantLayout] | None = None) -> tuple[nnx.GraphDef, nnx.State]:
    """The placed (uncompressed; with `quantized`, those weights' parts as `build_state` places them)
    weights as shapes, dtypes and shardings only: enough to compile the steps while the weights are
    still being read, or for a GPU this machine does not have (bench/gpu_target.py)."""
    graphdef, flat, shardings = abstract_placement(cfg, dtype, plan, dict(quantized) if quantized else None)
    return graphdef, nnx.from_flat_state([
        (p, var.replace(jax.ShapeDtypeStruct(var.shape, var.dtype, sharding=shardings[p]))) for p, var in flat])


def drawn_weights(cfg: ModelConfig, dtype, *, plan: ShardPlan | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    """A `dummy:` model's weights, drawn on the device(s) as `build_state` draws them, copied to the
    host by parameter path (already in the plan's layout)."""
    _, state = build_state(cfg, None, dtype, plan=plan, seed=seed)
    return {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}


def build_state(cfg: ModelConfig, weights: Mapping[str, np.ndarray] | None, dtype, *,
                plan: ShardPlan | None = None, seed: int = 0,
                compress: tuple[str, ...] = (), quantized: Mapping[str, QuantLayout] | None = None
                ) -> tuple[nnx.GraphDef, nnx.State]:
    """Places the weights on the device(s), each in `dtype` and its sharding.

    With a plan, the model is the plan's effective config (kv heads repeated, layers padded to
    whole pipeline stages) and each device receives only its shard. With `weights=None` the
    model's random init runs on the device itself (for `dummy:` models), so no host copy of a
    multi-GB model is ever made. `compress` names the kinds of weights (`mlp`, `attn`) kept
    palette-compressed on the devices (compression/resident.py); `quantized` maps weights given as
    quantized parts ("layers.wqkv.q4_1", ...) to their layout (quant/resident.py).
    """
    if plan is not None and weights is not None:
        weights = plan.prepare_weights(weights)
    resident = dict(quantized) if quantized else None
    if compress:
        if weights is None:  # drawn weights are compressed on the host, one copy of the model there
            weights = drawn_weights(cfg, dtype, plan=plan, seed=seed)
        _, plain, _ = abstract_placement(cfg, dtype, plan)
        axes = {".".join(map(str, p)): var.axes for p, var in plain}
        coding = None if plan is not None else kernel_coding  # kernels that decode for themselves: one device
        weights, resident = compress_resident(weights, axes, compress, plan, kernel_coding=coding)
    graphdef, flat, shardings = abstract_placement(cfg, dtype, plan, resident)

    if weights is None:
        masks = {}  # each layer stack's slot mask (None: not a stack)
        for path, _ in flat:
            masks.setdefault(path[0], plan.layer_slot_mask(path[0]) if plan else None)
        placed = [(path, var.replace(random_weight(i, var, seed, shardings[path], masks[path[0]])))
                  for i, (path, var) in enumerate(flat)]
        return graphdef, nnx.from_flat_state(placed)

    expected = {".".join(map(str, p)) for p, _ in flat}
    extra = sorted(set(weights) - expected)
    if extra:
        raise UnsupportedModelError(f"weights not used by the {cfg.architecture} model: {extra[:5]}")
    placed = []
    for path, var in flat:
        name = ".".join(map(str, path))
        if name not in weights:
            raise UnsupportedModelError(f"weight {name!r} is missing from the checkpoint")
        w = weights[name]
        if tuple(w.shape) != tuple(var.shape):
            raise UnsupportedModelError(f"weight {name!r} has shape {tuple(w.shape)}, expected {tuple(var.shape)}")
        placed.append((path, var.replace(_place(w, jnp.dtype(var.dtype), shardings[path]))))
    return graphdef, nnx.from_flat_state(placed)
