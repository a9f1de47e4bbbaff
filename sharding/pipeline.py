"""Pipeline parallelism inside one SPMD program (shard_map over the `pp` mesh axis).

Every device runs the same loop. The step's tokens are cut into microbatches; at iteration i,
stage s works on microbatch i - s and hands its output to stage s + 1 with a `ppermute`, so after
the first pp - 1 iterations all stages are busy. The last stage's outputs are broadcast back with
a masked `psum`. The stage function sees one microbatch and its own (local) layers and state.

There is no data-dependent branching: in the fill and drain iterations a stage still runs, on a
microbatch it is told is inactive (it must then leave its state untouched in effect, e.g. write
KV to a null page). Collectives inside a branch that some devices skip can deadlock.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

State = TypeVar("State")


def num_microbatches(num_tokens: int, num_stages: int) -> int:
    """The largest divisor of the token bucket that is at most the stage count (1 for tiny steps)."""
    return max(m for m in range(1, min(num_stages, num_tokens) + 1) if num_tokens % m == 0)


def pipeline_apply(
    stage_fn: Callable[[Float[Array, "B E"], State, Array, Array], tuple[Float[Array, "B E"], State]],
    x: Float[Array, "T E"],
    state: State,
    *,
    num_stages: int,
    axis: str = "pp",
) -> tuple[Float[Array, "T E"], State]:
    """Runs `stage_fn(microbatch, state, microbatch_index, active)` through all stages, inside shard_map."""
    t, e = x.shape
    m = num_microbatches(t, num_stages)
    b = t // m
    stage = jax.lax.axis_index(axis)
    xs = x.reshape(m, b, e)
    forward = [(i, i + 1) for i in range(num_stages - 1)]

    def body(it, carry):
        received, outs, state = carry
        mb = it - stage
        active = (mb >= 0) & (mb < m)
        idx = jnp.clip(mb, 0, m - 1)
        inp = jnp.where(stage == 0, xs[idx], received)
        y, state = stage_fn(inp, state, idx, active)
        outs = jnp.where(active & (stage == num_stages - 1), outs.at[idx].set(y), outs)
        return jax.lax.ppermute(y, axis, forward), outs, state

    init = (jnp.zeros((b, e), x.dtype), jnp.zeros((m, b, e), x.dtype), state)
    _, outs, state = jax.lax.fori_loop(0, m + num_stages - 1, body, init)
    out = jax.lax.psum(jnp.where(stage == num_stages - 1, outs, jnp.zeros_like(outs)), axis)
    return out.reshape(t, e), state
