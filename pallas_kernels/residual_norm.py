"""The residual add and the RMSNorm after it, in one Pallas (Triton) kernel.

A decoder layer's attention output enters the residual stream, and the stream is normed for the
MLP: h' = h + o, x = RMSNorm(h') * w. In a decode step o comes from the matmul kernel as unsummed
float32 partials over its K splits (quant_matmul.py's `quant_matmul_parts`); XLA would add them to h
in one kernel and norm the result in another (its Triton norm fusion takes no second output). Here
one program a row sums the partials, adds the row of h, writes h', and norms it with the layer's
row of the stacked norm weight, read in place (a slice of the stack would be a copy of its own).

Rounding follows the unfused layer (models/llama.py): the projection's sum rounded to h's dtype,
h' rounded to h's dtype, the norm in float32 (`models.layers.rms_norm`). The row is walked in
chunks of a power of two (Triton's tensors), twice: once for h' and the sum of squares, once to
scale; the second walk recomputes h' from the inputs rather than reading back its own writes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from pallas_kernels.triton_backend import compiler_params, lowered_once

MAX_CHUNK = 1024


def _chunk(width: int) -> int:
    """The largest power of two up to MAX_CHUNK that divides `width`."""
    return min(MAX_CHUNK, width & -width)


def _kernel(layer_ref, h_ref, parts_ref, weight_ref, h_out_ref, x_out_ref, *, eps: float, chunk: int):
    row, layer = pl.program_id(0), layer_ref[0]
    width = h_ref.shape[1]

    def summed(c):
        cols = pl.ds(c * chunk, chunk)
        o = sum(parts_ref[s, row, cols] for s in range(parts_ref.shape[0])).astype(h_ref.dtype)
        return cols, (h_ref[row, cols].astype(jnp.float32) + o.astype(jnp.float32)).astype(h_ref.dtype)

    def first(c, squares):
        cols, h = summed(c)
        h_out_ref[row, cols] = h
        hf = h.astype(jnp.float32)
        return squares + jnp.sum(hf * hf)

    squares = lax.fori_loop(0, width // chunk, first, jnp.float32(0))
    inv = lax.rsqrt(squares / width + eps)

    def second(c, carry):
        cols, h = summed(c)
        x_out_ref[row, cols] = (weight_ref[layer, cols].astype(jnp.float32) * (h.astype(jnp.float32) * inv)
                                ).astype(x_out_ref.dtype)
        return carry

    lax.fori_loop(0, width // chunk, second, 0)


@lowered_once("eps", "interpret")
def residual_rms_norm(h: Float[Array, "M E"], parts: Float[Array, "P R E"], weight: Float[Array, "L E"],
                      layer: Int[Array, ""] | int, eps: float, *, interpret: bool = False
                      ) -> tuple[Float[Array, "M E"], Float[Array, "M E"]]:
    """(h + the sum of `parts`' first M rows, that normed with `weight[layer]`), both in h's dtype."""
    m, width = h.shape
    if parts.ndim != 3 or parts.shape[1] < m or parts.shape[2] != width or weight.shape[-1] != width:
        raise ValueError(f"residual norm: h {tuple(h.shape)}, partials {tuple(parts.shape)} and norm weights "
                         f"{tuple(weight.shape)} do not fit")
    chunk = _chunk(width)
    whole = pl.BlockSpec()
    return pl.pallas_call(
        functools.partial(_kernel, eps=eps, chunk=chunk),
        grid=(m,),
        in_specs=[whole] * 4,
        out_specs=[whole, whole],
        out_shape=[jax.ShapeDtypeStruct(h.shape, h.dtype), jax.ShapeDtypeStruct(h.shape, h.dtype)],
        compiler_params=compiler_params(num_warps=4, num_stages=1),
        interpret=interpret,
        name="residual_rms_norm",
    )(jnp.full((1,), layer, jnp.int32), h, parts, weight)
