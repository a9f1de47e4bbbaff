"""Pallas decode attention over the paged KV pool: one query token per row, GQA, split-K.

Rows whose step holds exactly one token (decodes, and one-token prefill chunks) are handled here.
Grid: (rows S, kv heads Hkv, splits K). A program takes the G query heads that share one kv head as
the rows of its tile (padded to Gp >= 16, the smallest Triton dot), so each key/value block is read
once for the whole group. The row's context `[0, kv_len)` is cut into `ceil(kv_len / block_k)`
blocks and the blocks into K contiguous ranges of `ceil(blocks / K)`; program k runs an online
softmax over its range and writes its unnormalised partial (acc, max, sum). The combine
(flash-decoding) rescales every partial to the global max: out = sum_k e^(m_k - m) acc_k /
sum_k e^(m_k - m) l_k. K is chosen from the batch so that S * Hkv * K fills the GPU; a split with no
blocks writes (0, MASK_VALUE, 0) and drops out of the combine.

Attention sinks (gpt-oss: a learned logit per query head, one more softmax column whose value is
dropped) join once, in the combine: the sink is one more partial with max sink, sum 1 and acc 0. Folded
per split instead, it would be counted K times.

A local layer's row (`meta.local`) sees keys `[first_visible(kv_len - 1), kv_len)`: the splits cut
only the blocks holding those (`key_block_range`), so a chunked layer reads at most C keys (plus the
rounding to blocks) at any context length, and never a page wholly before the visible range.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels.kv_quant import compute_dtype
from pallas_kernels.metadata import AttentionMetadata, first_visible
from pallas_kernels.prefill_attention import for_head_dim
from pallas_kernels.paged_block import attend_block, initial_state, layer_scalars, load_key_block, local_mask
from pallas_kernels.triton_backend import compiler_params, dot_precision, lowered_once, next_power_of_2, pipeline_stages

BLOCK_K = 128  # keys per inner step
MIN_GROUP_ROWS = 16  # Triton's smallest dot tile
# Programs that keep every SM of an H100/H200 (132 SMs) busy about twice over.
TARGET_PROGRAMS = 264
MAX_SPLITS = 32


def choose_num_splits(num_rows: int, num_kv_heads: int, max_blocks: int) -> int:
    """Fewest splits that give TARGET_PROGRAMS programs, at most one split per key block."""
    wanted = -(-TARGET_PROGRAMS // (num_rows * num_kv_heads))
    return max(1, min(wanted, MAX_SPLITS, max_blocks))


def decode_rows(meta: AttentionMetadata) -> Bool[Array, "S"]:
    """Valid rows whose step is a single token."""
    q_lens = meta.cu_q_lens[1:] - meta.cu_q_lens[:-1]
    return (q_lens == 1) & (jnp.arange(q_lens.shape[0]) < meta.num_seqs)


def key_block_range(kv_len: Int[Array, ""], key_start: Int[Array, ""] | None, split: Int[Array, ""], *,
                    block_k: int, num_splits: int) -> tuple[Int[Array, ""], Int[Array, ""]]:
    """The key blocks [first, last) that split `split` of a row folds in: the blocks holding keys
    [key_start, kv_len) (from key 0 when `key_start` is None, a global layer), cut into `num_splits`
    contiguous ranges of ceil(blocks / num_splits)."""
    num_blocks = pl.cdiv(kv_len, block_k)
    if key_start is None:
        per_split = pl.cdiv(num_blocks, num_splits)
        first = split * per_split
    else:
        first_block = lax.div(key_start, block_k)
        per_split = pl.cdiv(num_blocks - first_block, num_splits)
        first = first_block + split * per_split
    return first, jnp.minimum(first + per_split, num_blocks)


def _decode_kernel(scalars_ref, kv_lens_ref, page_table_ref, q_ref, k_pages_ref, v_pages_ref, acc_ref, max_ref,
                   total_ref, *, scale: float, page_size: int, block_k: int, num_splits: int, local: bool,
                   precision):
    seq, kv_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = scalars_ref[0]
    kv_len = kv_lens_ref[seq]
    key_start = first_visible(local_mask(scalars_ref), jnp.maximum(kv_len - 1, 0)) if local else None
    first, last = key_block_range(kv_len, key_start, split, block_k=block_k, num_splits=num_splits)
    q = q_ref[...]

    def body(j, state):
        pos, k, v = load_key_block(k_pages_ref, v_pages_ref, page_table_ref, layer, seq, kv_head, j * block_k,
                                   kv_len, block_k=block_k, page_size=page_size, dtype=q.dtype, key_start=key_start)
        seen = pos < kv_len if key_start is None else (pos >= key_start) & (pos < kv_len)
        visible = jnp.broadcast_to(seen[None, :], (q.shape[0], block_k))
        return attend_block(state, q, k, v, visible, scale=scale, precision=precision)

    state = lax.fori_loop(first, last, body, initial_state(*q.shape))
    acc_ref[...] = state.acc
    max_ref[...] = state.row_max
    total_ref[...] = state.total


def combine_splits(acc: Float[Array, "K S Hkv Gp D"], row_max: Float[Array, "K S Hkv Gp"],
                   total: Float[Array, "K S Hkv Gp"],
                   sinks: Float[Array, "Hkv Gp"] | None = None) -> Float[Array, "S Hkv Gp D"]:
    """Merges the per-split partial softmaxes into normalised outputs (rows with no keys -> 0). A
    sink logit per (kv head, head in group) is one more column: it joins the max and adds
    exp(sink - max) to the denominator, nothing to the numerator."""
    global_max = jnp.max(row_max, axis=0)
    if sinks is not None:
        global_max = jnp.maximum(global_max, sinks[None])
    weight = jnp.exp(row_max - global_max[None])
    denom = jnp.sum(weight * total, axis=0)
    if sinks is not None:
        denom = denom + jnp.exp(sinks[None] - global_max)
    numer = jnp.sum(weight[..., None] * acc, axis=0)
    return numer / jnp.where(denom > 0, denom, 1.0)[..., None]


@lowered_once("scale", "block_k", "num_splits", "interpret")
def decode_attention(
    q: Float[Array, "T Hq D"],
    k_pages: Float[Array, "L N ps Hkv D"],
    v_pages: Float[Array, "L N ps Hkv D"],
    layer: Int[Array, ""],
    meta: AttentionMetadata,
    *,
    scale: float,
    block_k: int | None = None,
    num_splits: int | None = None,
    sinks: Float[Array, "Hq"] | None = None,
    interpret: bool = False,
) -> tuple[Float[Array, "T Hq D"], Bool[Array, "T"]]:
    """Attention of every single-token row's token over its pages (written already), from its first
    visible key on for a local layer (`meta.local`). `sinks`: a logit per query head (scaled like the
    scores) that joins each row's softmax and is dropped (gpt-oss); None: plain softmax.

    `block_k`: BLOCK_K for the head's width (prefill_attention.for_head_dim) unless given.

    Returns the outputs and which tokens they cover; other tokens' outputs are 0.
    """
    t, hq, d = q.shape
    block_k = block_k or for_head_dim(BLOCK_K, d)
    hkv, page_size = k_pages.shape[3], k_pages.shape[2]
    s, width = meta.page_table.shape
    g = hq // hkv
    gp = max(MIN_GROUP_ROWS, next_power_of_2(g))
    if num_splits is None:
        num_splits = choose_num_splits(s, hkv, -(-width * page_size // block_k))

    is_decode = decode_rows(meta)
    kv_lens = jnp.where(is_decode, meta.kv_lens, 0).astype(jnp.int32)
    first_token = jnp.clip(meta.cu_q_lens[:-1], 0, t - 1)
    dtype = compute_dtype(k_pages.dtype, q.dtype)
    q_rows = q.reshape(t, hkv, g, d)[first_token].astype(dtype)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, gp - g), (0, 0)))

    whole = pl.BlockSpec()
    partial_spec = pl.BlockSpec((None, None, None, gp), lambda i, h, k: (k, i, h, 0))
    acc, row_max, total = pl.pallas_call(
        functools.partial(_decode_kernel, scale=scale, page_size=page_size, block_k=block_k,
                          num_splits=num_splits, local=meta.local is not None, precision=dot_precision(dtype)),
        grid=(s, hkv, num_splits),
        in_specs=[whole, whole, whole, pl.BlockSpec((None, None, gp, d), lambda i, h, k: (i, h, 0, 0)), whole, whole],
        out_specs=[pl.BlockSpec((None, None, None, gp, d), lambda i, h, k: (k, i, h, 0, 0)),
                   partial_spec, partial_spec],
        out_shape=[jax.ShapeDtypeStruct((num_splits, s, hkv, gp, d), jnp.float32),
                   jax.ShapeDtypeStruct((num_splits, s, hkv, gp), jnp.float32),
                   jax.ShapeDtypeStruct((num_splits, s, hkv, gp), jnp.float32)],
        compiler_params=compiler_params(num_warps=4, num_stages=pipeline_stages(dtype)),
        interpret=interpret,
        name="paged_decode_attention",
    )(layer_scalars(layer, meta.local), kv_lens, meta.page_table.astype(jnp.int32), q_rows, k_pages, v_pages)

    if sinks is not None:  # padded heads get a sink too, and are dropped below
        sinks = jnp.pad(sinks.astype(jnp.float32).reshape(hkv, g), ((0, 0), (0, gp - g)))
    rows_out = combine_splits(acc, row_max, total, sinks)[:, :, :g].reshape(s, hq, d)
    valid = jnp.arange(t) < meta.cu_q_lens[meta.num_seqs]
    seq = jnp.clip(meta.seq_ids, 0, s - 1)
    covered = valid & is_decode[seq]
    out = jnp.where(covered[:, None, None], rows_out[seq], 0).astype(q.dtype)
    return out, covered
