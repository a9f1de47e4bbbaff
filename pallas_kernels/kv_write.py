"""Pallas kernel that scatters this step's keys and values into the paged pool, in place.

The pool is aliased input -> output (`input_output_aliases`), so no copy of the pool is made: the
kernel only stores the T x Hkv rows of this step. Grid: (token blocks, kv heads); a program loads
`block_t` consecutive tokens' [D] rows of one head and stores each at its slot
(`page = slot // page_size`, `offset = slot % page_size`) of layer `layer`. Padding tokens target
the null page, where concurrent stores to one slot are harmless.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from pallas_kernels.triton_backend import compiler_params, lowered_once

# Tokens per program: enough rows per store to keep the memory system busy, few enough to leave
# programs for every SM when T is small.
MAX_BLOCK_TOKENS = 64


def token_block(num_tokens: int) -> int:
    """Largest power of two <= MAX_BLOCK_TOKENS that divides T (T is a bucket size)."""
    block = 1
    while block * 2 <= MAX_BLOCK_TOKENS and num_tokens % (block * 2) == 0:
        block *= 2
    return block


def _write_kernel(layer_ref, slot_ref, k_ref, v_ref, k_pages_alias, v_pages_alias, k_pages_ref, v_pages_ref, *,
                  block_t: int, page_size: int):
    del k_pages_alias, v_pages_alias  # the same buffers as the outputs
    tokens = pl.ds(pl.program_id(0) * block_t, block_t)
    kv_head = pl.program_id(1)
    layer = layer_ref[0]
    slots = slot_ref[tokens]
    page, offset = lax.div(slots, page_size), lax.rem(slots, page_size)
    k_pages_ref[layer, page, offset, kv_head, :] = k_ref[tokens, kv_head, :].astype(k_pages_ref.dtype)
    v_pages_ref[layer, page, offset, kv_head, :] = v_ref[tokens, kv_head, :].astype(v_pages_ref.dtype)


@lowered_once("interpret")
def write_kv_pages(
    k_pages: Float[Array, "L N ps Hkv D"],
    v_pages: Float[Array, "L N ps Hkv D"],
    layer: Int[Array, ""],
    k: Float[Array, "T Hkv D"],
    v: Float[Array, "T Hkv D"],
    slot_mapping: Int[Array, "T"],
    *,
    interpret: bool = False,
) -> tuple[Float[Array, "L N ps Hkv D"], Float[Array, "L N ps Hkv D"]]:
    """Stores k/v of every token at its flat slot of layer `layer`; returns the (same) pool buffers."""
    t, hkv, d = k.shape
    page_size = k_pages.shape[2]
    block_t = token_block(t)
    whole = pl.BlockSpec()
    return pl.pallas_call(
        functools.partial(_write_kernel, block_t=block_t, page_size=page_size),
        grid=(t // block_t, hkv),
        in_specs=[whole] * 6,
        out_specs=[whole, whole],
        out_shape=[jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)],
        input_output_aliases={4: 0, 5: 1},
        compiler_params=compiler_params(num_warps=4 if d <= 64 else 8, num_stages=1),
        interpret=interpret,
        name="write_kv_pages",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), slot_mapping.astype(jnp.int32), k, v, k_pages, v_pages)
