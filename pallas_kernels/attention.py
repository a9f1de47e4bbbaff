"""Chooses the attention implementation: the Pallas kernel on GPU, the `jnp` reference elsewhere."""

from __future__ import annotations

from jaxtyping import Array, Float, Int

from pallas_kernels import reference
from pallas_kernels.metadata import AttentionMetadata

IMPLS = ("auto", "reference")


def resolve_impl(impl: str) -> str:
    """Maps "auto" to the best implementation for the default backend."""
    if impl not in IMPLS:
        raise ValueError(f"unknown attention implementation {impl!r}; choose one of {IMPLS}")
    if impl == "auto":
        return "reference"
    return impl


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
) -> tuple[Float[Array, "T Hq D"], Array, Array]:
    """Writes this step's k/v into the pages and returns (attention output, k_pages, v_pages)."""
    if impl == "reference":
        return reference.ragged_paged_attention(q, k, v, k_pages, v_pages, layer, meta, scale=scale)
    raise ValueError(f"unresolved attention implementation {impl!r}; call resolve_impl first")
