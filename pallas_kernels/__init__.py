"""Attention kernels over the paged KV cache: Pallas on GPU, pure `jnp` reference on CPU."""

from pallas_kernels.metadata import NULL_PAGE, AttentionMetadata

__all__ = ["AttentionMetadata", "NULL_PAGE"]
