"""Chooses the attention implementation: the Pallas kernels on GPU, the `jnp` reference elsewhere
(through the C++ kernel of `cpu_attention` on CPU, off a mesh).

"pallas_interpret" runs the same Pallas kernels in interpret mode (any backend, slow): it is how the
CPU test suite checks the GPU path, down to a whole model forward.
"""

from __future__ import annotations

import contextlib

import jax
from jaxtyping import Array, Float, Int

from pallas_kernels import cpu_attention, placement, prefill_attention, ragged_attention, reference
from pallas_kernels.metadata import AttentionMetadata, for_layer
from pallas_kernels.triton_backend import check_supported

IMPLS = ("auto", "reference", "pallas", "pallas_interpret")
# Part of jit's cache keys (unlike a Python context variable): a function traced under it and
# outside it again is traced twice, never given the other's program.
_DECODE_ONLY = jax.make_user_context(default_value=False)


def decode_only_steps() -> contextlib.AbstractContextManager:
    """What is traced inside is a step whose every row is one token (a decode burst's): the Pallas
    path then launches no prefill kernel. A fact of the program, known while tracing it, so the
    choice costs no `lax.cond` (which on XLA GPU copies its predicate to the host)."""
    return _DECODE_ONLY(True)


def is_decode_only() -> bool:
    """Whether what is being traced is inside `decode_only_steps` (models may pick a per-token form)."""
    return _DECODE_ONLY.value


def resolve_impl(impl: str) -> str:
    """Maps "auto" to the best implementation for the platform a call runs on; other names pass through."""
    if impl not in IMPLS:
        raise ValueError(f"unknown attention implementation {impl!r}; choose one of {IMPLS}")
    if impl == "auto":
        return "pallas" if placement.platform() == "gpu" else "reference"
    return impl


def choose_impl(impl: str, *, head_dim: int, num_q_heads: int, num_kv_heads: int, dtype) -> str:
    """Resolves "auto" and checks that the kernels can tile the model.

    "auto" falls back to the reference for shapes the kernels refuse; an explicit "pallas" raises.
    """
    chosen = resolve_impl(impl)
    if chosen in ("pallas", "pallas_interpret"):
        try:
            check_supported(head_dim, num_q_heads, num_kv_heads, dtype)
        except ValueError:
            if impl != "auto":
                raise
            return "reference"
    return chosen


def plan_step(meta: AttentionMetadata, impl: str, num_tokens: int, group: int,
              head_dim: int | None = None) -> AttentionMetadata:
    """The step's metadata as a layer loop hands it to every layer: with the Pallas prefill kernel's
    work items built once, before the loop (`group`: query heads a kv head; `head_dim` where it is
    wider than 256, which sets smaller tiles), where that kernel runs."""
    if impl not in ("pallas", "pallas_interpret") or _DECODE_ONLY.value:
        return meta
    return prefill_attention.plan_step(meta, num_tokens, group, head_dim)


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
    impl: str,
    cpu_kernel: bool = False,
    sinks: Float[Array, "Hq"] | None = None,
) -> tuple[Float[Array, "T Hq D"], Array, Array]:
    """Writes this step's k/v into the pages and returns (attention output, k_pages, v_pages).
    `cpu_kernel`: the reference may hand the step to `cpu_attention` (the caller is off a mesh).
    With `meta.kv_scales` the pool is fp8 and this layer's scales apply (kv_quant.py). With group
    tables (a hybrid KV cache) the layer reads and writes its index of the pool through its group's page
    table (`metadata.for_layer`); the scales stay the true layer's. `sinks` (gpt-oss): a learned logit
    per query head joined to each softmax (reference.join_sinks); the jnp reference computes them, the
    CPU and Pallas kernels not yet."""
    kv_scale = None if meta.kv_scales is None else meta.kv_scales[layer]
    meta, layer = for_layer(meta, layer)
    if impl == "reference":
        if cpu_kernel and cpu_attention.applies(q, k_pages):
            return cpu_attention.paged_attention(q, k, v, k_pages, v_pages, layer, meta, scale=scale,
                                                 kv_scale=kv_scale, sinks=sinks)
        return reference.ragged_paged_attention(q, k, v, k_pages, v_pages, layer, meta, scale=scale,
                                                kv_scale=kv_scale, sinks=sinks)
    if impl in ("pallas", "pallas_interpret"):
        return ragged_attention.ragged_paged_attention(q, k, v, k_pages, v_pages, layer, meta, scale=scale,
                                                       kv_scale=kv_scale, sinks=sinks,
                                                       interpret=impl == "pallas_interpret",
                                                       decode_only=_DECODE_ONLY.value)
    raise ValueError(f"unresolved attention implementation {impl!r}; call resolve_impl first")
