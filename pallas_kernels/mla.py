"""Multi-head Latent Attention over the latent pool: the absorbed form, and the implementation choice.

W_uk [R, H, Dn] is folded into the query before attention and W_uv [R, H, Dv] applied after it,
so attention itself runs over the cached latents and rotary keys only (mla_reference.py).
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels import mla_reference
from pallas_kernels.attention import IMPLS
from pallas_kernels.metadata import AttentionMetadata

MLA_IMPLS = ("reference",)


def choose_mla_impl(impl: str) -> str:
    """"auto" -> the best MLA implementation there is; a name without an MLA implementation raises."""
    if impl not in IMPLS:
        raise ValueError(f"unknown attention implementation {impl!r}; choose one of {IMPLS}")
    if impl == "auto":
        return "reference"
    if impl not in MLA_IMPLS:
        raise ValueError(f"attn_impl={impl!r} has no MLA implementation; MLA models run {MLA_IMPLS}")
    return impl


def mla_attention(
    q_nope: Float[Array, "T H Dn"],
    q_pe: Float[Array, "T H Dr"],
    latent: Float[Array, "T R"],
    k_pe: Float[Array, "T Dr"],
    w_uk: Float[Array, "R H Dn"],
    w_uv: Float[Array, "R H Dv"],
    latent_pages: Float[Array, "L N ps 1 R"],
    rope_pages: Float[Array, "L N ps 1 Dr"],
    layer: Int[Array, ""],
    meta: AttentionMetadata,
    *,
    scale: float,
    impl: str,
) -> tuple[Float[Array, "T H Dv"], Array, Array]:
    """Writes the step's latents and rotary keys into the pages; returns every head's output [T, H, Dv]."""
    if impl != "reference":
        raise ValueError(f"MLA attention has no {impl!r} implementation; use 'reference'")
    q_lat = jnp.einsum("thd,rhd->thr", q_nope, w_uk)
    o_lat, latent_pages, rope_pages = mla_reference.mla_paged_attention(
        q_lat, q_pe, latent, k_pe, latent_pages, rope_pages, layer, meta, scale=scale)
    return jnp.einsum("thr,rhv->thv", o_lat, w_uv), latent_pages, rope_pages
