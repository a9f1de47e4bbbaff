"""The decode step's fused kernels, in Pallas interpret mode and compiled for an H100 (tests/h100.py):

- the residual add with the RMSNorm after it (pallas_kernels/residual_norm.py), against the same
  steps in float64 (each rounding to the model's dtype where the unfused layer rounds);
- the down projection forming silu(gate) * up from the gate/up projection's partials as it loads
  them (`quant_matmul_parts(..., swiglu_dtype=)`), against the unfused kernels and XLA's SwiGLU.

The engine with both in its layers gives the tokens of the engine without them
(tests/test_quant_kernels.py); what they save in launches is in tests/test_gpu_compile.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from h100 import compiled_kernels, gpu_lowered, launches, lowers_triton_here
from test_quant_matmul import make_stack

from pallas_kernels.quant_matmul import QuantStack, quant_matmul, quant_matmul_parts, sum_parts
from pallas_kernels.residual_norm import residual_rms_norm

RNG = np.random.default_rng(11)
EPS = 1e-5


def _round(a: np.ndarray, dtype) -> np.ndarray:
    return np.asarray(a, np.float64).astype(dtype).astype(np.float64)


@pytest.mark.parametrize("width", [576, 2880, 4096])  # chunks of 64, 64 and 1024
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32])
def test_residual_norm_is_the_unfused_add_and_norm(width, dtype):
    """h + sum(parts) rounded as the layer rounds it, and its RMSNorm with row `layer` of the stacked
    weights; the partials carry more rows than h (a padded row tile), which are ignored."""
    rows, parts, layers, layer = 5, 3, 4, 2
    h = RNG.standard_normal((rows, width)).astype(dtype)
    p = RNG.standard_normal((parts, 8, width)).astype(np.float32)
    w = (1 + 0.1 * RNG.standard_normal((layers, width))).astype(dtype)
    got_h, got_x = residual_rms_norm(jnp.asarray(h), jnp.asarray(p), jnp.asarray(w), layer, EPS, interpret=True)

    o = _round(p[:, :rows].astype(np.float64).sum(axis=0), dtype)
    want_h = _round(h.astype(np.float64) + o, dtype)
    inv = 1 / np.sqrt(np.mean(want_h * want_h, axis=-1, keepdims=True) + EPS)
    want_x = w[layer].astype(np.float64) * want_h * inv
    ulp = 2.0 ** -7 if dtype == ml_dtypes.bfloat16 else 2.0 ** -20  # an ulp, from float32's sum order
    assert got_h.dtype == got_x.dtype == jnp.dtype(dtype)
    np.testing.assert_allclose(np.asarray(got_h, np.float64), want_h, rtol=ulp, atol=ulp)
    np.testing.assert_allclose(np.asarray(got_x, np.float64), want_x, rtol=2 * ulp, atol=2 * ulp)


def test_residual_norm_names_what_does_not_fit():
    with pytest.raises(ValueError, match="do not fit"):
        residual_rms_norm(jnp.zeros((4, 64)), jnp.zeros((1, 2, 64)), jnp.ones((2, 64)), 0, EPS, interpret=True)


def _swiglu_reference(x: np.ndarray, gate_up: np.ndarray, down: np.ndarray, dtype) -> tuple[np.ndarray, np.ndarray]:
    """(silu(gate) * up @ down in float64 with the layer's roundings, |silu(gate) * up| @ |down|)."""
    f = down.shape[0]
    gu = _round(x.astype(np.float64) @ gate_up, dtype)
    g, u = gu[:, :f], gu[:, f:]
    a = _round(g / (1 + np.exp(-g)) * u, dtype)
    return a @ down, np.abs(a) @ np.abs(down)


@pytest.mark.parametrize("fmt", ["plain_bf16", "gptq32", "q4_1"])
@pytest.mark.parametrize("rows", [1, 4, 64])
def test_down_projection_forms_silu_gate_times_up_from_the_partials(fmt, rows):
    """Every packing's pieces (an int4 word's strided nibbles, Q4_1's halves), the register form
    (1 row) and dots (4, 64 rows): the fused down projection equals silu(gate) * up computed from the
    summed gate/up product and multiplied after, within a bfloat16 rounding of the SwiGLU's inputs
    (the partials are summed in another order than XLA's)."""
    e, f, n, layer = 128, 256, 128, 1
    gate_up, gu_w = make_stack(fmt, e, 2 * f)
    down, down_w = make_stack(fmt, f, n)
    x = RNG.standard_normal((rows, e)).astype(ml_dtypes.bfloat16)
    parts = quant_matmul_parts(jnp.asarray(x), gate_up, layer, interpret=True)
    got = quant_matmul_parts(parts, down, layer, interpret=True, swiglu_dtype=jnp.bfloat16)
    got = np.asarray(sum_parts(got, rows))
    want, scale = _swiglu_reference(x, gu_w[layer], down_w[layer], ml_dtypes.bfloat16)
    assert np.all(np.abs(got - want) <= 2.0 ** -6 * scale + 1e-30), np.max(np.abs(got - want) / scale)

    # the same as the unfused kernels with XLA's SwiGLU between them
    gu = quant_matmul(jnp.asarray(x), gate_up, layer, interpret=True).astype(jnp.bfloat16)
    a = (jax.nn.silu(gu[:, :f].astype(jnp.float32)) * gu[:, f:].astype(jnp.float32)).astype(jnp.bfloat16)
    unfused = np.asarray(quant_matmul(a, down, layer, interpret=True))
    assert np.all(np.abs(got - unfused) <= 2.0 ** -6 * scale + 1e-30)


def test_swiglu_input_must_be_twice_the_down_projections_inputs():
    down, _ = make_stack("plain_bf16", 256, 128)
    with pytest.raises(ValueError, match="gate and up: twice"):
        quant_matmul_parts(jnp.zeros((1, 4, 256)), down, 0, interpret=True, swiglu_dtype=jnp.bfloat16)


@lowers_triton_here
def test_both_compile_for_an_h100_at_the_8b_decode_shapes():
    """Llama 3.1 8B's decode step of 64 rows: the residual norm over 4096 columns from the o projection's
    five K splits, and the down projection [14336, 4096] reading gate/up partials in bfloat16 (its
    float32 x tiles fit the card's shared memory: quant_blocks' x_bytes), and int4 ones (strided pieces)."""
    sd = jax.ShapeDtypeStruct
    norm = gpu_lowered(jax.jit(lambda h, p, w, i: residual_rms_norm(h, p, w, i, EPS)), sd((64, 4096), jnp.bfloat16),
                       sd((5, 64, 4096), jnp.float32), sd((32, 4096), jnp.bfloat16), sd((), jnp.int32))
    assert launches(compiled_kernels(norm), "residual_rms_norm")
    plain = QuantStack(sd((32, 14336, 4096), jnp.bfloat16))
    int4 = QuantStack(sd((32, 14336 // 8, 4096), jnp.int32), sd((32, 14336 // 128, 4096), jnp.float16),
                      sd((32, 14336 // 128, 4096), jnp.uint8), packing="int4")
    for stack, parts in ((plain, 1), (int4, 2)):
        fused = gpu_lowered(jax.jit(lambda p, s, i: quant_matmul_parts(p, s, i, swiglu_dtype=jnp.bfloat16)),
                            sd((parts, 64, 2 * 14336), jnp.float32), stack, sd((), jnp.int32))
        assert launches(compiled_kernels(fused), "quant_matmul"), stack.packing
