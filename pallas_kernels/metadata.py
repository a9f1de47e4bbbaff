"""The contract between the runner and every attention implementation.

A step processes a flat, padded batch of T tokens that belong to S sequences (decodes and
prefill chunks mixed). Tokens of one sequence are contiguous and in position order.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int


class LocalMask(NamedTuple):
    """Which keys a layer's query sees besides causality. chunk C > 0: a query at position p sees keys in
    [C*floor(p/C), p] (Llama 4's chunked attention); window W > 0: keys in [p-W+1, p] (sliding window);
    both 0: every key <= p (a global layer). Traced int32 scalars, so one scanned layer body serves
    layers of every kind; both > 0 means both bounds apply (the later start wins)."""
    chunk: Int[Array, ""]
    window: Int[Array, ""]


def first_visible(local: LocalMask, positions: Int[Array, "..."]) -> Int[Array, "..."]:
    """The first key position a query at each of `positions` sees (0 for a global layer).

    Written with `lax.rem` and selects only, so the Pallas kernels call it on their own rows too.
    Non-decreasing in the position: a run of a row's tokens sees from its first token's start on.
    """
    positions = jnp.asarray(positions)
    chunk = jnp.asarray(local.chunk).astype(positions.dtype)
    window = jnp.asarray(local.window).astype(positions.dtype)
    in_chunk = lax.rem(positions, jnp.broadcast_to(jnp.maximum(chunk, 1), positions.shape))
    chunk_start = jnp.where(chunk > 0, positions - in_chunk, 0)
    window_start = jnp.where(window > 0, positions - window + 1, 0)
    return jnp.maximum(jnp.maximum(chunk_start, window_start), 0)


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
    # The layer's chunked / sliding-window mask (set per layer by the layer scan); None: every layer is
    # global, static, and the kernels compile without any mask code.
    local: LocalMask | None = None
    # A hybrid KV cache of G > 1 groups (infire_jax/core/kv_groups.py): each group's page table and slot
    # mapping, and each layer's (index in the pool, group). `paged_attention` gives a layer its
    # group's table and mapping and its index in the pool [s, N, ...], s layers a page (`for_layer`);
    # `page_table` and `slot_mapping` above are then group 0's. None (static): one group, the pool [L, N, ...].
    group_page_tables: Int[Array, "G S P"] | None = None
    group_slot_mappings: Int[Array, "G T"] | None = None
    layer_kv: Int[Array, "L 2"] | None = None
    # The prefill kernel's work items of this step (prefill_attention.WorkItems), built once before the
    # layer loop (`prefill_attention.plan_step`): the same for every layer. None: built where used.
    prefill_items: object | None = None


def for_layer(meta: AttentionMetadata, layer: Int[Array, ""]) -> tuple[AttentionMetadata, Int[Array, ""]]:
    """The metadata an attention implementation sees for `layer`, and the pool index it uses: with
    group tables, the layer's group's page table and slot mapping and its index in the pool (the group
    fields dropped); otherwise the metadata as it is and the layer itself."""
    if meta.layer_kv is None:
        return meta, layer
    index, group = meta.layer_kv[layer, 0], meta.layer_kv[layer, 1]
    return meta._replace(page_table=meta.group_page_tables[group], slot_mapping=meta.group_slot_mappings[group],
                         group_page_tables=None, group_slot_mappings=None, layer_kv=None), index


def group0_only(meta: AttentionMetadata) -> AttentionMetadata:
    """The metadata as layers outside the hybrid cache's groups see it (a draft model's, an EAGLE-3
    head's: their KV sits on the pages of group 0, a global group): `page_table` and `slot_mapping`
    (group 0's), the group fields dropped. Unchanged for a pool of one group."""
    return meta._replace(group_page_tables=None, group_slot_mappings=None, layer_kv=None)


def require_global(meta: AttentionMetadata, what: str) -> None:
    """Raises (at trace time) for a step with local masks that `what` cannot apply."""
    if meta.local is not None:
        raise ValueError(f"{what} has no chunked or sliding-window attention (meta.local is set); "
                         "only the paged_attention kernels apply LocalMask")


# Page 0 of the pool is never handed out: padding tokens write there and unused
# page-table entries point there, so every gather stays in bounds. A local layer's entries for pages
# wholly before the first key its step's queries see (first_visible of a row's first token) may be
# the null page too (the hybrid cache frees them): no kernel lets what it holds reach an output.
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

    def part(x, axis=0):
        return jax.lax.dynamic_slice_in_dim(x, start, size, axis)

    groups = meta.group_slot_mappings
    return meta._replace(positions=part(meta.positions), slot_mapping=part(meta.slot_mapping),
                         seq_ids=part(meta.seq_ids), kv_lens=kv_lens.astype(meta.kv_lens.dtype), cu_q_lens=cu_local,
                         group_slot_mappings=None if groups is None else part(groups, 1), prefill_items=None)


def deactivate(meta: AttentionMetadata, active) -> AttentionMetadata:
    """When `active` is false, the same shapes with every token padding (writes go to the null page);
    `kv_scales`, `local` and the group tables carry through."""
    assert NULL_PAGE == 0
    rows = meta.kv_lens.shape[0]
    groups = meta.group_slot_mappings
    return meta._replace(
        slot_mapping=jnp.where(active, meta.slot_mapping, 0),  # slot 0 lies in the null page
        group_slot_mappings=None if groups is None else jnp.where(active, groups, 0),
        seq_ids=jnp.where(active, meta.seq_ids, rows),
        kv_lens=jnp.where(active, meta.kv_lens, 0),
        cu_q_lens=jnp.where(active, meta.cu_q_lens, 0), prefill_items=None)
