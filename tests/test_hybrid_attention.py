"""paged_attention with a hybrid KV cache's group tables (`metadata.for_layer`): a layer reads and writes
its index of the pool [page_layers, N, ...] through its group's page table and slot mapping, while an
fp8 pool's scales stay the true layer's. Every implementation, against the same step on a plain pool
[L, N, ...] (tests/test_local_attention.py's chunked case: dropped pages and the null page hold NaN)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from test_kernels import LAYER
from test_local_attention import SHAPES, _fp8_case, make_case, real_tokens

from infire_jax.core.kv_groups import KVGroupLayout
from pallas_kernels import cpu_kernels
from pallas_kernels.attention import paged_attention
from pallas_kernels.metadata import NULL_PAGE

# Layers 0 and 2 global (group 0), 1 and 3 chunked (group 1): layer 1 is index 0 of group 1's pages.
LAYOUT = KVGroupLayout.of([(0, 0), (12, 0), (0, 0), (12, 0)], 4)
TRUE_LAYER = 1


@pytest.mark.parametrize("impl, fp8", [("reference", True), ("cpu", True), ("cpu", False), ("pallas_interpret", True)])
def test_a_layer_reads_its_group_through_the_dispatch(impl, fp8):
    if impl == "cpu" and not cpu_kernels.on_cpu():
        pytest.skip("no CPU kernels (no C++ compiler)")
    assert tuple(LAYOUT.layer_table()[TRUE_LAYER]) == (0, 1) and LAYER != 0
    if fp8:
        case, kv_scale, k_pool, v_pool, _ = _fp8_case((12, 0))
        if impl == "pallas_interpret":
            k_pool, v_pool = k_pool.view(ml_dtypes.float8_e4m3fn), v_pool.view(ml_dtypes.float8_e4m3fn)
        # The plain pool's layer LAYER and the true layer carry the case's scales; the others, wrong ones.
        plain_scales = np.stack([kv_scale * 3, kv_scale])
        group_scales = np.stack([kv_scale * 3, kv_scale, kv_scale * 5, kv_scale * 7])
    else:
        case = make_case(SHAPES[0], (12, 0), seed=9)
        k_pool, v_pool = case.k_pages, case.v_pages
        plain_scales = group_scales = None
    # The hybrid pool: the case's pages at index 0, index 1 (another group's layer) all poison.
    hybrid_k, hybrid_v = np.empty_like(k_pool), np.empty_like(v_pool)
    hybrid_k[0], hybrid_v[0] = k_pool[LAYER], v_pool[LAYER]
    hybrid_k[1], hybrid_v[1] = k_pool[0], v_pool[0]  # never written by the case: NaN everywhere
    meta = case.meta
    null_table = np.full_like(meta.page_table, NULL_PAGE)  # group 0: reading through it gives NaN
    null_slots = (np.arange(len(meta.slot_mapping)) % SHAPES[0].page_size).astype(np.int32)
    hybrid_meta = meta._replace(
        page_table=null_table, slot_mapping=null_slots, kv_scales=group_scales,
        group_page_tables=np.stack([null_table, meta.page_table]),
        group_slot_mappings=np.stack([null_slots, meta.slot_mapping]), layer_kv=LAYOUT.layer_table())

    def run(k_pages, v_pages, layer, step_meta):
        fn = jax.jit(lambda *a: paged_attention(*a, scale=SHAPES[0].head_dim ** -0.5,
                                                impl="reference" if impl == "cpu" else impl,
                                                cpu_kernel=impl == "cpu"))
        out = fn(jnp.asarray(case.q), jnp.asarray(case.k), jnp.asarray(case.v), jnp.asarray(k_pages),
                 jnp.asarray(v_pages), jnp.int32(layer), jax.tree.map(jnp.asarray, step_meta))
        return [np.asarray(x) for x in out]

    want, want_k, want_v = run(k_pool, v_pool, LAYER, meta._replace(kv_scales=plain_scales))
    got, got_k, got_v = run(hybrid_k, hybrid_v, TRUE_LAYER, hybrid_meta)
    real = real_tokens(meta)
    assert np.isfinite(got[real]).all()
    np.testing.assert_allclose(got[real], want[real], rtol=0, atol=1e-6)
    # The step's keys and values went to index 0 through group 1's slots, as the plain pool's to LAYER.
    np.testing.assert_array_equal(got_k[0].view(np.uint8), want_k[LAYER].view(np.uint8))
    np.testing.assert_array_equal(got_v[0].view(np.uint8), want_v[LAYER].view(np.uint8))
    np.testing.assert_array_equal(got_k[1].view(np.uint8), hybrid_k[1].view(np.uint8))
