"""Pallas MLA decode over the latent pool, in the absorbed form: one query token per row, split-K.

Rows whose step holds one token (decodes) come here. Grid: (rows S, head blocks, splits K). A
program takes BLOCK_H query heads as the rows of its tiles (q_lat [BLOCK_H, R], q_pe [BLOCK_H, Dr]),
so each block of latents and rotary keys is read once for all of them. Every head reads the same
latent, so a block of keys serves the whole head block as one MQA group. The score of a key is
q_lat . c + q_pe . k_pe and the value is the latent c itself; the program keeps an online softmax
over its split of the row's blocks and writes the unnormalised partial (acc [BLOCK_H, R], max,
sum), which `decode_attention.combine_splits` merges (flash-decoding). W_uv is applied by the
caller. Key positions are gathered per position through the page table, as paged_block.py does,
so any page size works. An fp8 pool's codes widen to q's dtype in registers; its latent scale
folds into q_lat and the output, its rotary key scale into q_pe (mla_reference.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels.decode_attention import choose_num_splits, combine_splits, decode_rows
from pallas_kernels.kv_quant import compute_dtype
from pallas_kernels.metadata import AttentionMetadata, require_global
from pallas_kernels.paged_block import initial_state
from pallas_kernels.triton_backend import (MASK_VALUE, compiler_params, dot_precision, is_power_of_2, lowered_once,
                                           next_power_of_2, pipeline_stages)

BLOCK_K = 64  # keys per inner step: a [64, 512] latent tile
BLOCK_H = 16  # query heads per program (Triton's smallest dot tile)


def check_mla_supported(kv_lora_rank: int, rope_dim: int, dtype) -> None:
    """Raises a clear error for latent shapes the Triton kernel cannot tile."""
    for name, d in (("kv_lora_rank", kv_lora_rank), ("qk_rope_head_dim", rope_dim)):
        if not is_power_of_2(d) or d < 16:
            raise ValueError(f"the Pallas MLA kernel needs a power-of-two {name} >= 16, got {d}; "
                             "use the 'reference' attention implementation for this model")
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"the Pallas MLA kernel supports float32, bfloat16 and float16 pools, got {dtype}")


def _mla_decode_kernel(layer_ref, kv_lens_ref, page_table_ref, q_lat_ref, q_pe_ref, latent_pages_ref,
                       rope_pages_ref, acc_ref, max_ref, total_ref, *, scale: float, page_size: int, block_k: int,
                       num_splits: int, precision):
    seq, split = pl.program_id(0), pl.program_id(2)
    layer = layer_ref[0]
    kv_len = kv_lens_ref[seq]
    num_blocks = pl.cdiv(kv_len, block_k)
    per_split = pl.cdiv(num_blocks, num_splits)
    first = split * per_split
    last = jnp.minimum(first + per_split, num_blocks)
    q_lat, q_pe = q_lat_ref[...], q_pe_ref[...]

    def body(j, state):
        pos = j * block_k + jnp.arange(block_k, dtype=jnp.int32)
        column = jnp.minimum(lax.div(pos, page_size), page_table_ref.shape[1] - 1)
        page, offset = page_table_ref[seq, column], lax.rem(pos, page_size)
        visible = pos < kv_len
        # Positions past kv_len read a clamped slot; their latents are zeroed so nothing stale reaches p @ c.
        c = jnp.where(visible[:, None], latent_pages_ref[layer, page, offset, 0, :].astype(q_lat.dtype), 0)
        k_pe = rope_pages_ref[layer, page, offset, 0, :].astype(q_pe.dtype)
        dims = (((1,), (1,)), ((), ()))
        logits = (lax.dot_general(q_lat, c, dims, precision=precision, preferred_element_type=jnp.float32)
                  + lax.dot_general(q_pe, k_pe, dims, precision=precision, preferred_element_type=jnp.float32))
        logits = jnp.where(visible[None, :], logits * scale, MASK_VALUE)
        row_max = jnp.maximum(state.row_max, jnp.max(logits, axis=1))
        rescale = jnp.exp(state.row_max - row_max)
        p = jnp.exp(logits - row_max[:, None])
        pv = lax.dot_general(p.astype(c.dtype), c, (((1,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)
        return state._replace(acc=state.acc * rescale[:, None] + pv, row_max=row_max,
                              total=state.total * rescale + jnp.sum(p, axis=1))

    state = lax.fori_loop(first, last, body, initial_state(q_lat.shape[0], q_lat.shape[1]))
    acc_ref[...] = state.acc
    max_ref[...] = state.row_max
    total_ref[...] = state.total


@lowered_once("scale", "block_k", "num_splits", "interpret")
def mla_decode_attention(
    q_lat: Float[Array, "T H R"],
    q_pe: Float[Array, "T H Dr"],
    latent_pages: Float[Array, "L N ps 1 R"],
    rope_pages: Float[Array, "L N ps 1 Dr"],
    layer: Int[Array, ""],
    meta: AttentionMetadata,
    *,
    scale: float,
    block_k: int = BLOCK_K,
    num_splits: int | None = None,
    interpret: bool = False,
    kv_scale: Float[Array, "2 1"] | None = None,
) -> tuple[Float[Array, "T H R"], Bool[Array, "T"]]:
    """Attention-weighted latents of every single-token row's token over its pages (written already);
    `kv_scale` ([latent scale, rotary key scale]) for an fp8 pool.

    Returns the outputs and which tokens they cover; other tokens' outputs are 0.
    """
    require_global(meta, "the MLA decode kernel")
    out_dtype = q_lat.dtype
    if kv_scale is not None:
        q_lat, q_pe = q_lat.astype(jnp.float32) * kv_scale[0, 0], q_pe.astype(jnp.float32) * kv_scale[1, 0]
    dtype = compute_dtype(latent_pages.dtype, out_dtype)
    t, h, r = q_lat.shape
    dr = q_pe.shape[-1]
    page_size = latent_pages.shape[2]
    s, width = meta.page_table.shape
    hp = max(BLOCK_H, next_power_of_2(h))
    num_head_blocks = hp // BLOCK_H
    if num_splits is None:
        num_splits = choose_num_splits(s, num_head_blocks, -(-width * page_size // block_k))

    is_decode = decode_rows(meta)
    kv_lens = jnp.where(is_decode, meta.kv_lens, 0).astype(jnp.int32)
    first_token = jnp.clip(meta.cu_q_lens[:-1], 0, t - 1)

    def rows(x):  # [T, H, D] -> each row's token, heads padded to hp, in the dtype the kernel multiplies in
        return jnp.pad(x[first_token].astype(dtype), ((0, 0), (0, hp - h), (0, 0)))

    whole = pl.BlockSpec()
    partial_spec = pl.BlockSpec((None, None, BLOCK_H), lambda i, b, k: (k, i, b))
    acc, row_max, total = pl.pallas_call(
        functools.partial(_mla_decode_kernel, scale=scale, page_size=page_size, block_k=block_k,
                          num_splits=num_splits, precision=dot_precision(dtype)),
        grid=(s, num_head_blocks, num_splits),
        in_specs=[whole, whole, whole, pl.BlockSpec((None, BLOCK_H, r), lambda i, b, k: (i, b, 0)),
                  pl.BlockSpec((None, BLOCK_H, dr), lambda i, b, k: (i, b, 0)), whole, whole],
        out_specs=[pl.BlockSpec((None, None, BLOCK_H, r), lambda i, b, k: (k, i, b, 0)), partial_spec, partial_spec],
        out_shape=[jax.ShapeDtypeStruct((num_splits, s, hp, r), jnp.float32),
                   jax.ShapeDtypeStruct((num_splits, s, hp), jnp.float32),
                   jax.ShapeDtypeStruct((num_splits, s, hp), jnp.float32)],
        compiler_params=compiler_params(num_warps=4, num_stages=pipeline_stages(dtype)),
        interpret=interpret,
        name="paged_mla_decode",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), kv_lens, meta.page_table.astype(jnp.int32), rows(q_lat),
      rows(q_pe), latent_pages, rope_pages)

    # combine_splits takes [K, S, Hkv, G, ...]: here one group of hp heads.
    rows_out = combine_splits(acc[:, :, None], row_max[:, :, None], total[:, :, None])[:, 0, :h]
    if kv_scale is not None:
        rows_out = rows_out * kv_scale[0, 0]
    valid = jnp.arange(t) < meta.cu_q_lens[meta.num_seqs]
    seq = jnp.clip(meta.seq_ids, 0, s - 1)
    covered = valid & is_decode[seq]
    return jnp.where(covered[:, None, None], rows_out[seq], 0).astype(out_dtype), covered
