"""DeepSeek-V3's MoE MLP: the grouped sigmoid router, routed experts and the shared expert.

Routing follows HF's `DeepseekV3TopkRouter` step by step, so the chosen experts are HF's:
router logits in float32, sigmoid scores; the score-correction bias is added for *selection only*;
experts are split into `n_group` groups, each scored by the sum of its two best biased scores, and
only the `topk_group` best groups stay eligible; the top-k eligible experts are chosen. Their
weights are the unbiased scores, renormalised over the k (`norm_topk_prob`, with HF's 1e-20) and
multiplied by `routed_scaling_factor`.

The routed experts reuse moe.py's grouped matmul (and its expert-parallel split); the shared
expert is a dense SwiGLU every token runs, split over tp like a dense MLP.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from infire_jax.models.config import ModelConfig
from infire_jax.models.layers import swiglu
from infire_jax.models.llama import linear
from infire_jax.models.moe import Routing, routed_mlp


def route_grouped(logits: Float[Array, "T X"], bias: Float[Array, "X"], cfg: ModelConfig) -> Routing:
    d = cfg.deepseek_moe
    t, x = logits.shape
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    choice = scores + bias.astype(jnp.float32)
    group_scores = jnp.sum(jax.lax.top_k(choice.reshape(t, d.n_group, x // d.n_group), 2)[0], axis=-1)
    _, groups = jax.lax.top_k(group_scores, d.topk_group)
    keep = jnp.any(groups[:, :, None] == jnp.arange(d.n_group)[None, None, :], axis=1)  # [T, n_group]
    choice = jnp.where(jnp.repeat(keep, x // d.n_group, axis=1), choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, cfg.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, experts, axis=1)
    if cfg.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return Routing(weights * d.routed_scaling_factor, experts.astype(jnp.int32))


def router_logits(lp: dict[str, Array], x: Float[Array, "T E"]) -> Float[Array, "T X"]:
    """In float32, as HF's `F.linear(hidden.float(), weight.float())`; on a GPU's decode-sized step the
    kernel reads the router stack in place and upcasts each tile on chip, where XLA wrote a float32
    copy of the layer's router first (7.3 MB a DeepSeek-V3 layer, every step)."""
    return linear(x.astype(jnp.float32), lp["router"], "te,ex->tx").astype(jnp.float32)


def shared_mlp(lp: dict[str, Array], x: Float[Array, "T E"]) -> Float[Array, "T E"]:
    gate_up = linear(x, lp["w_shared_gate_up"], "te,ecf->tcf")
    return linear(swiglu(gate_up[:, 0], gate_up[:, 1]), lp["w_shared_down"], "tf,fe->te")


def deepseek_moe_mlp(lp: dict[str, Array], x: Float[Array, "T E"], *, cfg: ModelConfig,
                     expert_axis: str | None = None) -> tuple[Float[Array, "T E"], Float[Array, "T E"] | None]:
    """(routed experts' output, shared experts' output or None), each a partial sum on a mesh: the
    routed part over the expert (and tp) axes, the shared part over tp only, so the caller reduces
    them separately."""
    routed = routed_mlp(lp, x, route_grouped(router_logits(lp, x), lp["router_bias"], cfg), expert_axis=expert_axis)
    return routed, shared_mlp(lp, x) if "w_shared_gate_up" in lp else None
