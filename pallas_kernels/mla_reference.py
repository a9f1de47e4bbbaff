"""Pure-`jnp` Multi-head Latent Attention over latent pages, in the absorbed form.

The pool holds, per token and layer, the compressed latent c [R] (`latent_pages`) and the rotary
key k_pe [Dr] (`rope_pages`), shared by every head. With W_uk folded into the query
(q_lat = q_nope W_uk^T, [H, R]) a head's score is q_lat . c + q_pe . k_pe, and its output is the
softmax-weighted sum of the latents, [H, R]; the caller applies W_uv afterwards. So this is
multi-query attention with one shared "head" whose key is (c, k_pe) and whose value is c, and
it runs as `reference.ragged_paged_attention` does: part B attends the step's own tokens
densely, part A reads the cached positions in ragged blocks (`reference.fold_cached_blocks`),
and the two merge through an online softmax.

An fp8 pool (`kv_scale` [2, 1]: the latent's scale and the rotary key's, pallas_kernels/kv_quant.py)
holds `c / c_scale` and `k_pe / rope_scale`: c_scale folds into q_lat and the output (the value is
c), rope_scale into q_pe, so the dots read the codes. The step's own latents are quantized first,
so a token reads the same latent fresh or cached.

`mla_paged_attention_expanded` attends the step's own tokens in the expanded form instead: per
token pair it costs H (Dn + Dr + Dv) multiply-adds against H (2R + Dr) absorbed (320 against 1088
for DeepSeek-V3), for an expansion of R H (Dn + Dv) per new token, so it pays off for long prompt
chunks (pallas_kernels/mla.py chooses by the step's token count).
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels.metadata import AttentionMetadata, require_global
from pallas_kernels.reference import (_dot_precision, _pages_per_block, fold_cached_blocks, from_storage,
                                      query_block_size, query_blocks, quantize_step, write_kv)


def _write_step(latent: Float[Array, "T R"], k_pe: Float[Array, "T Dr"], latent_pages: Array, rope_pages: Array,
                layer: Int[Array, ""], meta: AttentionMetadata, kv_scale: Float[Array, "2 1"] | None
                ) -> tuple[Array, Array, Float[Array, "T R"], Float[Array, "T Dr"], Array, Array]:
    """Writes the step's latents and rotary keys (quantized for an fp8 pool); returns the pages, the
    step's values as the pool holds them (codes, in float32), and (c_scale, rope_scale): 1 without
    scales."""
    latent_q, k_pe_q = quantize_step(latent[:, None], k_pe[:, None], kv_scale)
    latent_pages, rope_pages = write_kv(latent_pages, rope_pages, layer, latent_q, k_pe_q, meta.slot_mapping)
    one = jnp.ones((), jnp.float32)
    c_scale, rope_scale = (one, one) if kv_scale is None else (kv_scale[0, 0], kv_scale[1, 0])
    return (latent_pages, rope_pages, latent_q[:, 0].astype(jnp.float32), k_pe_q[:, 0].astype(jnp.float32),
            c_scale, rope_scale)


def _part_b_mask(meta: AttentionMetadata, t: int) -> tuple[Array, Array]:
    """(valid tokens [T], the step's causal same-sequence mask [T, T]); a padding row sees only itself."""
    valid = jnp.arange(t) < meta.cu_q_lens[meta.num_seqs]
    sid = jnp.clip(meta.seq_ids, 0, meta.kv_lens.shape[0] - 1)
    pos = meta.positions
    same = (sid[:, None] == sid[None, :]) & (pos[None, :] <= pos[:, None]) & valid[None, :]
    return valid, jnp.where(valid[:, None], same, jnp.eye(t, dtype=bool))


def _softmax_part(s: Float[Array, "T H U"], mask: Array) -> tuple[Array, Array, Array]:
    s = jnp.where(mask[:, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    p = jnp.exp(s - m[..., None])
    return m, jnp.sum(p, axis=-1), p


def _attend_cached(ql: Float[Array, "T H R"], qr: Float[Array, "T H Dr"], state: tuple[Array, Array, Array],
                   latent_pages: Array, rope_pages: Array, layer: Int[Array, ""], meta: AttentionMetadata,
                   valid: Array, precision) -> tuple[Array, Array, Array]:
    """Part A: folds the cached positions [0, ctx) into the running (max, sum, latent acc) of every
    token, in ragged blocks of pages gathered once per query block. Padding tokens keep the state
    they came in with."""
    t, h, r = ql.shape
    ps, dr = latent_pages.shape[2], rope_pages.shape[-1]
    qb = query_blocks(meta, t, query_block_size(t, meta.kv_lens.shape[0]))
    w, cq = qb.token.shape

    def to_items(x):  # [T, H, ...] -> [W, C * H, ...]
        if cq == 1:  # decode steps: W = T and item i is token i, so no gather
            return x
        return x[qb.token].reshape(w, cq * h, *x.shape[2:])

    ql_i, qr_i = to_items(ql), to_items(qr)
    ppb = _pages_per_block(meta.page_table.shape[1], ps, w * (r + dr) * 4)
    block = ppb * ps

    def score(item, pages):
        cb = from_storage(latent_pages[layer, pages]).reshape(w, block, r).astype(jnp.float32)
        kb = from_storage(rope_pages[layer, pages]).reshape(w, block, dr).astype(jnp.float32)
        return (jnp.einsum("wmr,wbr->wmb", ql_i[item], cb, precision=precision)
                + jnp.einsum("wmd,wbd->wmb", qr_i[item], kb, precision=precision)), cb

    def weigh(p, cb):
        return jnp.einsum("wmb,wbr->wmr", p, cb, precision=precision)

    out = fold_cached_blocks(qb, meta.page_table, ps, ppb, tuple(to_items(x) for x in state), score, weigh)
    if cq == 1:
        return out

    def to_tokens(x, before):  # padding tokens keep their part-B state: finite, as the null page must stay
        x = x.reshape(w, cq, h, *x.shape[2:])[qb.token_item, qb.token_slot]
        return jnp.where(valid.reshape(t, *[1] * (x.ndim - 1)), x, before)

    return tuple(to_tokens(x, before) for x, before in zip(out, state))


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
    kv_scale: Float[Array, "2 1"] | None = None,
) -> tuple[Float[Array, "T H R"], Array, Array]:
    """Absorbed form: writes the step's latents and rotary keys into the pages; returns each head's
    attention-weighted latent (before W_uv) and the updated pages."""
    require_global(meta, "MLA attention")
    precision = _dot_precision(q_lat, latent, latent_pages)
    latent_pages, rope_pages, c, kp, c_scale, rope_scale = _write_step(latent, k_pe, latent_pages, rope_pages,
                                                                      layer, meta, kv_scale)
    valid, mask = _part_b_mask(meta, q_lat.shape[0])
    ql = q_lat.astype(jnp.float32) * (scale * c_scale)
    qr = q_pe.astype(jnp.float32) * (scale * rope_scale)
    s_b = (jnp.einsum("thr,ur->thu", ql, c, precision=precision)
           + jnp.einsum("thd,ud->thu", qr, kp, precision=precision))
    m, l_sum, p = _softmax_part(s_b, mask)
    state = (m, l_sum, jnp.einsum("thu,ur->thr", p, c, precision=precision))
    m, l_sum, acc = _attend_cached(ql, qr, state, latent_pages, rope_pages, layer, meta, valid, precision)
    return (acc / l_sum[..., None] * c_scale).astype(q_lat.dtype), latent_pages, rope_pages


def mla_paged_attention_expanded(
    q_nope: Float[Array, "T H Dn"],
    q_pe: Float[Array, "T H Dr"],
    latent: Float[Array, "T R"],
    k_pe: Float[Array, "T Dr"],
    w_uk: Float[Array, "H Dn R"],
    w_uv: Float[Array, "H R Dv"],
    latent_pages: Float[Array, "L N ps 1 R"],
    rope_pages: Float[Array, "L N ps 1 Dr"],
    layer: Int[Array, ""],
    meta: AttentionMetadata,
    *,
    scale: float,
    kv_scale: Float[Array, "2 1"] | None = None,
) -> tuple[Float[Array, "T H Dv"], Array, Array]:
    """The step's own tokens in the expanded form (per-head keys c W_uk and values c W_uv, built once
    for the T new tokens), the cached positions in the absorbed form; returns [T, H, Dv].

    Both parts score q . k the same way, so their softmax statistics merge as usual: part A's
    latent accumulator starts at zero under part B's (max, sum), and W_uv, being linear, maps it
    to the value space after the loop. With fp8 scales the step's own part reads its dequantized
    latents and the cached part the codes, scales folded."""
    require_global(meta, "MLA attention")
    precision = _dot_precision(q_nope, latent, latent_pages)
    latent_pages, rope_pages, c, kp, c_scale, rope_scale = _write_step(latent, k_pe, latent_pages, rope_pages,
                                                                      layer, meta, kv_scale)
    valid, mask = _part_b_mask(meta, q_nope.shape[0])
    qn = q_nope.astype(jnp.float32) * scale
    qr = q_pe.astype(jnp.float32) * scale
    c = c * c_scale
    w_uk, w_uv = w_uk.astype(jnp.float32), w_uv.astype(jnp.float32)
    k_nope = jnp.einsum("ur,hdr->uhd", c, w_uk, precision=precision)
    s_b = (jnp.einsum("thd,uhd->thu", qn, k_nope, precision=precision)
           + jnp.einsum("thd,ud->thu", qr, kp * rope_scale, precision=precision))
    m_b, l_b, p = _softmax_part(s_b, mask)
    acc_b = jnp.einsum("thu,uhv->thv", p, jnp.einsum("ur,hrv->uhv", c, w_uv, precision=precision),
                       precision=precision)
    ql = jnp.einsum("thd,hdr->thr", qn, w_uk, precision=precision) * c_scale
    m, l_sum, acc_lat = _attend_cached(ql, qr * rope_scale, (m_b, l_b, jnp.zeros(ql.shape, jnp.float32)),
                                       latent_pages, rope_pages, layer, meta, valid, precision)
    acc = acc_b * jnp.exp(m_b - m)[..., None] + jnp.einsum("thr,hrv->thv", acc_lat * c_scale, w_uv,
                                                           precision=precision)
    return (acc / l_sum[..., None]).astype(q_nope.dtype), latent_pages, rope_pages
