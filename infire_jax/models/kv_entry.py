"""What one token stores per layer in the paged KV pool, as the model defines it.

The pool is two arrays, `k_pages` and `v_pages`, each [layers, pages, page_size, heads, dim]. A
Llama-style model stores its kv heads' keys and values there (split over tp by kv head). An MLA
model (DeepSeek-V3 family) stores the compressed latent in `k_pages` [.., 1, kv_lora_rank] and
the rotary key in `v_pages` [.., 1, qk_rope_head_dim]: 576 values a token for DeepSeek-V3, not
2 x heads x head_dim. Every head reads the same latent, so that pool is replicated over tp.
The runner (allocation, page transfer), the engine (page bytes, KV layout) and the mesh code
read the pool's shapes from here, so they follow the model.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from infire_jax.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class KVEntry:
    heads: int
    k_dim: int
    v_dim: int
    split_heads: bool  # the heads axis is split over tp (kv heads) or replicated (one shared latent)

    def k_page_shape(self, layers: int, page_size: int) -> tuple[int, ...]:
        """One page of `k_pages` across all layers, [layers, page_size, heads, k_dim]."""
        return (layers, page_size, self.heads, self.k_dim)

    def v_page_shape(self, layers: int, page_size: int) -> tuple[int, ...]:
        return (layers, page_size, self.heads, self.v_dim)

    def bytes_per_page(self, layers: int, page_size: int, dtype) -> int:
        return layers * page_size * self.heads * (self.k_dim + self.v_dim) * np.dtype(dtype).itemsize

    @property
    def pool_axes(self) -> tuple[str | None, ...]:
        """Logical axes of each pool array, [layers, pages, page_size, heads, dim]."""
        return ("layers", None, None, "kv_heads" if self.split_heads else None, None)


def kv_entry(cfg: ModelConfig) -> KVEntry:
    if cfg.mla is not None:
        return KVEntry(1, cfg.mla.kv_lora_rank, cfg.mla.qk_rope_head_dim, split_heads=False)
    return KVEntry(cfg.num_kv_heads, cfg.head_dim, cfg.head_dim, split_heads=True)
