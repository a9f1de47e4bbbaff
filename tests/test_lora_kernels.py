"""The GPU LoRA kernels (pallas_kernels/lora_sgmv.py) in Pallas interpret mode (compiled on a GPU,
where the `kernel-tests` device check runs this file), against each token's delta in float64
numpy, on SmolLM2-135M's adapted weights (hidden 576, 9 x 64 query heads, 3 x 64 kv heads,
intermediate 1536) at ranks 8 and 64; rows without an adapter exactly zero even when slot 0's
stacks hold garbage; a row's delta the same bits whatever else the step holds; the engine's
dispatch on a GPU; and the lowering to Triton for CUDA."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from h100 import compiled_kernels, gpu_lowered, launches, lowers_triton_here

from infire_jax.lora.batched import lora_delta
from infire_jax.lora.layout import MEMBERS, column_members
from pallas_kernels import lora_sgmv as gpu_lora
from pallas_kernels import placement
from pallas_kernels.lora_sgmv import applies, lora_sgmv

LAYERS, SLOTS = 2, 5  # slot 0: the base model, 1..4: adapters
# SmolLM2-135M: wqkv [576] -> [3 kv heads, 3 + 2, 64]; wo [9, 64] -> [576]; w_gate_up [576] -> [2, 1536]; w_down.
WEIGHTS = [("wqkv", (576,), (3, 5, 64)), ("wo", (9, 64), (576,)), ("w_gate_up", (576,), (2, 1536)),
           ("w_down", (1536,), (576,))]
# Each step's slots: one adapted token; eight with the base model and repeats; 37 of every slot.
STEP_SLOTS = {1: [3], 8: [0, 2, 2, 4, 0, 1, 2, 3]}


def _stacks(rng, name, k, n, rank, dtype):
    """Random stacks, slot 0 included: the kernel must skip it, not rely on its zeros."""
    c = len(MEMBERS[name])
    a = rng.standard_normal((LAYERS, SLOTS, c * rank, k)).astype(dtype)
    b = rng.standard_normal((LAYERS, SLOTS, rank, n)).astype(dtype)
    return a, b


def _slots(rng, t):
    if t in STEP_SLOTS:
        return np.asarray(STEP_SLOTS[t], np.int32)
    slots = rng.integers(0, SLOTS, t).astype(np.int32)
    slots[:SLOTS] = np.arange(SLOTS)
    return slots


def _np_delta(x, a, b, layer, slots, members):
    """float64: u = A x per token, y[n] = sum_j u[member(n) R + j] B[j, n]; zero for slot 0."""
    r = b.shape[2]
    out = np.zeros((x.shape[0], b.shape[3]))
    for t, s in enumerate(slots):
        if s == 0:
            continue
        u = a[layer, s].astype(np.float64) @ x[t].astype(np.float64)
        out[t] = np.einsum("nj,jn->n", u.reshape(-1, r)[members], b[layer, s].astype(np.float64))
    return out


def _run(x, a, b, slots, members, layer=1):
    interpret = jax.default_backend() != "gpu"
    fn = jax.jit(lambda x, a, b, s, l: lora_sgmv(x, a, b, s, members, l, interpret=interpret))
    return np.asarray(fn(jnp.asarray(x), jnp.asarray(a), jnp.asarray(b), jnp.asarray(slots), jnp.int32(layer)))


@pytest.mark.parametrize("rank", [8, 64])
@pytest.mark.parametrize("name,in_shape,out", WEIGHTS)
def test_matches_float64(name, in_shape, out, rank):
    """Steps of 1, 8 and 37 tokens; float32 sums of K products bound the error."""
    rng = np.random.default_rng(rank)
    k, n = int(np.prod(in_shape)), int(np.prod(out))
    members = column_members(name, out)
    a, b = _stacks(rng, name, k, n, rank, np.float32)
    assert applies(jnp.asarray(a), jnp.asarray(b), members)
    for t in (1, 8, 37):
        x = rng.standard_normal((t, k)).astype(np.float32)
        slots = _slots(rng, t)
        want = _np_delta(x, a, b, 1, slots, members)
        got = _run(x, a, b, slots, members)
        np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0, err_msg=f"T={t}")
        assert not got[slots == 0].any(), f"T={t}: a row without an adapter has a delta"


def test_bfloat16_stacks_and_rows_alone():
    """bfloat16 x and stacks (as the GPU serves them) against float64 of the same values; and each row
    of a 37-token step bit for bit what it gets in a step of its own."""
    rng = np.random.default_rng(1)
    name, k, out = "wqkv", 576, (3, 5, 64)
    members = column_members(name, out)
    a, b = _stacks(rng, name, k, int(np.prod(out)), 16, ml_dtypes.bfloat16)
    x = rng.standard_normal((37, k)).astype(ml_dtypes.bfloat16)
    slots = _slots(rng, 37)
    got = _run(x, a, b, slots, members, layer=0)
    want = _np_delta(x, a, b, 0, slots, members)
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)
    for t in (0, 6, 36):
        alone = _run(x[t:t + 1], a, b, slots[t:t + 1], members, layer=0)
        np.testing.assert_array_equal(alone[0], got[t], err_msg=f"row {t}")


def test_stacks_the_kernels_cannot_tile_are_refused():
    a = jnp.zeros((1, 2, 12, 64), jnp.float32)
    b = jnp.zeros((1, 2, 12, 64), jnp.float32)  # rank 12: not a power of two
    members = np.zeros(64, np.int32)
    assert not applies(a, b, members)
    with pytest.raises(ValueError, match="power-of-two rank"):
        lora_sgmv(jnp.zeros((1, 64)), a, b, jnp.zeros(1, jnp.int32), members, 0)
    assert not applies(jnp.zeros((1, 2, 8, 40)), jnp.zeros((1, 2, 8, 64)), members)  # K = 40: no step of 16


def _pallas_names(jaxpr) -> list[str]:
    names = [e.params["name"] for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
    for e in jaxpr.eqns:
        for sub in jax.extend.core.jaxprs_in_params(e.params):
            names += _pallas_names(sub)
    return names


def test_a_gpu_step_takes_the_kernels_on_one_device_only(monkeypatch):
    """lora_delta on a GPU: the Pallas shrink and expand on one device, the jnp forms on a mesh."""
    monkeypatch.setattr(placement, "platform", lambda: "gpu")
    sd = jax.ShapeDtypeStruct
    args = (sd((8, 576), jnp.bfloat16), sd((2, 5, 24, 576), jnp.bfloat16), sd((2, 5, 8, 3, 5, 64), jnp.bfloat16),
            sd((), jnp.int32), sd((8,), jnp.int32))
    for kernel, want in ((True, ["lora_shrink", "lora_expand"]), (False, [])):
        jaxpr = jax.make_jaxpr(lambda x, a, b, l, s: lora_delta(x, a, b, l, s, "wqkv", kernel))(*args)
        assert _pallas_names(jaxpr.jaxpr) == want, kernel
    assert gpu_lora.tile_rows(1, SLOTS) == 1 and gpu_lora.tile_rows(37, SLOTS) == 8


@lowers_triton_here
@pytest.mark.parametrize("name,in_shape,out", [WEIGHTS[0], WEIGHTS[2]])
def test_lowers_to_triton_for_cuda(name, in_shape, out):
    """Both calls lower through Pallas' Triton rules (jaxlib <= 0.10.2 emits the Triton IR without
    compiling it, so this runs on CPU; later jaxlibs compile while lowering, which needs a GPU), and
    compile for an H100 (tests/h100.py)."""
    sd = jax.ShapeDtypeStruct
    k, n, c = int(np.prod(in_shape)), int(np.prod(out)), len(MEMBERS[name])
    members = column_members(name, out)
    for t, rank in ((1, 8), (37, 64)):
        jitted = jax.jit(lambda x, a, b, s, l: lora_sgmv(x, a, b, s, members, l))
        args = (sd((t, k), jnp.bfloat16), sd((LAYERS, SLOTS, c * rank, k), jnp.bfloat16),
                sd((LAYERS, SLOTS, rank, n), jnp.bfloat16), sd((t,), jnp.int32), sd((), jnp.int32))
        lowered = gpu_lowered(jitted, *args)  # lowered once: its text, then compiled from it
        hlo = lowered.as_text()
        kernels = compiled_kernels(lowered)  # and they compile to sm_90a code
        for kernel in ("lora_shrink", "lora_expand"):
            assert f'name = "{kernel}"' in hlo, (t, rank, kernel)
            assert launches(kernels, kernel), (t, rank, kernels)
