"""What ties the Pallas attention kernels to the Triton lowering, kept in one place.

Triton rather than Mosaic GPU, although jax 0.11 deprecates it (docs/KERNELS.md has the details):
its lowering takes the same code on jax 0.10 and 0.11, where Mosaic GPU's API changed between the
two; kernels in backend-neutral Pallas (refs, `pl.ds`, BlockSpecs, `lax.dot_general`,
`lax.fori_loop`) run unchanged in interpret mode, so CPU tests check the bodies the GPU runs; and
decode is bandwidth-bound work whose per-position page gathers suit Triton's pointer tensors.

Triton-specific here: the compiler parameters that select the Triton lowering (jax >= 0.10 lowers
a `pallas_call` without them to Mosaic GPU), the dot precision, the pipeline depth, and the shape
rule Triton imposes (every tensor a kernel forms has power-of-two dimensions).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# Logit of a masked key: finite, so a row with no visible key yet never computes inf - inf.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def lowered_once(*static_argnames: str):
    """Decorates a kernel's entry point (the function that makes its `pallas_call`): jitted with these
    arguments static, so that its calls of one shape within a program (every layer of an unrolled
    decode step) are traced and lowered once and share that lowering. Each `pallas_call` is otherwise
    lowered to Triton on its own, in Python: about 40 ms a call, and the 8B's unrolled 64-token forward
    makes 256 of them (docs/PERFORMANCE.md). XLA inlines the shared call: the program is the same."""
    return functools.partial(jax.jit, static_argnames=static_argnames)


def compiler_params(*, num_warps: int, num_stages: int):
    """Selects the Triton lowering for a `pallas_call` (ignored in interpret mode).

    Imported here, not at module level, so that the reference path still imports on a jax that
    has dropped the deprecated Triton backend.
    """
    from jax.experimental.pallas import triton as pl_triton

    return pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def dot_precision(dtype) -> lax.Precision | None:
    """float32 pools multiply in IEEE float32 (Triton would use TF32); 16-bit pools use tensor cores."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def pipeline_stages(dtype) -> int:
    """Two stages of key/value prefetch for 16-bit pools; float32 tiles are twice as large and get one."""
    return 1 if jnp.dtype(dtype) == jnp.float32 else 2


def is_power_of_2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def check_supported(head_dim: int, num_q_heads: int, num_kv_heads: int, dtype) -> None:
    """Raises a clear error for shapes the Triton kernels cannot tile."""
    if not is_power_of_2(head_dim) or head_dim < 16:
        raise ValueError(f"the Pallas attention kernels need a power-of-two head_dim >= 16, got {head_dim}; "
                         "use the 'reference' attention implementation for this model")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16),
                                jnp.dtype(jnp.float8_e4m3fn)):
        raise ValueError(f"the Pallas attention kernels support float32, bfloat16, float16 and float8_e4m3fn "
                         f"pools, got {dtype}")


def check_fp8_device() -> None:
    """Triton widens float8_e4m3fn (its fp8e4nv) only on compute capability 8.9 and up (Ada, Hopper)."""
    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    if device.platform == "gpu" and capability is not None and float(capability) < 8.9:
        raise ValueError(f"an fp8 KV cache needs a GPU of compute capability >= 8.9 for the Pallas kernels "
                         f"(Triton's fp8e4nv); {device.device_kind} is {capability}: use kv_cache_dtype bfloat16")
