"""In-kernel building blocks shared by the decode and prefill kernels.

One step of flash attention over the paged pool: gather a block of `block_k` consecutive key
positions of one sequence through its page table, score it against a tile of query rows, and fold
it into the running (acc, max, sum) of an online softmax. Keys are gathered per position (page
table entry, then offset in the page), so the block size is independent of the page size and any
page size works.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels.triton_backend import MASK_VALUE


class SoftmaxState(NamedTuple):
    acc: Float[Array, "M D"]  # sum of p * v, not yet divided by `total`
    row_max: Float[Array, "M"]
    total: Float[Array, "M"]  # sum of p


def initial_state(rows: int, head_dim: int) -> SoftmaxState:
    return SoftmaxState(
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )


def load_key_block(k_pages_ref, v_pages_ref, page_table_ref, layer, seq, kv_head, first_key, key_end, *,
                   block_k: int, page_size: int, dtype) -> tuple[Int[Array, "K"], Array, Array]:
    """Positions, keys and values of `[first_key, first_key + block_k)` of sequence `seq`, in `dtype`
    (an fp8 pool's codes widen here, in registers).

    Positions at or past `key_end` read whatever their slot holds (a clamped page-table entry keeps
    the read in bounds); their values are zeroed so that stale or NaN slots cannot leak into
    `p @ v` through a zero weight.
    """
    pos = first_key + jnp.arange(block_k, dtype=jnp.int32)
    column = jnp.minimum(lax.div(pos, page_size), page_table_ref.shape[1] - 1)
    page = page_table_ref[seq, column]
    offset = lax.rem(pos, page_size)
    k = k_pages_ref[layer, page, offset, kv_head, :].astype(dtype)
    v = v_pages_ref[layer, page, offset, kv_head, :].astype(dtype)
    v = jnp.where((pos < key_end)[:, None], v, jnp.zeros_like(v))
    return pos, k, v


def attend_block(state: SoftmaxState, q: Float[Array, "M D"], k: Float[Array, "K D"], v: Float[Array, "K D"],
                 visible: Bool[Array, "M K"], *, scale: float, precision) -> SoftmaxState:
    """Folds one key block into the online softmax; invisible keys get exactly zero weight.

    Their logits are MASK_VALUE, so their weight is exp(MASK_VALUE - max) = 0 once a row has seen one
    visible key. Every row has by its first block: key 0 (prefill), or a key below kv_len (decode).
    """
    logits = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32) * scale
    logits = jnp.where(visible, logits, MASK_VALUE)
    row_max = jnp.maximum(state.row_max, jnp.max(logits, axis=1))
    rescale = jnp.exp(state.row_max - row_max)
    p = jnp.exp(logits - row_max[:, None])
    total = state.total * rescale + jnp.sum(p, axis=1)
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)
    return SoftmaxState(state.acc * rescale[:, None] + pv, row_max, total)
