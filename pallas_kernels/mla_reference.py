"""Pure-`jnp` Multi-head Latent Attention over latent pages, in the absorbed form.

The pool holds, per token and layer, the compressed latent c [R] (`latent_pages`) and the rotary
key k_pe [Dr] (`rope_pages`), shared by every head. With W_uk folded into the query
(q_lat = q_nope W_uk^T, [H, R]) a head's score is q_lat . c + q_pe . k_pe, and its output is the
softmax-weighted sum of the latents, [H, R]; the caller applies W_uv afterwards. So this is
multi-query attention with one shared "head" whose key is (c, k_pe) and whose value is c, and
it runs as `reference.ragged_paged_attention` does: part B attends the step's own tokens
densely, part A reads the cached positions block by block (the loop runs to the longest cached
prefix), and the two merge through an online softmax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels.metadata import AttentionMetadata
from pallas_kernels.reference import _dot_precision, _pages_per_block, query_block_size, query_blocks, write_kv


def mla_paged_attention(
    q_lat: Float[Array, "T H R"],
    q_pe: Float[Array, "T H Dr"],
    latent: Float[Array, "T R"],
    k_pe: Float[Array, "T Dr"],
    latent_pages: Float[Array, "L N ps 1 R"],
    rope_pages: Float[Array, "L N ps 1 Dr"],
    layer: Int[Array, ""],
    meta: AttentionMetadata,
    *,
    scale: float,
) -> tuple[Float[Array, "T H R"], Array, Array]:
    """Writes the step's latents and rotary keys into the pages; returns each head's attention-weighted
    latent (before W_uv) and the updated pages."""
    t, h, r = q_lat.shape
    ps = latent_pages.shape[2]
    precision = _dot_precision(q_lat, latent, latent_pages)
    latent_pages, rope_pages = write_kv(latent_pages, rope_pages, layer, latent[:, None], k_pe[:, None],
                                        meta.slot_mapping)

    valid = jnp.arange(t) < meta.cu_q_lens[meta.num_seqs]
    sid = jnp.clip(meta.seq_ids, 0, meta.kv_lens.shape[0] - 1)
    pos = meta.positions
    ql = q_lat.astype(jnp.float32) * scale
    qr = q_pe.astype(jnp.float32) * scale
    c = latent.astype(jnp.float32)

    # Part B: this step's tokens. A padding row sees only itself, so no row is empty.
    same = (sid[:, None] == sid[None, :]) & (pos[None, :] <= pos[:, None]) & valid[None, :]
    mask_b = jnp.where(valid[:, None], same, jnp.eye(t, dtype=bool))
    s_b = (jnp.einsum("thr,ur->thu", ql, c, precision=precision)
           + jnp.einsum("thd,ud->thu", qr, k_pe.astype(jnp.float32), precision=precision))
    s_b = jnp.where(mask_b[:, None, :], s_b, -jnp.inf)
    m = jnp.max(s_b, axis=-1)
    p = jnp.exp(s_b - m[..., None])
    l_sum = jnp.sum(p, axis=-1)
    acc = jnp.einsum("thu,ur->thr", p, c, precision=precision)

    # Part A: cached positions [0, ctx), one block of pages per iteration, gathered once per query block.
    qb = query_blocks(meta, t, query_block_size(t, meta.kv_lens.shape[0]))
    w, cq = qb.token.shape

    def to_items(x):  # [T, H, ...] -> [W, C * H, ...]
        if cq == 1:  # decode steps: W = T and item i is token i, so no gather
            return x
        return x[qb.token].reshape(w, cq * h, *x.shape[2:])

    ql_i, qr_i = to_items(ql), to_items(qr)
    num_pages = meta.page_table.shape[1]
    dr = rope_pages.shape[-1]
    ppb = _pages_per_block(num_pages, ps, w * (r + dr) * 4)
    block = ppb * ps
    item_pages = meta.page_table[qb.row]
    n_blocks = (jnp.max(qb.ctx) + block - 1) // block

    def body(j, carry):
        m, l_sum, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(item_pages, j * ppb, ppb, axis=1)
        cb = latent_pages[layer, pages].reshape(w, block, r).astype(jnp.float32)
        kb = rope_pages[layer, pages].reshape(w, block, dr).astype(jnp.float32)
        s = (jnp.einsum("wmr,wbr->wmb", ql_i, cb, precision=precision)
             + jnp.einsum("wmd,wbd->wmb", qr_i, kb, precision=precision))
        in_ctx = (j * block + jnp.arange(block))[None, :] < qb.ctx[:, None]
        s = jnp.where(in_ctx[:, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[..., None])
        l_sum = l_sum * alpha + jnp.sum(p, axis=-1)
        acc = acc * alpha[..., None] + jnp.einsum("wmb,wbr->wmr", p, cb, precision=precision)
        return m_new, l_sum, acc

    _, l_items, acc_items = jax.lax.fori_loop(0, n_blocks, body, (to_items(m), to_items(l_sum), to_items(acc)))
    out = acc_items / l_items[..., None]
    if cq > 1:  # padding tokens keep their part-B output: finite, as the null page they write must stay
        out = out.reshape(w, cq, h, r)[qb.token_item, qb.token_slot]
        out = jnp.where(valid[:, None, None], out, acc / l_sum[..., None])
    return out.astype(q_lat.dtype), latent_pages, rope_pages
