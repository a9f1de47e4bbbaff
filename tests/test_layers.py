"""The decoder layer's pieces (models/layers.py, models/llama.py) in the forms XLA gets them."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infire_jax.models.layers import apply_rope, rope_tables
from infire_jax.models.llama import project_qkv


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_q_and_k_rotated_together_are_the_separate_rotations(dtype):
    """One rotation of the q and k heads' common slice of the qkv GEMM: bit for bit the rotations
    of q and k apart, in one concatenate (the GPU ran one fusion per concatenate: two a layer)."""
    t, e, hkv, g, d = 5, 64, 2, 3, 32
    key = jax.random.split(jax.random.key(0), 2)
    lp = {"wqkv": jax.random.normal(key[0], (e, hkv, g + 2, d), jnp.float32).astype(dtype)}
    x = jax.random.normal(key[1], (t, e), jnp.float32).astype(dtype)
    rope = rope_tables(1.0 / 10000 ** (np.arange(0, d, 2) / d).astype(np.float32), jnp.arange(7, 7 + t))
    together = jax.jit(project_qkv, static_argnums=2)

    @jax.jit
    def apart(lp, x, rope):
        q, k, v = project_qkv(lp, x, False)
        return apply_rope(q, *rope), apply_rope(k, *rope), v

    for got, want in zip(together(lp, x, False, rope), apart(lp, x, rope)):
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))
    text = together.trace(lp, x, False, rope).lower(lowering_platforms=("cuda",)).as_text()
    assert len(re.findall(r"stablehlo\.concatenate", text)) == 1
