"""Runs the decoder stack on a mesh: one shard_map that is manual over every mesh axis.

Inside, each device holds its shard of every layer weight and of the KV pool, and the code does
its collectives explicitly (Megatron-style tensor parallelism):
  * tp: q/k/v and gate/up are column-split (local heads, local MLP columns); the outputs of wo and
    w_down are partial sums, reduced with `psum('tp')`. Activations stay replicated.
  * ep: each device holds its experts; every device routes all tokens (they are replicated),
    runs only its experts' rows, and the partial MLP outputs are reduced with `psum('ep')`.
  * pp: the stacked layer axis is split into stages and microbatches flow through
    `sharding.pipeline.pipeline_apply` (ppermute between stages). A stage with fewer layers than
    the longest holds zero-weight padding layers, which are exact identities (every sublayer adds
    a zero), so all devices run the same program with no branch around a collective.
The embedding and LM head stay outside, sharded over the vocabulary by GSPMD.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import jax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float

from pallas_kernels.metadata import AttentionMetadata, deactivate, slice_tokens
from sharding.pipeline import num_microbatches, pipeline_apply
from sharding.plan import KV_POOL_AXES, ShardPlan


@dataclasses.dataclass(frozen=True)
class Reductions:
    """Mesh axes over which a layer sums partial results; all empty on a single device."""

    attn: tuple[str, ...] = ()  # after wo
    mlp: tuple[str, ...] = ()  # after w_down (dense) or the expert combine (MoE)
    expert_axis: str | None = None  # experts are split over this axis
    dense: tuple[str, ...] = ()  # after a dense or shared-expert MLP beside experts (replicated over ep)

    @classmethod
    def for_plan(cls, plan: ShardPlan) -> "Reductions":
        attn, width = plan.axis("q_heads"), plan.axis("mlp")
        mlp = tuple(dict.fromkeys(a for a in (width, plan.axis("experts")) if a))  # experts may share tp
        return cls(attn=(attn,) if attn else (), mlp=mlp, expert_axis=plan.axis("experts"),
                   dense=(width,) if width else ())


def logical_specs(plan: ShardPlan, axes: Any) -> Any:
    """The PartitionSpecs of a pytree whose leaves are logical-axes tuples (a LinearState of them, say)."""
    return jax.tree.map(plan.spec, axes, is_leaf=lambda x: isinstance(x, tuple) and all(
        a is None or isinstance(a, str) for a in x))


def psum(x: Array, axes: tuple[str, ...]) -> Array:
    return jax.lax.psum(x, axes) if axes else x


# stack_fn(reductions, weights, h, k_pages, v_pages, meta, cos, sin, *token_args) -> (h, k_pages, v_pages)
StackFn = Callable[..., tuple[Array, Array, Array]]


def run_sharded(
    stack_fn: StackFn,
    plan: ShardPlan,
    weights: Mapping[str, Array],
    weight_axes: Mapping[str, tuple[str, ...] | Mapping[str, tuple[str, ...]]],  # a dict per compressed weight
    h: Float[Array, "T E"],
    kv: tuple[Array, Array],
    meta: AttentionMetadata,
    cos: Array,
    sin: Array,
    kv_axes: tuple[str | None, ...] = KV_POOL_AXES,  # the pool's logical axes (models/kv_entry.py)
    token_args: tuple[Array, ...] = (),  # more per-token inputs (leading axis T), replicated: LoRA slots
    state: Any = None,  # arrays the stack updates beside the pool (Qwen3.5's linear state); no pipeline
    state_axes: Any = None,  # their logical axes: a tuple where `state` has an array
    state_out_axes: Any = None,  # the logical axes of what the stack returns in the state's place, if not those
) -> tuple[Float[Array, "T E"], tuple[Array, Array]] | tuple[Float[Array, "T E"], tuple[Array, Array], Any]:
    """The stack across the mesh: h and the pool, and with `state`, the updated state (stack_fn then takes it
    after the pool's pages and returns it last; a verifying Qwen3.5 step returns its layers' inputs there)."""
    red = Reductions.for_plan(plan)
    stages = plan.num_stages
    carried = () if state is None else (state,)
    if carried and stages > 1:
        raise ValueError("a stack with state beside its pool runs without pipeline stages")

    def local(h, weights, k_pages, v_pages, meta, cos, sin, *token_args):
        if stages == 1:
            return stack_fn(red, weights, h, k_pages, v_pages, meta, cos, sin, *token_args)
        size = h.shape[0] // num_microbatches(h.shape[0], stages)

        def stage(x, pools, mb, active):
            start = mb * size
            per_token = [jax.lax.dynamic_slice_in_dim(a, start, size) for a in (cos, sin, *token_args)]
            mb_meta = deactivate(slice_tokens(meta, start, size), active)
            y, k, v = stack_fn(red, weights, x, *pools, mb_meta, *per_token)
            return y, (k, v)

        h, (k_pages, v_pages) = pipeline_apply(stage, h, (k_pages, v_pages), num_stages=stages)
        return h, k_pages, v_pages

    kv_spec = plan.spec(kv_axes)
    # An fp8 pool's scales [layers, 2, heads] are split like the pool, so a device's layer index and
    # kv heads read their own scales; so is a hybrid cache's layer table [layers, 2] (a stage's layers'
    # rows, each with its index in the stage's share of the pool: core/kv_groups.py); the rest of the
    # metadata (the group tables included) is replicated.
    meta_spec = jax.tree.map(lambda _: P(), meta)._replace(
        kv_scales=None if meta.kv_scales is None else plan.spec((kv_axes[0], None, kv_axes[3])),
        layer_kv=None if meta.layer_kv is None else plan.spec((kv_axes[0], None)))
    w_specs = jax.tree.map(plan.spec, dict(weight_axes), is_leaf=lambda x: isinstance(x, tuple))
    state_specs = tuple(jax.tree.map(lambda _, axes: plan.spec(axes), s, state_axes) for s in carried)
    out_specs = tuple(logical_specs(plan, state_axes if state_out_axes is None else state_out_axes) for _ in carried)
    fn = jax.shard_map(local, mesh=plan.mesh,
                       in_specs=(P(), w_specs, kv_spec, kv_spec, meta_spec, P(), P(), *state_specs,
                                 *[P()] * len(token_args)),
                       out_specs=(P(), kv_spec, kv_spec, *out_specs), check_vma=False)
    h, k_pages, v_pages, *state = fn(h, dict(weights), *kv, meta, cos, sin, *carried, *token_args)
    return (h, (k_pages, v_pages), *state)
