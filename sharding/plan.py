"""How one model is laid out on one mesh: which mesh axis shards each logical axis, how many layers
each pipeline stage holds, and how kv heads are replicated when tp exceeds them.

Everything here is decided from shapes before any weight is read, so a config that does not fit
the model fails with a message that names the problem.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sharding.mesh import MESH_AXES, MeshConfig, MeshConfigError

# The KV pool [layers, pages, page_size, kv_heads, head_dim].
KV_POOL_AXES = ("layers", None, None, "kv_heads", None)


def plan_stages(num_layers: int, num_stages: int, stage_extra: Sequence[float] | None = None,
                layer_cost: float = 1.0) -> tuple[int, ...]:
    """Layers per pipeline stage: contiguous, at least one each, minimising the costliest stage
    (the pipeline's bottleneck), then the spread between stages.

    `stage_extra` is each stage's non-layer work (embedding, LM head) in units of one layer. A small
    dynamic program over (stages, layers) finds the exact optimum.
    """
    if num_layers < num_stages:
        raise MeshConfigError(f"{num_layers} layers cannot fill {num_stages} pipeline stages")
    extra = list(stage_extra or [0.0] * num_stages)
    inf = (float("inf"), float("inf"))
    # best[l] = (max stage cost, sum of squared costs, counts) for the first l layers in the stages so far.
    best: list[tuple[float, float, tuple[int, ...]]] = [(0.0, 0.0, ())] + [(*inf, ())] * num_layers
    for s in range(num_stages):
        nxt = [(*inf, ())] * (num_layers + 1)
        for done in range(s, num_layers - (num_stages - s) + 1):
            worst, sq, counts = best[done]
            if worst == float("inf"):
                continue
            for n in range(1, num_layers - done - (num_stages - s - 1) + 1):
                cost = n * layer_cost + extra[s]
                cand = (max(worst, cost), sq + cost * cost, counts + (n,))
                if cand[:2] < nxt[done + n][:2]:
                    nxt[done + n] = cand
        best = nxt
    return best[num_layers][2]


def spread_layers(per_layer: Sequence, stage_layers: Sequence[int]) -> tuple:
    """A per-layer sequence over the stacked layer slots: each stage's `max(stage_layers)` slots hold its
    layers, then copies of its last layer's entry (the padding slots are identities; an entry such as a
    layer's attention kind then puts them beside a real layer of their stage)."""
    padded, out, start = max(stage_layers), [], 0
    for n in stage_layers:
        out += list(per_layer[start:start + n]) + [per_layer[start + n - 1]] * (padded - n)
        start += n
    return tuple(out)


def stage_split(cfg, num_stages: int) -> tuple[int, ...]:
    """Real layers per pipeline stage (`plan_stages`). The Llama 4 family's stages hold whole super-layers
    (models/llama4.py scans P - 1 dense layers and a MoE layer as one), so its split is of super-layers;
    dense layers after its last MoE layer (L % P) cannot be placed on a pipeline."""
    g4 = getattr(cfg, "gemma4", None)
    if g4 is not None and num_stages > 1:
        return gemma4_stages(cfg.num_layers, g4.period, num_stages)
    l4 = getattr(cfg, "llama4", None)
    if l4 is None or num_stages == 1:
        return plan_stages(cfg.num_layers, num_stages)  # MeshConfigError for fewer layers than stages
    p = l4.moe_step
    supers, tail = divmod(cfg.num_layers, p)
    if tail:
        raise MeshConfigError(f"Llama 4 pipeline stages hold whole super-layers of interleave_moe_layer_step={p} "
                              f"layers (dense then MoE); the {tail} dense layer(s) after the last MoE layer of "
                              f"{cfg.num_layers} cannot be placed")
    if supers < num_stages:
        raise MeshConfigError(f"{supers} Llama 4 super-layers ({p} layers each: dense then MoE) cannot fill "
                              f"{num_stages} pipeline stages")
    return tuple(n * p for n in plan_stages(supers, num_stages))


def gemma4_stages(num_layers: int, period: int, num_stages: int) -> tuple[int, ...]:
    """Gemma 4's stages: the same number of whole blocks (`period` - 1 windowed layers and a full one,
    models/gemma4.py) each, as its layers are no identities with zero weights (a zero layer scalar
    zeroes the residual), so no stage can be padded."""
    blocks = num_layers // period
    if blocks % num_stages:
        raise MeshConfigError(f"Gemma 4's {blocks} blocks of {period} layers (windowed, then full) cannot be split "
                              f"evenly over {num_stages} pipeline stages")
    return (num_layers // num_stages,) * num_stages


def stage_stacks(cfg, stage_layers: Sequence[int]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Each stack of layer weights (their names' prefix) with its entries in each stage: the one
    `layers` stack, Llama 4's `dense_layers` and `moe_layers` (a stage of n layers holds n / P MoE ones),
    or Gemma 4's `sliding_layers` and `full_layers` (n / P full ones)."""
    g4 = getattr(cfg, "gemma4", None)
    if g4 is not None:
        full = tuple(n // g4.period for n in stage_layers)
        return (("sliding_layers", tuple(n - f for n, f in zip(stage_layers, full))), ("full_layers", full))
    l4 = getattr(cfg, "llama4", None)
    if l4 is None:
        return (("layers", tuple(stage_layers)),)
    moe = tuple(n // l4.moe_step for n in stage_layers)
    stacks = (("dense_layers", tuple(n - m for n, m in zip(stage_layers, moe))), ("moe_layers", moe))
    return tuple((name, counts) for name, counts in stacks if any(counts))


def spread_config(cfg, stage_layers: Sequence[int]):
    """`cfg` with its layers spread over the stacked slots of whole stages (`spread_layers`): the slot
    count, and each slot's chunked / sliding-window kind and RoPE flag (Llama 4's, SmolLM3's)."""
    local = cfg.local_attention and spread_layers(cfg.local_attention, stage_layers)
    l4 = getattr(cfg, "llama4", None)
    if l4 is not None:
        l4 = dataclasses.replace(l4, rope_layers=spread_layers(l4.rope_layers, stage_layers))
    nope = getattr(cfg, "nope_layers", ()) and spread_layers(cfg.nope_layers, stage_layers)
    return dataclasses.replace(cfg, num_layers=len(stage_layers) * max(stage_layers), local_attention=local,
                               llama4=l4, nope_layers=nope)


def repeat_kv_heads(w: np.ndarray, r: int, kv_parts: int = 2) -> np.ndarray:
    """A fused q/k/v weight [..., Hkv, G + 2, D] as [..., Hkv * r, G / r + 2, D] (`kv_parts` 1: q and k
    only, [..., G + 1, D], as Gemma 4's full layers with k_eq_v).

    Copy i of kv head j keeps j's k and v and the i-th r-th of its G query heads, so query head
    order (j * G + i) is unchanged and each of the tp devices gets one kv head and its queries.
    """
    *lead, hkv, g2, d = w.shape
    g = g2 - kv_parts
    q = w[..., :g, :].reshape(*lead, hkv, r, g // r, d)
    kv = np.broadcast_to(w[..., None, g:, :], (*lead, hkv, r, kv_parts, d))
    return np.concatenate([q, kv], axis=-2).reshape(*lead, hkv * r, g // r + kv_parts, d)


def gemma4_problem(cfg, mc: MeshConfig) -> str | None:
    """Why mesh `mc` cannot split Gemma 4's layers, or None. Its pool holds a token's KV as
    cfg.num_kv_heads heads of head_dim, which the full layers view as fewer heads of their own head_dim
    (models/gemma4.py): tp must split both views into whole heads, so each device's share of the pool is
    a valid view for either kind. A kind with fewer kv heads than tp has them repeated (`gemma4_kv_repeats`)."""
    g4 = getattr(cfg, "gemma4", None)
    if g4 is None:
        return None
    tp = mc.sizes["tp"] if mc.rule("q_heads") else 1
    full_view = cfg.num_kv_heads * cfg.head_dim // g4.global_head_dim
    if cfg.num_kv_heads % tp or full_view % tp:
        return (f"tp={tp} must divide the KV slot of a token, {cfg.num_kv_heads} heads of {cfg.head_dim} for the "
                f"windowed layers and {full_view} of {g4.global_head_dim} for the full layers")
    for kind, heads in (("windowed", g4.sliding_kv_heads), ("full", g4.global_kv_heads)):
        if heads % tp and tp % heads:
            return f"the {kind} layers' {heads} kv heads neither divide nor are divisible by tp={tp}"
    if mc.rule("mlp") and cfg.intermediate_size % mc.sizes["tp"]:
        return f"dense MLP width {cfg.intermediate_size} is not divisible by tp={mc.sizes['tp']}"
    return None


def gemma4_kv_repeats(cfg, tp: int) -> tuple[tuple[str, int, int], ...]:
    """Gemma 4's stacks whose kv heads are fewer than tp, each as (stack, copies of a kv head, kv parts of
    its fused q/k/v: 1 for full layers with k_eq_v), for `repeat_kv_heads`; () for other models."""
    g4 = getattr(cfg, "gemma4", None)
    if g4 is None:
        return ()
    kinds = (("sliding_layers", g4.sliding_kv_heads, 2), ("full_layers", g4.global_kv_heads, 1 if g4.k_eq_v else 2))
    return tuple((stack, tp // heads, parts) for stack, heads, parts in kinds if heads < tp)


def repeated_config(cfg, kv_repeat: int, stack_repeats: tuple[tuple[str, int, int], ...]):
    """`cfg` with its kv heads as placed: the pool's repeated `kv_repeat` times, Gemma 4's layer kinds' by
    `stack_repeats` (`gemma4_kv_repeats`)."""
    cfg = dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads * kv_repeat)
    if not stack_repeats:
        return cfg
    r = {stack: copies for stack, copies, _ in stack_repeats}
    g4 = cfg.gemma4
    return dataclasses.replace(cfg, gemma4=dataclasses.replace(
        g4, sliding_kv_heads=g4.sliding_kv_heads * r.get("sliding_layers", 1),
        global_kv_heads=g4.global_kv_heads * r.get("full_layers", 1)))


def linear_layers_problem(cfg, mc: MeshConfig) -> str | None:
    """Why mesh `mc` cannot split a model's Gated DeltaNet layers (Qwen3.5: their heads go with the
    attention heads, sharding/mesh.py ALIASES), or None. Its two layer stacks are not split into stages."""
    g = getattr(cfg, "gated_delta", None)
    if g is None:
        return None
    sizes = mc.sizes
    if sizes["pp"] > 1:
        return f"pipeline parallelism is not supported for {cfg.architecture} (linear-attention layers); use tp or ep"
    tp = sizes["tp"] if mc.rule("q_heads") else 1
    if g.num_k_heads % tp:
        return f"{g.num_k_heads} linear-attention k heads are not divisible by tp={tp}"
    if mc.rule("mlp") and g.shared_expert_size % sizes["tp"]:
        return f"shared expert width {g.shared_expert_size} is not divisible by tp={sizes['tp']}"
    return None


# Separate k and v weights [layers, E, kv heads, D] whose kv heads are repeated as the pool's (Qwen3.5's).
SEPARATE_KV = ("attention_layers.wk", "attention_layers.wv")


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    mesh_config: MeshConfig
    mesh: Mesh
    kv_repeat: int  # each kv head is stored this many times, so tp divides the kv heads
    stage_layers: tuple[int, ...]  # real layers per pipeline stage
    padded_layers: int  # layers per stage slot (the stacked axis holds pp * padded_layers)
    stacks: tuple[tuple[str, tuple[int, ...]], ...]  # each layer stack's entries per stage (`stage_stacks`)
    stack_kv_repeats: tuple[tuple[str, int, int], ...] = ()  # Gemma 4's kinds' kv heads (`gemma4_kv_repeats`)

    # ---- construction and validation ----------------------------------------------------------
    @classmethod
    def create(cls, cfg, mc: MeshConfig, devices: Sequence[jax.Device] | None = None) -> "ShardPlan":
        devices = list(devices if devices is not None else jax.devices())
        mc.check_devices(len(devices))
        sizes = mc.sizes
        tp, pp, ep = sizes["tp"], sizes["pp"], sizes["ep"]

        def bad(msg: str):
            raise MeshConfigError(f"{mc.name} does not fit the model: {msg}")

        kv_repeat = 1
        if mc.rule("q_heads"):
            if cfg.num_heads % tp:
                bad(f"{cfg.num_heads} attention heads are not divisible by tp={tp}")
            if cfg.num_kv_heads % tp:
                if tp % cfg.num_kv_heads:
                    bad(f"{cfg.num_kv_heads} kv heads neither divide nor are divisible by tp={tp}")
                kv_repeat = tp // cfg.num_kv_heads
        if mc.rule("mlp"):
            width = cfg.moe_intermediate_size if cfg.is_moe else cfg.intermediate_size
            if width % tp:
                bad(f"MLP width {width} is not divisible by tp={tp}")
        vocab_shards = (pp if pp > 1 else 1) * (tp if mc.rule("vocab") else 1)
        if cfg.vocab_size % vocab_shards:
            bad(f"vocabulary {cfg.vocab_size} is not divisible by {vocab_shards} (pp x tp)")
        if ep > 1 and not cfg.is_moe:
            bad(f"ep={ep} needs a mixture-of-experts model")
        expert_axis = mc.rule("experts")
        if expert_axis and cfg.num_experts % sizes[expert_axis]:
            bad(f"{cfg.num_experts} experts are not divisible by {expert_axis}={sizes[expert_axis]}")
        for field in ("deepseek_moe", "llama4"):  # two layer stacks: also dense layers' MLPs
            if getattr(cfg, field, None) is None:
                continue
            if field == "deepseek_moe" and pp > 1:
                bad(f"pipeline parallelism is not supported for {cfg.architecture} (the DeepSeek-V3 family's MoE)")
            glm4 = getattr(cfg, "glm4", None)
            if glm4 is not None and glm4.qk_norm_whole and kv_repeat > 1:
                bad(f"tp={tp} exceeds {cfg.architecture}'s {cfg.num_kv_heads} kv heads, whose k norm spans every "
                    "kv head (a repeated head would count twice); use tp up to the kv heads, with ep for the experts")
            if mc.rule("mlp") and cfg.intermediate_size % tp:
                bad(f"dense MLP width {cfg.intermediate_size} is not divisible by tp={tp}")
        problem = linear_layers_problem(cfg, mc) or gemma4_problem(cfg, mc)
        if problem:
            bad(problem)
        try:
            stages = stage_split(cfg, pp)
        except MeshConfigError as e:
            bad(str(e))
        mesh = Mesh(np.asarray(devices[:mc.num_devices]).reshape([sizes[a] for a in MESH_AXES]), MESH_AXES)
        tp = sizes["tp"] if mc.rule("q_heads") else 1
        return cls(mc, mesh, kv_repeat, stages, max(stages), stage_stacks(cfg, stages), gemma4_kv_repeats(cfg, tp))

    @classmethod
    def single_device(cls, cfg, device: jax.Device | None = None) -> "ShardPlan":
        return cls.create(cfg, MeshConfig.single_device(), [device or jax.devices()[0]])

    # ---- queries ------------------------------------------------------------------------------
    @property
    def sizes(self) -> dict[str, int]:
        return self.mesh_config.sizes

    @property
    def num_stages(self) -> int:
        return self.sizes["pp"]

    def axis(self, logical: str) -> str | None:
        """The mesh axis that splits a logical axis inside the manual (shard_map) region."""
        return self.mesh_config.rule(logical)

    def effective_config(self, cfg):
        """The config the placed model has: kv heads repeated, layers padded to whole stages (and their
        per-layer kinds spread over the stage slots, `spread_config`)."""
        spread = spread_config(cfg, self.stage_layers)
        return repeated_config(spread, self.kv_repeat, self.stack_kv_repeats)

    def spec(self, logical_axes: Sequence[str | None]) -> P:
        """A mesh axis splits the first dimension that asks for it; later ones stay whole (experts split
        over tp keep each expert's MLP width whole)."""
        parts, used = [], set()
        for name in logical_axes:
            if name == "vocab":  # spread over the pipeline too, so every stage carries a share of the head
                axes = tuple(a for a in ("pp", "tp") if (a == "pp" and self.num_stages > 1)
                             or (a == "tp" and self.axis("vocab")))
                parts.append(axes if len(axes) > 1 else (axes[0] if axes else None))
            else:
                axis = self.axis(name) if name else None
                parts.append(axis if axis not in used else None)
                axes = (axis,) if axis else ()
            used.update(axes)
        return P(*parts)

    def sharding(self, logical_axes: Sequence[str | None]) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(logical_axes))

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def layer_slot_mask(self, stack: str = "layers") -> np.ndarray | None:
        """For the slots of layer stack `stack` (a `stacks` name): 1 where a real layer is, 0 in a stage's
        padding slots; None for what is no layer stack."""
        counts = dict(self.stacks).get(stack)
        if counts is None:
            return None
        padded = max(counts)
        mask = np.zeros(self.num_stages * padded, np.float32)
        for s, n in enumerate(counts):
            mask[s * padded:s * padded + n] = 1
        return mask

    # ---- host weights -------------------------------------------------------------------------
    def prepare_kv_scales(self, scales: np.ndarray) -> np.ndarray:
        """An fp8 pool's scales [layers, 2, kv heads] in the pool's layout: each kv head's scale for
        each of its copies (as `repeat_kv_heads`), the layers spread over the stage slots (padding
        slots hold 1: they are never read)."""
        scales = np.repeat(scales, self.kv_repeat, axis=2)
        if self.num_stages == 1:
            return scales
        out = np.ones((self.num_stages * self.padded_layers, *scales.shape[1:]), scales.dtype)
        starts = np.cumsum((0,) + self.stage_layers[:-1])
        for s, (start, n) in enumerate(zip(starts, self.stage_layers)):
            out[s * self.padded_layers:s * self.padded_layers + n] = scales[start:start + n]
        return out

    def prepare_weights(self, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Repeats kv heads and spreads each stack's layers over its padded stage slots (zeros: identities)."""
        out = dict(weights)
        if self.kv_repeat > 1:  # every stack's fused q/k/v ("layers.wqkv", or Llama 4's "moe_layers.wqkv")
            for name in [k for k in out if k.endswith((".wqkv", ".bqkv"))]:
                out[name] = repeat_kv_heads(out[name], self.kv_repeat)
            # copy i of kv head j beside j's others, as the fused weight's (the weight, or its quantized parts)
            for name in [k for k in out if k in SEPARATE_KV or k.rpartition(".")[0] in SEPARATE_KV]:
                out[name] = np.repeat(out[name], self.kv_repeat, axis=2)
        for stack, copies, parts in self.stack_kv_repeats:  # the weight, or each of its quantized parts
            for name in [k for k in out if k == f"{stack}.wqkv" or k.startswith(f"{stack}.wqkv.")]:
                out[name] = repeat_kv_heads(out[name], copies, parts)
        if self.num_stages > 1:
            for stack, counts in self.stacks:
                starts, slots = np.cumsum((0,) + counts[:-1]), max(counts)
                for name in [k for k in out if k.startswith(f"{stack}.")]:
                    w = out[name]
                    padded = np.zeros((self.num_stages * slots, *w.shape[1:]), w.dtype)
                    for s, (start, n) in enumerate(zip(starts, counts)):
                        padded[s * slots:s * slots + n] = w[start:start + n]
                    out[name] = padded
        return out
