"""Multi-head Latent Attention over the latent pool: the implementation and the form of a step.

Implementations: the jnp reference (mla_reference.py), or (`attn_impl="pallas"`, chosen
explicitly) the Pallas decode kernel (mla_decode.py) for single-token rows with the reference for
prompt chunks.

Absorbed (every step by default): W_uk [H, Dn, R] is folded into the query before attention and
W_uv [H, R, Dv] applied after it, so attention runs over the cached latents and rotary keys only.
Either may come as a layer of its stack that a kernel reads in place (models/quant_kernels.py
`LayerHeads`, a decode-sized step on a GPU): anything with `matmul(x [T, H, K]) -> [T, H, N]`.
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

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels import mla_reference
from pallas_kernels.attention import resolve_impl
from pallas_kernels.decode_attention import decode_rows
from pallas_kernels.metadata import AttentionMetadata, require_global
from pallas_kernels.mla_decode import check_mla_supported, mla_decode_attention

FORMS = ("absorbed", "expanded")
EXPANDED_MIN_TOKENS = 256


def step_form(num_tokens: int) -> str:
    """The form of a step of `num_tokens` tokens (static: one per compiled token bucket)."""
    wanted = os.environ.get("INFIRE_JAX_MLA_PREFILL", "absorbed")
    if wanted not in FORMS:
        raise ValueError(f"INFIRE_JAX_MLA_PREFILL={wanted!r}; choose one of {FORMS}")
    return "expanded" if wanted == "expanded" and num_tokens >= EXPANDED_MIN_TOKENS else "absorbed"


def choose_mla_impl(impl: str, *, kv_lora_rank: int, rope_dim: int, dtype) -> str:
    """"auto" is the reference on every backend: the decode kernel has not run on a GPU yet, so it is
    chosen explicitly ("pallas"), and then checked against the latent's shapes."""
    chosen = "reference" if impl == "auto" else resolve_impl(impl)
    if chosen in ("pallas", "pallas_interpret"):
        check_mla_supported(kv_lora_rank, rope_dim, dtype)
    return chosen


def _without_decode_context(meta: AttentionMetadata) -> AttentionMetadata:
    """Single-token rows' cached context dropped, so the reference's part A loop runs only as far as
    the prompt chunks' contexts reach (the kernel attends the decode rows)."""
    q_lens = meta.cu_q_lens[1:] - meta.cu_q_lens[:-1]
    return meta._replace(kv_lens=jnp.where(decode_rows(meta), q_lens, meta.kv_lens).astype(meta.kv_lens.dtype))


def _per_head(x: Float[Array, "T H K"], w, spec: str) -> Float[Array, "T H N"]:
    """Each head's rows times its matrix: the einsum `spec` on a layer's array, or the weight's own
    in-place kernel, in x's dtype."""
    return jnp.einsum(spec, x, w) if isinstance(w, jax.Array) else w.matmul(x).astype(x.dtype)


def mla_attention(
    q_nope: Float[Array, "T H Dn"],
    q_pe: Float[Array, "T H Dr"],
    latent: Float[Array, "T R"],
    k_pe: Float[Array, "T Dr"],
    w_uk: Float[Array, "H Dn R"],
    w_uv: Float[Array, "H R Dv"],
    latent_pages: Float[Array, "L N ps 1 R"],
    rope_pages: Float[Array, "L N ps 1 Dr"],
    layer: Int[Array, ""],
    meta: AttentionMetadata,
    *,
    scale: float,
    impl: str,
    form: str = "absorbed",
) -> tuple[Float[Array, "T H Dv"], Array, Array]:
    """Writes the step's latents and rotary keys into the pages; returns every head's output [T, H, Dv].

    "pallas" / "pallas_interpret": single-token rows through the Pallas decode kernel, prompt chunks
    through the jnp reference (there is no MLA prefill kernel yet), whose cached-context loop then
    skips the decode rows. With `meta.kv_scales` the pool is fp8 and this layer's [2, 1] scales apply.
    """
    require_global(meta, "MLA attention")
    if impl not in ("reference", "pallas", "pallas_interpret"):
        raise ValueError(f"unresolved attention implementation {impl!r}; call choose_mla_impl first")
    if form not in FORMS:
        raise ValueError(f"unknown MLA form {form!r}; choose one of {FORMS}")
    q_lat = _per_head(q_nope, w_uk, "thd,hdr->thr")
    kv_scale = None if meta.kv_scales is None else meta.kv_scales[layer]
    ref_meta = meta if impl == "reference" else _without_decode_context(meta)
    if form == "expanded":
        out, latent_pages, rope_pages = mla_reference.mla_paged_attention_expanded(
            q_nope, q_pe, latent, k_pe, w_uk, w_uv, latent_pages, rope_pages, layer, ref_meta, scale=scale,
            kv_scale=kv_scale)
    else:
        o_lat, latent_pages, rope_pages = mla_reference.mla_paged_attention(
            q_lat, q_pe, latent, k_pe, latent_pages, rope_pages, layer, ref_meta, scale=scale, kv_scale=kv_scale)
        out = _per_head(o_lat, w_uv, "thr,hrv->thv")
    if impl != "reference":
        decoded, covered = mla_decode_attention(q_lat, q_pe, latent_pages, rope_pages, layer, meta, scale=scale,
                                                interpret=impl == "pallas_interpret", kv_scale=kv_scale)
        out = jnp.where(covered[:, None, None], _per_head(decoded, w_uv, "thr,hrv->thv"), out)
    return out, latent_pages, rope_pages
