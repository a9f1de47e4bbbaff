"""The KV cache dtype (`--kv-cache-dtype`) and an fp8 pool's per-(layer, kv head) scales.

fp8 (e4m3) pages hold `k / k_scale` and `v / v_scale` (pallas_kernels/kv_quant.py). The scales
are calibrated once at engine build unless the HF checkpoint has its own (loaders/kv_scales_hf.py):
the model runs a short fixed text into a small float32 pool, and each (layer, head) gets
`amax * MARGIN / 448`, so its largest calibration value lands a factor MARGIN below the top of
e4m3's range (larger ones saturate). e4m3 has 3 mantissa bits wherever a value falls in its ~17
binades, so headroom costs little precision, while a value beyond the calibrated range is clipped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Float

from infire_jax.errors import ConfigError
from infire_jax.models.config import ModelConfig
from infire_jax.models.gated_delta import LinearState, LinearStep, linear_state_shapes
from infire_jax.models.kv_entry import kv_entry
from pallas_kernels.kv_quant import FP8, FP8_MAX
from pallas_kernels.metadata import AttentionMetadata
from sharding.plan import ShardPlan

# vLLM's spellings are accepted too; "auto" is the model's dtype (engine_args.KV_CACHE_DTYPE_CHOICES lists them all).
KV_CACHE_DTYPES = {"bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16, "float32": jnp.float32,
                   "float8_e4m3": FP8, "fp8": FP8, "fp8_e4m3": FP8}

MARGIN = 2.0
_PAGE = 16
# A mix of prose, code, numbers and markup, so that the calibration sees more than one kind of text.
CALIBRATION_TEXT = (
    "The quick brown fox jumps over the lazy dog. In 1969, Apollo 11 landed on the Moon; Neil Armstrong "
    "said: \"That's one small step for man, one giant leap for mankind.\"\n\n"
    "def fibonacci(n: int) -> int:\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "Ingredients: 2 cups flour, 1 tsp salt, 3/4 cup water. Step 1) Mix. Step 2) Knead for 10 minutes.\n"
    "Q: What is 17 * 23? A: 391. Translate to French: 'Good morning, my friend.' -> 'Bonjour, mon ami.'\n"
    "<html><body><h1>Title</h1><p>Paragraph &amp; more</p></body></html> SELECT * FROM users WHERE id = 42;")


def resolve_kv_cache_dtype(name: str, model_dtype) -> jnp.dtype:
    if name == "auto":
        return jnp.dtype(model_dtype)
    if name not in KV_CACHE_DTYPES:
        raise ConfigError(f"unknown kv_cache_dtype {name!r}; choose auto, {', '.join(KV_CACHE_DTYPES)}")
    return jnp.dtype(KV_CACHE_DTYPES[name])


def _calibration_meta(n: int) -> AttentionMetadata:
    """One sequence of n tokens on pages 1 .. (page 0 is the null page)."""
    pages = -(-n // _PAGE)
    pos = np.arange(n, dtype=np.int32)
    return AttentionMetadata(pos, pos + _PAGE, np.zeros(n, np.int32), np.arange(1, pages + 1, dtype=np.int32)[None],
                             np.array([n], np.int32), np.array([0, n], np.int32), np.int32(1))


def calibrate(graphdef: nnx.GraphDef, state: nnx.State, cfg: ModelConfig, token_ids: list[int],
              plan: ShardPlan | None = None) -> Float[np.ndarray, "L 2 Hkv"]:
    """Per (layer, kv head) scales from one forward of `token_ids` into a float32 pool (one compile,
    off the step programs). On a mesh `cfg` is the placed one (kv heads repeated, layers padded) and
    the forward runs sharded like a step, so the scales come out in the pool's layout. A model with
    linear-attention layers (Qwen3.5) runs from a zeroed state in slot 0 (slot 1 the dummy); its pool,
    and so its scales, hold its attention layers alone (`num_kv_layers`)."""
    if not token_ids:
        raise ValueError("calibration needs at least one token")
    n = len(token_ids)
    entry = kv_entry(cfg)
    pages = -(-n // _PAGE) + 1
    k_pages = jnp.zeros((cfg.num_kv_layers, pages, _PAGE, entry.heads, entry.k_dim), jnp.float32)
    v_pages = jnp.zeros((cfg.num_kv_layers, pages, _PAGE, entry.heads, entry.v_dim), jnp.float32)

    @jax.jit
    def run(state, k_pages, v_pages, tokens, meta):
        model = nnx.merge(graphdef, state)
        h = model.embed_tokens(tokens)
        shapes = linear_state_shapes(cfg, 2, h.dtype)
        linear = {} if shapes is None else {"linear": LinearStep(
            LinearState(*(jnp.zeros(shape, dtype) for shape, dtype in shapes)), jnp.zeros(n, jnp.int32))}
        _, (k_pages, v_pages), *_ = model.run_layers(h, (k_pages, v_pages), meta, attn_impl="reference", plan=plan,
                                                     **linear)
        return (jnp.max(jnp.abs(k_pages), axis=(1, 2, 4)), jnp.max(jnp.abs(v_pages), axis=(1, 2, 4)))

    k_amax, v_amax = jax.device_get(run(state, k_pages, v_pages, jnp.asarray(token_ids, jnp.int32),
                                        _calibration_meta(n)))
    amax = np.stack([k_amax, v_amax], axis=1)  # [L, 2, Hkv]
    return (np.maximum(amax, 1e-6) * MARGIN / FP8_MAX).astype(np.float32)
