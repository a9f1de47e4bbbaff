"""The contract between the runner and every attention implementation.

A step processes a flat, padded batch of T tokens that belong to S sequences (decodes and
prefill chunks mixed). Tokens of one sequence are contiguous and in position order.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


class AttentionMetadata(NamedTuple):
    positions: Int[Array, "T"]  # position of each token in its sequence
    slot_mapping: Int[Array, "T"]  # flat cache slot (page * page_size + offset); padding -> null page 0
    seq_ids: Int[Array, "T"]  # row of each token's sequence; padding tokens -> S (out of range)
    page_table: Int[Array, "S P"]  # pages of each sequence; unused entries -> null page 0
    kv_lens: Int[Array, "S"]  # cached tokens after this step; 0 for padding rows
    cu_q_lens: Int[Array, "S1"]  # S + 1 offsets of each sequence's tokens in the flat batch
    num_seqs: Int[Array, ""]  # number of valid rows
    # An fp8 pool's per-(layer, kv head) [k_scale, v_scale] (kv_quant.py); None for a pool in a value dtype.
    kv_scales: Float[Array, "L 2 Hkv"] | None = None


# Page 0 of the pool is never handed out: padding tokens write there and unused
# page-table entries point there, so every gather stays in bounds.
NULL_PAGE = 0


def slice_tokens(meta: AttentionMetadata, start, size: int) -> AttentionMetadata:
    """Tokens [start, start + size) as a step of their own (a pipeline microbatch).

    A sequence's tokens before `start` are then part of its cached context: they were written to
    the pages when the earlier microbatch went through the same layer.
    """
    cu = meta.cu_q_lens
    lo = jnp.clip(cu[:-1], start, start + size)
    hi = jnp.clip(cu[1:], start, start + size)
    q_lens = hi - lo
    kv_lens = jnp.where(q_lens > 0, meta.kv_lens - (cu[1:] - hi), 0)
    cu_local = jnp.concatenate([jnp.zeros(1, cu.dtype), jnp.cumsum(q_lens).astype(cu.dtype)])

    def part(x):
        return jax.lax.dynamic_slice_in_dim(x, start, size)

    return AttentionMetadata(part(meta.positions), part(meta.slot_mapping), part(meta.seq_ids), meta.page_table,
                             kv_lens.astype(meta.kv_lens.dtype), cu_local, meta.num_seqs, meta.kv_scales)


def deactivate(meta: AttentionMetadata, active) -> AttentionMetadata:
    """When `active` is false, the same shapes with every token padding (writes go to the null page)."""
    assert NULL_PAGE == 0
    rows = meta.kv_lens.shape[0]
    return meta._replace(
        slot_mapping=jnp.where(active, meta.slot_mapping, 0),  # slot 0 lies in the null page
        seq_ids=jnp.where(active, meta.seq_ids, rows),
        kv_lens=jnp.where(active, meta.kv_lens, 0),
        cu_q_lens=jnp.where(active, meta.cu_q_lens, 0))
