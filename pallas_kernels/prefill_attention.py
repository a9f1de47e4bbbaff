"""Pallas ragged prefill attention over the paged KV pool: causal, one launch for all chunks.

Rows whose step holds two or more tokens (prefill chunks, with or without a cached prefix) are
handled here. Each such row is cut into query blocks of `block_q` tokens; the list of (row, block)
work items is built on the device from `cu_q_lens` and `kv_lens`, so chunks of any lengths share
one launch. Grid: (work items W, kv heads Hkv). A program's tile has block_q * Gp rows: the G query
heads of one kv head for each of its tokens (G padded to a power of two Gp), so every key block
is read once per group. It runs an online softmax over keys `[0, last position of its tokens]`,
`block_k` keys at a time through the page table, masking keys after each row's own position.
W = ceil(T / block_q) + min(S, T // 2) bounds the items of any step (each row adds at most one
partial block, and a row here has >= 2 tokens); items past the step's count return at once, without
writing their (never gathered) output block.

A local layer (`meta.local`) starts a program's key loop at the block holding the first key its
first token sees (`first_visible` of the first position: the tile's later tokens see no earlier
key), and masks each row's keys before its own first visible one.

Attention sinks (gpt-oss: a learned logit per query head, one more softmax column whose value is
dropped) fold into a tile's running max and sum once its key loop ends, each row its head's: the
sink's column carries no value, so no key block needs it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels.kv_quant import compute_dtype
from pallas_kernels.metadata import AttentionMetadata, first_visible
from pallas_kernels.paged_block import (SoftmaxState, attend_block, initial_state, layer_scalars, load_key_block,
                                        local_mask)
from pallas_kernels.triton_backend import compiler_params, dot_precision, lowered_once, next_power_of_2, pipeline_stages

TILE_ROWS = 128  # block_q * Gp: query rows of one program (for a head of up to WIDE_HEAD dims)
BLOCK_K = 64  # keys per inner step (likewise)
WIDE_HEAD = 256  # wider heads (Gemma 4's full layers: 512) get proportionally fewer rows and keys

# Columns of the work-item table.
ITEM_SEQ, ITEM_Q_START, ITEM_NUM_Q, ITEM_FIRST_POS = range(4)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["table", "token_item", "token_row", "covered"],
                   meta_fields=["block_q"])
@dataclasses.dataclass(frozen=True)
class WorkItems:
    table: Int[Array, "W 4"]  # seq, first flat token, tokens (0: no work), position of the first token
    token_item: Int[Array, "T"]  # work item of each token (meaningful where `covered`)
    token_row: Int[Array, "T"]  # index of the token inside its item's query block
    covered: Bool[Array, "T"]  # valid token of a multi-token row
    block_q: int  # tokens of a query block (static)


def for_head_dim(size: int, head_dim: int | None) -> int:
    """A tile size set for heads of WIDE_HEAD dims, scaled down for a wider head so that the program's
    q tile, accumulator and key block keep their bytes (an H100 has 227 KiB of shared memory a block)."""
    return max(1, size * WIDE_HEAD // max(head_dim or WIDE_HEAD, WIDE_HEAD))


def block_q_of(group: int, tile_rows: int = TILE_ROWS) -> int:
    """Tokens of a query block when a kv head serves `group` query heads (padded to a power of two)."""
    return max(1, tile_rows // next_power_of_2(group))


def plan_step(meta: AttentionMetadata, num_tokens: int, group: int, head_dim: int | None = None) -> AttentionMetadata:
    """`meta` with this step's work items, for a layer loop to build once rather than in every layer
    (they depend on the step alone; XLA keeps them inside the loop otherwise: bench gpu-compile)."""
    return meta._replace(prefill_items=work_items(meta, num_tokens,
                                                  block_q_of(group, for_head_dim(TILE_ROWS, head_dim))))


def prefill_rows(meta: AttentionMetadata) -> Bool[Array, "S"]:
    """Valid rows whose step has at least two tokens."""
    q_lens = meta.cu_q_lens[1:] - meta.cu_q_lens[:-1]
    return (q_lens >= 2) & (jnp.arange(q_lens.shape[0]) < meta.num_seqs)


def max_work_items(num_tokens: int, num_rows: int, block_q: int) -> int:
    return -(-num_tokens // block_q) + min(num_rows, num_tokens // 2)


def work_items(meta: AttentionMetadata, num_tokens: int, block_q: int) -> WorkItems:
    """The (row, query block) items of this step and where each token lands in them."""
    s = meta.kv_lens.shape[0]
    cu = meta.cu_q_lens.astype(jnp.int32)
    q_lens = cu[1:] - cu[:-1]
    is_prefill = prefill_rows(meta)
    blocks = jnp.where(is_prefill, -(-q_lens // block_q), 0)
    ends = jnp.cumsum(blocks)
    starts = ends - blocks

    item = jnp.arange(max_work_items(num_tokens, s, block_q), dtype=jnp.int32)
    seq = jnp.searchsorted(ends, item, side="right").astype(jnp.int32)
    has_work = seq < s
    seq = jnp.minimum(seq, s - 1)
    q_offset = (item - starts[seq]) * block_q
    table = jnp.stack([
        seq,
        jnp.where(has_work, cu[seq] + q_offset, 0),
        jnp.where(has_work, jnp.minimum(block_q, q_lens[seq] - q_offset), 0),
        jnp.where(has_work, meta.kv_lens[seq] - q_lens[seq] + q_offset, 0),
    ], axis=1).astype(jnp.int32)

    token = jnp.arange(num_tokens, dtype=jnp.int32)
    token_seq = jnp.clip(meta.seq_ids, 0, s - 1)
    in_row = token - cu[token_seq]
    covered = (token < cu[meta.num_seqs]) & is_prefill[token_seq]
    return WorkItems(table, starts[token_seq] + in_row // block_q, in_row % block_q, covered, block_q)


def _prefill_kernel(scalars_ref, items_ref, page_table_ref, q_ref, k_pages_ref, v_pages_ref, *refs, scale: float,
                    page_size: int, block_k: int, group_rows: int, local: bool, precision):
    sinks_ref, out_ref = refs if len(refs) == 2 else (None, *refs)  # [rows] sinks of the tile's heads, if any
    item, kv_head = pl.program_id(0), pl.program_id(1)
    num_q = items_ref[item, ITEM_NUM_Q]

    @pl.when(num_q > 0)  # an item past the step's count writes nothing: no token reads its block
    def _():
        layer = scalars_ref[0]
        seq = items_ref[item, ITEM_SEQ]
        first_pos = items_ref[item, ITEM_FIRST_POS]
        rows = out_ref.shape[0]
        q = q_ref[pl.ds(items_ref[item, ITEM_Q_START] * group_rows, rows), :]
        row_pos = first_pos + lax.div(jnp.arange(rows, dtype=jnp.int32), group_rows)
        key_end = first_pos + num_q
        key_start, first_block = None, 0
        if local:
            mask = local_mask(scalars_ref)
            key_start = first_visible(mask, first_pos)
            row_first = first_visible(mask, row_pos)
            first_block = lax.div(key_start, block_k)

        def body(j, state):
            pos, k, v = load_key_block(k_pages_ref, v_pages_ref, page_table_ref, layer, seq, kv_head, j * block_k,
                                       key_end, block_k=block_k, page_size=page_size, dtype=q.dtype,
                                       key_start=key_start)
            visible = (pos[None, :] <= row_pos[:, None]) & (pos < key_end)[None, :]
            if local:
                visible = visible & (pos[None, :] >= row_first[:, None])
            return attend_block(state, q, k, v, visible, scale=scale, precision=precision)

        state = lax.fori_loop(first_block, pl.cdiv(key_end, block_k), body, initial_state(*q.shape))
        if sinks_ref is not None:
            state = fold_sinks(state, sinks_ref[...])
        out_ref[...] = (state.acc / state.total[:, None]).astype(out_ref.dtype)  # every row saw key 0 or itself


def fold_sinks(state: SoftmaxState, sinks: Float[Array, "M"]) -> SoftmaxState:
    """The state with one more column per row, logit `sinks` and value 0: the max and sum take it,
    the accumulator only the rescale."""
    row_max = jnp.maximum(state.row_max, sinks)
    rescale = jnp.exp(state.row_max - row_max)
    return SoftmaxState(state.acc * rescale[:, None], row_max, state.total * rescale + jnp.exp(sinks - row_max))


@lowered_once("scale", "tile_rows", "block_k", "interpret")
def prefill_attention(
    q: Float[Array, "T Hq D"],
    k_pages: Float[Array, "L N ps Hkv D"],
    v_pages: Float[Array, "L N ps Hkv D"],
    layer: Int[Array, ""],
    meta: AttentionMetadata,
    *,
    scale: float,
    tile_rows: int | None = None,
    block_k: int | None = None,
    sinks: Float[Array, "Hq"] | None = None,
    interpret: bool = False,
) -> tuple[Float[Array, "T Hq D"], Bool[Array, "T"]]:
    """Causal attention of every token of multi-token rows over its pages (written already), from
    each token's first visible key on for a local layer (`meta.local`). `sinks`: a logit per query
    head (scaled like the scores) that joins each row's softmax and is dropped (gpt-oss); None: plain
    softmax. `tile_rows`, `block_k`: TILE_ROWS and BLOCK_K for the head's width unless given.

    Returns the outputs and which tokens they cover; other tokens' outputs are 0.
    """
    t, hq, d = q.shape
    tile_rows, block_k = tile_rows or for_head_dim(TILE_ROWS, d), block_k or for_head_dim(BLOCK_K, d)
    hkv, page_size = k_pages.shape[3], k_pages.shape[2]
    g = hq // hkv
    gp = next_power_of_2(g)
    block_q = block_q_of(g, tile_rows)
    rows = block_q * gp
    planned = meta.prefill_items
    items = planned if isinstance(planned, WorkItems) and planned.block_q == block_q else work_items(meta, t, block_q)

    # [Hkv, (T + block_q) * Gp, D]: row (token, head in group); the tail keeps every tile in bounds.
    dtype = compute_dtype(k_pages.dtype, q.dtype)
    q_grouped = jnp.pad(q.reshape(t, hkv, g, d).astype(dtype), ((0, block_q), (0, 0), (0, gp - g), (0, 0)))
    q_grouped = q_grouped.transpose(1, 0, 2, 3).reshape(hkv, (t + block_q) * gp, d)

    whole = pl.BlockSpec()
    in_specs = [whole, whole, whole, pl.BlockSpec((None, (t + block_q) * gp, d), lambda w, h: (h, 0, 0)), whole, whole]
    operands = [layer_scalars(layer, meta.local), items.table, meta.page_table.astype(jnp.int32), q_grouped, k_pages,
                v_pages]
    if sinks is not None:  # [Hkv, rows]: row (token, head in group) of a tile gets its head's sink
        grouped = jnp.pad(sinks.astype(jnp.float32).reshape(hkv, g), ((0, 0), (0, gp - g)))
        in_specs.append(pl.BlockSpec((None, rows), lambda w, h: (h, 0)))
        operands.append(jnp.tile(grouped, (1, block_q)))
    out = pl.pallas_call(
        functools.partial(_prefill_kernel, scale=scale, page_size=page_size, block_k=block_k, group_rows=gp,
                          local=meta.local is not None, precision=dot_precision(dtype)),
        grid=(items.table.shape[0], hkv),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, rows, d), lambda w, h: (w, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((items.table.shape[0], hkv, rows, d), q.dtype),
        compiler_params=compiler_params(num_warps=4 if d <= 64 else 8, num_stages=pipeline_stages(dtype)),
        interpret=interpret,
        name="paged_prefill_attention",
    )(*operands)

    item = jnp.clip(items.token_item, 0, items.table.shape[0] - 1)
    per_token = out.reshape(-1, hkv, block_q, gp, d)[item[:, None], jnp.arange(hkv)[None, :], items.token_row[:, None]]
    per_token = per_token[:, :, :g].reshape(t, hq, d)
    return jnp.where(items.covered[:, None, None], per_token, 0).astype(q.dtype), items.covered
