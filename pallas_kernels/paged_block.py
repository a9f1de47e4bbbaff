"""In-kernel building blocks shared by the decode and prefill kernels.

One step of flash attention over the paged pool: gather a block of `block_k` consecutive key
positions of one sequence through its page table, score it against a tile of query rows, and fold
it into the running (acc, max, sum) of an online softmax. Keys are gathered per position (page
table entry, then offset in the page), so the block size is independent of the page size and any
page size works.

A local layer's key loop starts at the block holding the first key its tile sees
(`metadata.first_visible`); that block may begin on pages the layer no longer holds (the null
page, any bits), so keys before `key_start` are masked and their values zeroed like those past the
end.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels.metadata import LocalMask
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


def layer_scalars(layer: Int[Array, ""], local: LocalMask | None) -> Int[Array, "N"]:
    """The kernels' scalar operand: [layer], or [layer, chunk, window] for a local layer."""
    if local is None:
        return jnp.reshape(layer, (1,)).astype(jnp.int32)
    return jnp.stack([jnp.asarray(x).astype(jnp.int32) for x in (layer, *local)])


def local_mask(scalars_ref) -> LocalMask:
    """In a kernel: the local layer's mask from its scalar operand (`layer_scalars`)."""
    return LocalMask(scalars_ref[1], scalars_ref[2])


def load_key_block(k_pages_ref, v_pages_ref, page_table_ref, layer, seq, kv_head, first_key, key_end, *,
                   block_k: int, page_size: int, dtype, key_start=None) -> tuple[Int[Array, "K"], Array, Array]:
    """Positions, keys and values of `[first_key, first_key + block_k)` of sequence `seq`, in `dtype`
    (an fp8 pool's codes widen here, in registers).

    Positions at or past `key_end`, or before `key_start` (a local layer's), read whatever their slot
    holds (a clamped page-table entry keeps the read in bounds); their values are zeroed so that
    stale or NaN slots cannot leak into `p @ v` through a zero weight.
    """
    pos = first_key + jnp.arange(block_k, dtype=jnp.int32)
    column = jnp.minimum(lax.div(pos, page_size), page_table_ref.shape[1] - 1)
    page = page_table_ref[seq, column]
    offset = lax.rem(pos, page_size)
    k = k_pages_ref[layer, page, offset, kv_head, :].astype(dtype)
    v = v_pages_ref[layer, page, offset, kv_head, :].astype(dtype)
    held = pos < key_end if key_start is None else (pos >= key_start) & (pos < key_end)
    v = jnp.where(held[:, None], v, jnp.zeros_like(v))
    return pos, k, v


def attend_block(state: SoftmaxState, q: Float[Array, "M D"], k: Float[Array, "K D"], v: Float[Array, "K D"],
                 visible: Bool[Array, "M K"], *, scale: float, precision) -> SoftmaxState:
    """Folds one key block into the online softmax; invisible keys get exactly zero weight.

    Their logits are MASK_VALUE, so their weight is exp(MASK_VALUE - max) = 0 once a row has seen one
    visible key. Every row has by its first block (key 0 in prefill, a key below kv_len in decode),
    except a local layer's prefill row whose first visible key lies in a later block: until then its
    max stays MASK_VALUE and it sums finite values (zero or held ones) with weight 1, and its first
    visible key rescales all of that by exp(MASK_VALUE - max) = 0.
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
