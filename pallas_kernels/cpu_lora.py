"""The LoRA deltas of a step's tokens on the CPU, each token with its own adapter slot: a C++ XLA FFI
call (`csrc/lora_sgmv.cc`) that groups the tokens by slot and reads each slot's A and B in place,
once per tile of its tokens, on XLA's thread pool; slot 0's tokens (no adapter) cost nothing.

XLA's own gather-and-dot on this CPU moved the adapters' bytes at about 4 GB/s (a per-token gather
of A, then a batched dot), a tenth of what the machine streams; infire_jax/lora/batched.py keeps
that jnp form as the reference and for other backends.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from pallas_kernels import cpu_kernels

TARGET = "infire_lora_sgmv"


def applies(a: Array, b: Array, members: np.ndarray) -> bool:
    """Whether stacks a [L, S, C*R, K] and b [L, S, R, N] take the FFI call (decided at trace time):
    on the CPU with the library, float32 or bfloat16 stacks, K and N multiples of 16, and each
    16-column block of the output reading one member's rows of A."""
    if not cpu_kernels.on_cpu() or a.dtype != b.dtype or a.dtype not in (jnp.float32, jnp.bfloat16):
        return False
    k, n = a.shape[3], b.shape[3]
    if k % 16 or n % 16:
        return False
    blocks = members.reshape(-1, 16)
    return bool(np.all(blocks == blocks[:, :1]))


def lora_sgmv(x: Float[Array, "T K"], a: Float[Array, "L S CR K"], b: Float[Array, "L S R N"], slots: Int[Array, "T"],
              members: np.ndarray, layer: Int[Array, ""]) -> Float[Array, "T N"]:
    """y[t, n] = sum_j u[t, members[n] * R + j] b[layer, s, j, n] with u[t] = a[layer, s] x[t], s = slots[t],
    in float32 (x taken as float32); rows of slot 0 are zero."""
    cpu_kernels.require()
    out = jax.ShapeDtypeStruct((x.shape[0], b.shape[3]), jnp.float32)
    blocks = np.ascontiguousarray(members.reshape(-1, 16)[:, 0]).astype(np.int32)
    return jax.ffi.ffi_call(TARGET, out)(x.astype(jnp.float32), a, b, slots.astype(jnp.int32), blocks,
                                         jnp.asarray(layer, jnp.int32))
