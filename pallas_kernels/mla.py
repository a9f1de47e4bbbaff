"""Multi-head Latent Attention over the latent pool: the implementation and the form of a step.

Absorbed (every step by default): W_uk [R, H, Dn] is folded into the query before attention and
W_uv [R, H, Dv] applied after it, so attention runs over the cached latents and rotary keys only.
Expanded (`INFIRE_JAX_MLA_PREFILL=expanded`, steps of at least EXPANDED_MIN_TOKENS tokens): the
step's own tokens attend each other through per-head keys and values expanded from their latents,
fewer FLOPs per pair for long prompt chunks; cached positions stay absorbed (mla_reference.py).
Measured on the 2-core CPU at DeepSeek-V3's per-device shapes under tp=8 (16 heads, R=512,
float32, one fresh prompt): 256 tokens 117 ms absorbed / 77 expanded, 512 tokens 220 / 226, 512
after 512 cached 377 / 564. No consistent gain there, so absorbed stays the default until the
form is measured on a GPU.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels import mla_reference
from pallas_kernels.attention import IMPLS
from pallas_kernels.metadata import AttentionMetadata

MLA_IMPLS = ("reference",)
FORMS = ("absorbed", "expanded")
EXPANDED_MIN_TOKENS = 256


def step_form(num_tokens: int) -> str:
    """The form of a step of `num_tokens` tokens (static: one per compiled token bucket)."""
    wanted = os.environ.get("INFIRE_JAX_MLA_PREFILL", "absorbed")
    if wanted not in FORMS:
        raise ValueError(f"INFIRE_JAX_MLA_PREFILL={wanted!r}; choose one of {FORMS}")
    return "expanded" if wanted == "expanded" and num_tokens >= EXPANDED_MIN_TOKENS else "absorbed"


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
    form: str = "absorbed",
) -> tuple[Float[Array, "T H Dv"], Array, Array]:
    """Writes the step's latents and rotary keys into the pages; returns every head's output [T, H, Dv]."""
    if impl != "reference":
        raise ValueError(f"MLA attention has no {impl!r} implementation; use 'reference'")
    if form == "expanded":
        return mla_reference.mla_paged_attention_expanded(q_nope, q_pe, latent, k_pe, w_uk, w_uv, latent_pages,
                                                          rope_pages, layer, meta, scale=scale)
    if form != "absorbed":
        raise ValueError(f"unknown MLA form {form!r}; choose one of {FORMS}")
    q_lat = jnp.einsum("thd,rhd->thr", q_nope, w_uk)
    o_lat, latent_pages, rope_pages = mla_reference.mla_paged_attention(
        q_lat, q_pe, latent, k_pe, latent_pages, rope_pages, layer, meta, scale=scale)
    return jnp.einsum("thr,rhv->thv", o_lat, w_uv), latent_pages, rope_pages
