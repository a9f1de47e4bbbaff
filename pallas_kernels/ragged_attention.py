"""The Pallas path of `paged_attention`: write the step's k/v, then decode and prefill kernels.

A step mixes single-token rows and prefill chunks. Three launches serve it: the in-place KV write,
then decode attention (split-K, GQA group as the tile rows) for single-token rows and ragged
prefill attention for multi-token rows, both reading every key, this step's included, from the
pages. Each launch skips the rows that are not its own, so the step's cost follows its mix and no
shape depends on it. Padding tokens get a zero output. A step known to hold single-token rows
alone (`decode_only`, static) launches the KV write and the decode kernel only.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels import kv_quant, reference
from pallas_kernels.decode_attention import decode_attention
from pallas_kernels.kv_write import write_kv_pages
from pallas_kernels.metadata import AttentionMetadata
from pallas_kernels.prefill_attention import prefill_attention
from pallas_kernels.triton_backend import check_supported


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
    interpret: bool = False,
    decode_only: bool = False,
) -> tuple[Float[Array, "T Hq D"], Array, Array]:
    """Same contract as `reference.ragged_paged_attention`, on Pallas kernels. With `decode_only`
    every row must be one token: the decode kernel's output is then the step's (0 for padding). An
    fp8 pool's scales fold into q (rounded to q's dtype) and the output; the kernels read fp8 pages
    as they are. `sinks` (gpt-oss's per-head logits) go to both kernels; the scores they join are
    the true q.k * scale (k_scale folds into q), so they need no scaling of their own."""
    check_supported(q.shape[2], q.shape[1], k.shape[1], k_pages.dtype)
    k, v = reference.quantize_step(k, v, kv_scale)
    if kv_scale is not None:
        q = kv_quant.fold_query(q, kv_scale[0]).astype(q.dtype)
    k_pages, v_pages = write_kv_pages(k_pages, v_pages, layer, k, v, meta.slot_mapping, interpret=interpret)
    decoded, is_decode = decode_attention(q, k_pages, v_pages, layer, meta, scale=scale, sinks=sinks,
                                          interpret=interpret)
    if decode_only:
        out = decoded
    else:
        prefilled, _ = prefill_attention(q, k_pages, v_pages, layer, meta, scale=scale, sinks=sinks,
                                         interpret=interpret)
        out = jnp.where(is_decode[:, None, None], decoded, prefilled)
    if kv_scale is not None:
        out = kv_quant.unfold_output(out.astype(jnp.float32), kv_scale[1]).astype(q.dtype)
    return out, k_pages, v_pages
