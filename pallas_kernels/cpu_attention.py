"""Paged attention on CPU: a C++ XLA FFI call that reads the KV pool in place, for every step.

The reference attention (`reference.py`) gathers each row's pages into fresh arrays every layer
and runs as a string of small XLA ops, mostly one after another on one thread; its part B is a
dense T x T over the whole step, whatever its rows. `csrc/paged_attention.cc` attends runs of a
row's tokens to the row's positions straight from the pool, on XLA's thread pool, each block of
keys read once for the run (docs/PERFORMANCE.md has both measured). This step's keys and values
are first written by the reference's scatter, so the call's semantics are the reference's: every
token sees its sequence's positions up to its own (from its first visible one on for a local layer,
`meta.local`: another target, which takes the layer's chunk and window as buffers since they are
traced). bfloat16 queries over a bfloat16 pool multiply in bfloat16 where the CPU has AVX512-BF16
(`bf16_products`); other pairings widen to float32. An fp8 pool (uint8 bits) is read the same way,
its codes widened in registers; the scales fold into q and the output (kv_quant.py). Attention sinks
(gpt-oss's logit per query head) take a third target, with the local one's buffers (chunk = window =
0 for a global layer) and the sinks. The scores' scale is an attribute of the call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from pallas_kernels import cpu_kernels, kv_quant, reference
from pallas_kernels.metadata import AttentionMetadata

TARGET = "infire_paged_attention"
TARGET_LOCAL = "infire_paged_attention_local"
TARGET_SINKS = "infire_paged_attention_sinks"


def applies(q: Array, k_pages: Array) -> bool:
    """Whether a step takes the FFI call (decided at trace time): on CPU, float32, uint16 (bfloat16
    bits) or uint8 (fp8 bits) pools, head_dim a multiple of 16 up to 256, at most 16 query heads per
    kv head."""
    hq, d = q.shape[1:]
    hkv = k_pages.shape[3]
    return (k_pages.dtype in (jnp.float32, jnp.uint16, jnp.uint8) and d % 16 == 0 and d <= 256 and hq % hkv == 0
            and hq // hkv <= 16 and cpu_kernels.on_cpu())


def bf16_products(q: Array, k_pages: Array) -> bool:
    """Whether the call multiplies in bfloat16 (`vdpbf16ps`, float32 sums): bfloat16 queries over a
    bfloat16 pool, on a library built for AVX512-BF16. The scores are scaled after the products and the
    softmax weights rounded to bfloat16 for the value sums, as the Pallas kernels do on the GPU; every
    other pairing widens to float32 products."""
    return q.dtype == jnp.bfloat16 and k_pages.dtype == jnp.uint16 and cpu_kernels.bf16_dot()


def paged_attention(
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
    """Writes k/v into the pages (in place), then attends each token to its sequence's positions
    <= its own (from `first_visible` on with `meta.local`; no earlier page is read), reading them
    from the pool; padding tokens get zeros. With `kv_scale` the pool holds fp8 bits (see
    `reference.ragged_paged_attention`). `sinks`: a logit per query head (scaled like the scores)
    that joins each token's softmax and is dropped."""
    cpu_kernels.require()
    k, v = reference.quantize_step(k, v, kv_scale)
    k_pages, v_pages = reference.write_kv(k_pages, v_pages, layer, k, v, meta.slot_mapping)
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    ints = [jnp.asarray(x).astype(jnp.int32) for x in (layer, meta.positions, meta.seq_ids, meta.page_table,
                                                         meta.num_seqs)]
    if bf16_products(q, k_pages):
        qf = q
    else:
        qf = q.astype(jnp.float32) if kv_scale is None else kv_quant.fold_query(q, kv_scale[0])
    target = TARGET if meta.local is None else TARGET_LOCAL
    if meta.local is not None or sinks is not None:
        ints += [jnp.asarray(x).astype(jnp.int32) for x in (meta.local or (0, 0))]
    if sinks is not None:
        target, ints = TARGET_SINKS, [*ints, sinks.astype(jnp.float32)]
    o = jax.ffi.ffi_call(target, out)(qf, k_pages, v_pages, *ints, scale=np.float32(scale))
    if kv_scale is not None:
        o = kv_quant.unfold_output(o, kv_scale[1])
    return o.astype(q.dtype), k_pages, v_pages
