"""Pure-`jnp` paged attention: the CPU path and the semantics every kernel must match.

Attention of a token is split in two parts that are merged with an online softmax:
  * part B, the tokens of this step (dense T x T with a same-sequence causal mask), read from the
    freshly projected k/v, and
  * part A, the positions cached before this step, read from the pages block by block. The loop
    runs ceil(longest cached prefix / block) times, so a step costs what its contexts need, not
    what `max_model_len` would.

Scores and weighted sums are float32 dots. When any input is float32, they run at
`Precision.HIGHEST`: XLA's default float32 dot on a GPU is TF32 (10-bit mantissa), which left this
reference 3-6e-4 (relative) off an exact float64 oracle on an H100, where the float32 kernels are
within 2e-5. On CPU the flag changes nothing. 16-bit inputs keep the default precision, as the
kernels' `dot_precision` does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels.metadata import AttentionMetadata

# Tokens per part-A block: large enough that the loop overhead is small on CPU...
_BLOCK_TOKENS = 128
# ...but part A gathers each token's own copy of the block, so with many tokens (a prompt chunk)
# the block shrinks until that copy stays about cache-sized: 128 -> 16 tokens took a 2048-token
# prefill on one CPU core from 26.7 s to 19.5 s. Decode steps (few tokens) keep 128.
_BLOCK_GATHER_BYTES = 4 << 20


def _dot_precision(*arrays) -> jax.lax.Precision | None:
    """HIGHEST when any input is float32 or wider, so no backend multiplies it in TF32; else the default."""
    wide = any(jnp.dtype(a.dtype).itemsize >= 4 for a in arrays)
    return jax.lax.Precision.HIGHEST if wide else None


def write_kv(
    k_pages: Float[Array, "L N ps Hkv D"],
    v_pages: Float[Array, "L N ps Hkv D"],
    layer: Int[Array, ""],
    k: Float[Array, "T Hkv D"],
    v: Float[Array, "T Hkv D"],
    slot_mapping: Int[Array, "T"],
) -> tuple[Array, Array]:
    """Scatters this step's keys and values into their slots (in place when the pool is donated)."""
    ps = k_pages.shape[2]
    page, off = slot_mapping // ps, slot_mapping % ps
    k_pages = k_pages.at[layer, page, off].set(k.astype(k_pages.dtype))
    v_pages = v_pages.at[layer, page, off].set(v.astype(v_pages.dtype))
    return k_pages, v_pages


def _pages_per_block(num_pages_per_seq: int, page_size: int, gather_bytes_per_position: int) -> int:
    """Largest divisor of the page-table width whose tokens fit in one block (at least 1 page)."""
    limit = min(_BLOCK_TOKENS, _BLOCK_GATHER_BYTES // gather_bytes_per_position)
    best = 1
    for d in range(1, num_pages_per_seq + 1):
        if num_pages_per_seq % d == 0 and d * page_size <= limit:
            best = d
    return best


def token_context(meta: AttentionMetadata, num_tokens: int) -> tuple[Array, Array, Array]:
    """Per token: is it a real token, its clipped sequence row, and how many positions precede this step."""
    num_rows = meta.kv_lens.shape[0]
    valid = jnp.arange(num_tokens) < meta.cu_q_lens[meta.num_seqs]
    sid = jnp.clip(meta.seq_ids, 0, num_rows - 1)
    q_lens = meta.cu_q_lens[1:] - meta.cu_q_lens[:-1]
    ctx = jnp.where(valid, (meta.kv_lens - q_lens)[sid], 0)
    return valid, sid, ctx


def ragged_paged_attention(
    q: Float[Array, "T Hq D"],
    k: Float[Array, "T Hkv D"],
    v: Float[Array, "T Hkv D"],
    k_pages: Float[Array, "L N ps Hkv D"],
    v_pages: Float[Array, "L N ps Hkv D"],
    layer: Int[Array, ""],
    meta: AttentionMetadata,
    *,
    scale: float,
) -> tuple[Float[Array, "T Hq D"], Array, Array]:
    """Writes k/v into the pages, then attends each token to its sequence's positions <= its own."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    ps = k_pages.shape[2]
    precision = _dot_precision(q, k, v, k_pages, v_pages)
    k_pages, v_pages = write_kv(k_pages, v_pages, layer, k, v, meta.slot_mapping)

    valid, sid, ctx = token_context(meta, t)
    pos = meta.positions
    qg = q.astype(jnp.float32).reshape(t, hkv, g, d) * scale

    # Part B: this step's tokens. A padding row sees only itself, so no row is empty.
    same = (sid[:, None] == sid[None, :]) & (pos[None, :] <= pos[:, None]) & valid[None, :]
    mask_b = jnp.where(valid[:, None], same, jnp.eye(t, dtype=bool))
    s_b = jnp.einsum("tkgd,ukd->tkgu", qg, k.astype(jnp.float32), precision=precision)
    s_b = jnp.where(mask_b[:, None, None, :], s_b, -jnp.inf)
    m = jnp.max(s_b, axis=-1)
    p = jnp.exp(s_b - m[..., None])
    l_sum = jnp.sum(p, axis=-1)
    acc = jnp.einsum("tkgu,ukd->tkgd", p, v.astype(jnp.float32), precision=precision)

    # Part A: cached positions [0, ctx), one block of pages per iteration.
    num_pages = meta.page_table.shape[1]
    ppb = _pages_per_block(num_pages, ps, t * hkv * d * 4)
    block = ppb * ps
    token_pages = meta.page_table[sid]
    n_blocks = (jnp.max(ctx) + block - 1) // block

    def body(j, carry):
        m, l_sum, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(token_pages, j * ppb, ppb, axis=1)
        kb = k_pages[layer, pages].reshape(t, block, hkv, d).astype(jnp.float32)
        vb = v_pages[layer, pages].reshape(t, block, hkv, d).astype(jnp.float32)
        s = jnp.einsum("tkgd,tbkd->tkgb", qg, kb, precision=precision)
        in_ctx = (j * block + jnp.arange(block))[None, :] < ctx[:, None]
        s = jnp.where(in_ctx[:, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[..., None])
        l_sum = l_sum * alpha + jnp.sum(p, axis=-1)
        acc = acc * alpha[..., None] + jnp.einsum("tkgb,tbkd->tkgd", p, vb, precision=precision)
        return m_new, l_sum, acc

    m, l_sum, acc = jax.lax.fori_loop(0, n_blocks, body, (m, l_sum, acc))
    out = (acc / l_sum[..., None]).reshape(t, hq, d).astype(q.dtype)
    return out, k_pages, v_pages
