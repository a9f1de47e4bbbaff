"""Pure-`jnp` paged attention: the CPU path and the semantics every kernel must match.

Attention of a token is split in two parts that are merged with an online softmax:
  * part B, the tokens of this step (dense T x T with a same-sequence causal mask), read from the
    freshly projected k/v, and
  * part A, the positions cached before this step, read from the pages block by block. The blocks
    are ragged: each iteration takes the next blocks of all rows together, so a step costs what its
    contexts add up to, not rows x the longest one (nor `max_model_len`). Each row's tokens are cut
    into query blocks that gather the row's pages once for all their tokens: gathered per token, a
    512-token prompt chunk copied the same pages 512 times.

Scores and weighted sums are float32 dots. When any input is float32, they run at
`Precision.HIGHEST`: XLA's default float32 dot on a GPU is TF32 (10-bit mantissa), which left this
reference 3-6e-4 (relative) off an exact float64 oracle on an H100, where the float32 kernels are
within 2e-5. On CPU the flag changes nothing. 16-bit inputs keep the default precision, as the
kernels' `dot_precision` does.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels import kv_quant, placement
from pallas_kernels.metadata import AttentionMetadata, first_visible

# Positions per part-A block: large enough that the loop overhead is small on CPU, but the
# block each query block gathers shrinks until all of them together stay about cache-sized.
_BLOCK_TOKENS = 128
_BLOCK_GATHER_BYTES = 4 << 20
# Most tokens per part-A query block. Padding items cost scores like real ones: one layer of a
# 512-token chunk after 1536 cached positions, S = 8, took 75 ms with blocks of 64, 69 with 16 or 32.
_MAX_QUERY_BLOCK = 32


def _dot_precision(*arrays) -> jax.lax.Precision | None:
    """HIGHEST when any input is float32 or wider, so no backend multiplies it in TF32; else the default."""
    wide = any(jnp.dtype(a.dtype).itemsize >= 4 for a in arrays)
    return jax.lax.Precision.HIGHEST if wide else None


def pool_storage_dtype(dtype, attn_impl: str):
    """The dtype a KV pool is stored in. XLA CPU computes bfloat16 by way of float32, so a scatter
    into a bfloat16 pool rewrites the whole pool every layer (3.6 s a step for a 377 MB pool of 30
    layers, against 0.1 ms for the same bits scattered as uint16; docs/PERFORMANCE.md). When this reference runs
    on CPU, a bfloat16 pool is held as its bit pattern, uint16, and read back with a bitcast; the
    Pallas kernels always get the pool in its own dtype. An fp8 pool has the same problem (0.2 s for
    one scatter into 1.4 GB, against 0.01 ms as uint8), so there it is held as uint8 bits."""
    on_cpu = attn_impl == "reference" and placement.platform() == "cpu"
    if on_cpu and jnp.dtype(dtype) == jnp.bfloat16:
        return jnp.uint16
    return jnp.uint8 if on_cpu and kv_quant.is_fp8(dtype) else dtype


_BITS = {jnp.dtype(jnp.uint16): jnp.bfloat16, jnp.dtype(jnp.uint8): kv_quant.FP8}  # bit storage -> value dtype


def to_storage(x: Array, pool_dtype) -> Array:
    """Values as the pool stores them (see `pool_storage_dtype`); fp8 values must come quantized."""
    value = _BITS.get(jnp.dtype(pool_dtype))
    if value is not None:
        return jax.lax.bitcast_convert_type(x.astype(value), pool_dtype)
    return x.astype(pool_dtype)


def from_storage(x: Array) -> Array:
    """Pool contents as values: a uint16 pool holds bfloat16 bits, a uint8 pool fp8 bits."""
    value = _BITS.get(jnp.dtype(x.dtype))
    return x if value is None else jax.lax.bitcast_convert_type(x, value)


def quantize_step(k: Array, v: Array, kv_scale: Float[Array, "2 Hkv"] | None) -> tuple[Array, Array]:
    """This step's keys and values as an fp8 pool stores them (kv_quant.py); unchanged without scales."""
    if kv_scale is None:
        return k, v
    return kv_quant.quantize(k, kv_scale[0]), kv_quant.quantize(v, kv_scale[1])


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
    k_pages = k_pages.at[layer, page, off].set(to_storage(k, k_pages.dtype))
    v_pages = v_pages.at[layer, page, off].set(to_storage(v, v_pages.dtype))
    return k_pages, v_pages


def _pages_per_block(num_pages_per_seq: int, page_size: int, gather_bytes_per_position: int) -> int:
    """Largest divisor of the page-table width whose positions fit in one block (at least 1 page)."""
    limit = min(_BLOCK_TOKENS, _BLOCK_GATHER_BYTES // gather_bytes_per_position)
    best = 1
    for d in range(1, num_pages_per_seq + 1):
        if num_pages_per_seq % d == 0 and d * page_size <= limit:
            best = d
    return best


def query_block_size(num_tokens: int, num_rows: int) -> int:
    """Tokens per part-A query block. Any split of the step into rows fits (T + S (C - 1)) // C items
    of C slots; C <= T // S keeps those slots, each scored against every cached position, under 2T,
    and gives decode steps (T = S) one slot per item: the per-token gather they always had."""
    return max(1, min(num_tokens // num_rows, _MAX_QUERY_BLOCK))


class QueryBlocks(NamedTuple):
    row: Int[Array, "W"]  # sequence row of each item (clipped)
    ctx: Int[Array, "W"]  # positions cached before this step in the item's row; 0 past the step's items
    token: Int[Array, "W C"]  # flat token of each slot (clipped: slots past their row's tokens repeat one)
    token_item: Int[Array, "T"]  # item of each token (meaningful for valid tokens)
    token_slot: Int[Array, "T"]  # slot of each token in its item
    # Local layers only (None for global ones): the first cached position any slot of the item sees
    # (at most ctx), and each slot's own first visible position.
    start: Int[Array, "W"] | None = None
    first_visible: Int[Array, "W C"] | None = None


def query_blocks(meta: AttentionMetadata, num_tokens: int, block: int) -> QueryBlocks:
    """Each row's tokens cut into blocks of `block` slots: W = (T + S * (block - 1)) // block items
    bound any step, as a row adds at most one partial block. With `meta.local`, also where each item's
    and slot's visible keys start (a row's first token sees from the earliest position)."""
    s = meta.kv_lens.shape[0]
    cu = meta.cu_q_lens.astype(jnp.int32)
    q_lens = cu[1:] - cu[:-1]
    blocks = jnp.where(jnp.arange(s) < meta.num_seqs, -(-q_lens // block), 0)
    ends = jnp.cumsum(blocks)
    starts = ends - blocks
    item = jnp.arange((num_tokens + s * (block - 1)) // block, dtype=jnp.int32)
    row = jnp.minimum(jnp.searchsorted(ends, item, side="right"), s - 1).astype(jnp.int32)
    first = cu[row] + (item - starts[row]) * block
    token = jnp.minimum(first[:, None] + jnp.arange(block), cu[row + 1][:, None] - 1)
    sid = jnp.clip(meta.seq_ids, 0, s - 1)
    in_row = jnp.arange(num_tokens, dtype=jnp.int32) - cu[sid]
    token_item = jnp.clip(starts[sid] + in_row // block, 0, item.shape[0] - 1)
    ctx = jnp.where(item < ends[-1], meta.kv_lens[row] - q_lens[row], 0)
    token = jnp.clip(token, 0, num_tokens - 1)
    if meta.local is None:
        return QueryBlocks(row, ctx, token, token_item, in_row % block)
    slot_first = first_visible(meta.local, meta.positions.astype(jnp.int32))[token]
    return QueryBlocks(row, ctx, token, token_item, in_row % block, jnp.minimum(slot_first[:, 0], ctx), slot_first)


def item_key_blocks(qb: QueryBlocks, block: int) -> tuple[Int[Array, "W"] | int, Int[Array, "W"]]:
    """Part A's bounds: each item's first key block and how many it folds in. A global layer's items
    take the ceil(ctx / block) blocks from 0; a local layer's the blocks from the one holding `start`
    up to ctx (none when they see no cached position)."""
    if qb.start is None:
        return 0, (qb.ctx + block - 1) // block
    first_block = qb.start // block
    return first_block, jnp.where(qb.ctx > qb.start, (qb.ctx + block - 1) // block - first_block, 0)


def fold_cached_blocks(qb: QueryBlocks, page_table: Int[Array, "S P"], page_size: int, pages_per_block: int,
                       state: tuple[Array, Array, Array], score: Callable, weigh: Callable) -> tuple[Array, Array, Array]:
    """Part A's loop: folds every query block's cached positions [0, ctx) into its running online
    softmax (max [W, ...], sum [W, ...], acc [W, ..., D]), one key block per item and iteration.

    The blocks are ragged: item i needs ceil(ctx_i / block) of them, and iteration j takes blocks
    jW .. jW + W - 1 of all items' blocks in order, so a step costs the sum of its contexts, not
    W x the longest (a decode row beside a 2k-token context used to pay for all 2k).
    `score(item [W], pages [W, pages_per_block]) -> (scores [W, ..., block], values)` scores each
    unit's block against its item's queries; `weigh(p, values) -> [W, ..., D]` sums the values.

    A local layer's items (`qb.start` set) start at the block holding `start`, so the loop costs
    what the items see, not their contexts; each slot sees only keys from its own first visible
    position on. The scores' second-to-last axis must then be the item's slots, each slot's heads
    together (C x heads), and `score` gets a third argument, the [W, block] keys in [start, ctx):
    it must zero the values of the others (those pages may be the null page, any bits).
    """
    w = qb.ctx.shape[0]
    block = pages_per_block * page_size
    item_pages = page_table[qb.row]
    local = qb.start is not None
    first_block, item_blocks = item_key_blocks(qb, block)
    ends = jnp.cumsum(item_blocks)

    def body(j, carry):
        m, l_sum, acc = carry
        unit = j * w + jnp.arange(w, dtype=jnp.int32)
        real = unit < ends[-1]
        item = jnp.minimum(jnp.searchsorted(ends, unit, side="right"), w - 1).astype(jnp.int32)
        first = (unit - (ends[item] - item_blocks[item])) * block  # the unit's first position
        if local:
            first = first + first_block[item] * block
        columns = first[:, None] // page_size + jnp.arange(pages_per_block)
        pages = jnp.take_along_axis(item_pages[item], columns, axis=1, mode="clip")
        if local:
            keys = first[:, None] + jnp.arange(block)
            in_range = real[:, None] & (keys < qb.ctx[item][:, None]) & (keys >= qb.start[item][:, None])
            s, values = score(item, pages, in_range)
            heads = (1,) * (s.ndim - 2)
            slots = qb.first_visible.shape[1]
            sees = in_range[:, None, :] & (keys[:, None, :] >= qb.first_visible[item][:, :, None])  # [W, C, block]
            sees = jnp.repeat(sees, s.shape[-2] // slots, axis=1)
            s = jnp.where(sees.reshape(w, *heads[1:], s.shape[-2], block), s, -jnp.inf)
        else:
            s, values = score(item, pages)
            heads = (1,) * (s.ndim - 2)
            in_ctx = real[:, None] & ((first[:, None] + jnp.arange(block)) < qb.ctx[item][:, None])
            s = jnp.where(in_ctx.reshape(w, *heads, block), s, -jnp.inf)
        # Each unit's own statistics, merged into its item's: one iteration can hold several blocks
        # of one item. A real unit has a position in context, so its max is finite (a local layer's
        # slot may see none of a unit's positions: its max is -inf, its weights 0).
        m_unit = jnp.max(s, axis=-1)
        real = real.reshape(w, *heads)
        seen = (real & (m_unit > -jnp.inf)) if local else real
        p = jnp.exp(s - jnp.where(seen, m_unit, 0.0)[..., None])
        m_new = jnp.maximum(m, jax.ops.segment_max(m_unit, item, w, indices_are_sorted=True))
        alpha = jnp.exp(m - m_new)
        beta = jnp.where(real, jnp.exp(m_unit - m_new[item]), 0.0)
        l_sum = l_sum * alpha + jax.ops.segment_sum(beta * jnp.sum(p, axis=-1), item, w, indices_are_sorted=True)
        acc = acc * alpha[..., None] + jax.ops.segment_sum(weigh(p, values) * beta[..., None], item, w,
                                                           indices_are_sorted=True)
        return m_new, l_sum, acc

    return jax.lax.fori_loop(0, (ends[-1] + w - 1) // w, body, state)


def join_sinks(sinks: Float[Array, "Hq"], m: Float[Array, "W Hkv CG"], l_sum: Float[Array, "W Hkv CG"],
               acc: Float[Array, "W Hkv CG D"], slots: int) -> tuple[Array, Array]:
    """Attention sinks (gpt-oss): each query head's logit joins the denominator of its softmax and is
    then dropped, so a row may give less than all of its weight to the keys. The online softmax's
    (max, sum, acc) of items whose heads run (kv head, slot, group) are rescaled to max(m, sink), so a
    sink far above the scores cannot overflow."""
    hkv = m.shape[1]
    s = jnp.tile(sinks.astype(jnp.float32).reshape(hkv, 1, -1), (1, slots, 1)).reshape(hkv, -1)
    m_all = jnp.maximum(m, s)
    alpha = jnp.exp(m - m_all)
    return l_sum * alpha + jnp.exp(s - m_all), acc * alpha[..., None]


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
    kv_scale: Float[Array, "2 Hkv"] | None = None,
    sinks: Float[Array, "Hq"] | None = None,
) -> tuple[Float[Array, "T Hq D"], Array, Array]:
    """Writes k/v into the pages, then attends each token to its sequence's positions <= its own
    (and, with `meta.local`, from its first visible one on). With `kv_scale` the pool is fp8: k/v are
    quantized first and the scales fold into q and the output (kv_quant.py), so every dot reads fp8
    codes. With `sinks` (gpt-oss), each query head's learned logit joins its softmax (`join_sinks`)."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    ps = k_pages.shape[2]
    precision = _dot_precision(q, k, v, k_pages, v_pages)
    k, v = quantize_step(k, v, kv_scale)
    k_pages, v_pages = write_kv(k_pages, v_pages, layer, k, v, meta.slot_mapping)

    valid = jnp.arange(t) < meta.cu_q_lens[meta.num_seqs]
    sid = jnp.clip(meta.seq_ids, 0, meta.kv_lens.shape[0] - 1)
    pos = meta.positions
    qf = q if kv_scale is None else kv_quant.fold_query(q, kv_scale[0])
    qg = qf.astype(jnp.float32).reshape(t, hkv, g, d) * scale

    # Part B: this step's tokens. A padding row sees only itself, so no row is empty (nor a real one
    # of a local layer: a token sees itself).
    same = (sid[:, None] == sid[None, :]) & (pos[None, :] <= pos[:, None]) & valid[None, :]
    if meta.local is not None:
        same = same & (pos[None, :] >= first_visible(meta.local, pos)[:, None])
    mask_b = jnp.where(valid[:, None], same, jnp.eye(t, dtype=bool))
    s_b = jnp.einsum("tkgd,ukd->tkgu", qg, k.astype(jnp.float32), precision=precision)
    s_b = jnp.where(mask_b[:, None, None, :], s_b, -jnp.inf)
    m = jnp.max(s_b, axis=-1)
    p = jnp.exp(s_b - m[..., None])
    l_sum = jnp.sum(p, axis=-1)
    acc = jnp.einsum("tkgu,ukd->tkgd", p, v.astype(jnp.float32), precision=precision)

    # Part A: cached positions [0, ctx) in ragged blocks of pages. A row's tokens share its context,
    # so each query block of one row gathers the row's pages once for all its tokens.
    qb = query_blocks(meta, t, query_block_size(t, meta.kv_lens.shape[0]))
    w, c = qb.token.shape

    def to_items(x):  # [T, Hkv, G, ...] -> [W, Hkv, C * G, ...]
        if c == 1:  # decode steps: W = T and item i is token i, so no gather
            return x
        x = jnp.moveaxis(x[qb.token], 1, 2)
        return x.reshape(w, hkv, c * g, *x.shape[4:])

    qi = to_items(qg)
    num_pages = meta.page_table.shape[1]
    ppb = _pages_per_block(num_pages, ps, w * hkv * d * 4)
    block = ppb * ps

    def score(item, pages, in_range=None):
        kb = from_storage(k_pages[layer, pages]).reshape(w, block, hkv, d).astype(jnp.float32)
        vb = from_storage(v_pages[layer, pages]).reshape(w, block, hkv, d).astype(jnp.float32)
        if in_range is not None:  # a local layer: keys before `start` may be the null page's
            vb = jnp.where(in_range[:, :, None, None], vb, 0.0)
        return jnp.einsum("wkmd,wbkd->wkmb", qi[item], kb, precision=precision), vb

    def weigh(p, vb):
        return jnp.einsum("wkmb,wbkd->wkmd", p, vb, precision=precision)

    m_items, l_items, acc_items = fold_cached_blocks(qb, meta.page_table, ps, ppb,
                                                     (to_items(m), to_items(l_sum), to_items(acc)), score, weigh)
    if sinks is not None:
        l_items, acc_items = join_sinks(sinks, m_items, l_items, acc_items, c)
    out = acc_items / l_items[..., None]
    if c > 1:  # padding tokens keep their part-B output: finite, as the null page they write must stay
        out = out.reshape(w, hkv, c, g, d)[qb.token_item, :, qb.token_slot]
        out = jnp.where(valid[:, None, None, None], out, acc / l_sum[..., None])
    if kv_scale is not None:
        out = out * kv_scale[1][:, None, None]
    return out.reshape(t, hq, d).astype(q.dtype), k_pages, v_pages
