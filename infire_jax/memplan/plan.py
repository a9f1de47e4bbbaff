"""The memory plan: per-device weight bytes by kind, the activation and workspace estimate, and the
KV room and tokens left on each device, for a model and a mesh, without allocating anything.

A model with chunked or sliding-window layers is planned on the hybrid KV cache (kv_groups.py): its
tokens that fit count each sequence's bounded groups' pages (a chunk's or a window's) and one step's
transient ones, as the engine's start-up log does (`KVCapacity`), for 1, 8 and 64 sequences.

Weights are split exactly as `ShardPlan.spec` splits them (a mesh axis splits the first dimension
that asks for it; the vocabulary over pp x tp), so for our own models the figures are the bytes the
engine places per device (tests/test_memplan.py checks them on 8 virtual devices).
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os
import re
from typing import Callable

from infire_jax.core.kv_groups import KVCapacity, KVGroupLayout
from infire_jax.models.gated_delta import default_snapshots
from infire_jax.memplan.model import FORMAT_BYTES, KINDS, PlanModel, Tensor
from infire_jax.quant.mxfp4 import BLOCK as MXFP4_BLOCK
from sharding.mesh import CONFIG_DIR, MeshConfig
from sharding.plan import plan_stages

GiB = 1 << 30
DEQUANT = ("per-layer", "fused")
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 1 << 10, "m": 1e6, "mb": 1e6, "mib": 1 << 20,
          "g": 1e9, "gb": 1e9, "gib": GiB, "t": 1e12, "tb": 1e12, "tib": 1 << 40}


def parse_bytes(text: str, field: str = "--device-memory") -> int:
    """"80GiB", "80GB", "85899345920" -> bytes; ValueError naming `field`."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"{field}: {text!r} is not a size such as 80GiB, 80GB or a byte count")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _splits(t: Tensor, mc: MeshConfig) -> list[int]:
    """How many ways each dimension of `t` is split (ShardPlan.spec's rules)."""
    sizes, used, out = mc.sizes, set(), []
    for name in t.axes:
        if name == "vocab":
            axes = [a for a in ("pp", "tp") if (a == "pp" and sizes["pp"] > 1) or (a == "tp" and mc.rule("vocab"))]
        else:
            axis = mc.rule(name) if name else None
            axes = [axis] if axis and axis not in used else []
        used.update(axes)
        out.append(math.prod(sizes[a] for a in axes))
    return out


def layers_per_device(num_layers: int, mc: MeshConfig) -> int:
    """Stacked layer slots a device holds: a pipeline stage pads to its longest stage."""
    pp = mc.sizes["pp"]
    return max(plan_stages(num_layers, pp)) if pp > 1 and mc.rule("layers") else num_layers


def layer_slots(count: int, model: PlanModel, mc: MeshConfig) -> int:
    """Stacked slots of a weight stacked over `count` layers on a pipeline: the model's own stack pads
    every stage to the longest; a part of it (DeepSeek's first dense layers) is spread evenly."""
    pp = mc.sizes["pp"]
    if pp == 1 or not mc.rule("layers"):
        return count
    return pp * (layers_per_device(count, mc) if count == model.num_layers else math.ceil(count / pp))


def tensor_bytes(t: Tensor, model: PlanModel, mc: MeshConfig, dtype: str) -> float:
    """Bytes of `t` on one device (its shard; quantized formats count their scales)."""
    shape = list(t.shape)
    if t.axes[0] == "layers":
        shape[0] = layer_slots(shape[0], model, mc)
    per = math.prod(math.ceil(n / k) for n, k in zip(shape, _splits(dataclasses.replace(t, shape=tuple(shape)), mc)))
    return per * FORMAT_BYTES[t.store or (model.formats[t.kind] if t.matrix else dtype)]


def _local_experts(t: Tensor, mc: MeshConfig) -> int:
    """Experts of `t` on one device (1 for a weight without an expert axis): routed experts are
    dequantized one at a time (models/moe.py), so only one of them is in the workspace."""
    if "experts" not in t.axes:
        return 1
    i = t.axes.index("experts")
    return math.ceil(t.shape[i] / _splits(t, mc)[i])


def check_fits(model: PlanModel, mc: MeshConfig) -> str | None:
    """Why the mesh cannot hold the model (ShardPlan.create's checks), or None."""
    sizes = mc.sizes
    tp = sizes["tp"] if mc.rule("q_heads") else 1
    if model.num_heads % tp:
        return f"{model.num_heads} attention heads are not divisible by tp={tp}"
    expert_axis = mc.rule("experts")
    if sizes["ep"] > 1 and not model.num_experts:
        return f"ep={sizes['ep']} needs a mixture-of-experts model"
    if expert_axis and model.num_experts and model.num_experts % sizes[expert_axis]:
        return f"{model.num_experts} experts are not divisible by {expert_axis}={sizes[expert_axis]}"
    vocab_split = math.prod(_splits(Tensor("v", "embeddings", (model.vocab_size,), ("vocab",)), mc))
    if model.vocab_size % vocab_split:
        return f"vocabulary {model.vocab_size} is not divisible by {vocab_split}"
    if model.num_layers < sizes["pp"]:
        return f"{model.num_layers} layers cannot fill {sizes['pp']} pipeline stages"
    for t in model.tensors:  # a kept part splits only into whole words and groups (llama_quant.check_mesh)
        uneven = [(n, k) for n, k in zip(t.shape, _splits(t, mc)) if t.store and n % k]
        if uneven:
            return f"kept part {t.name}: {uneven[0][0]} entries cannot be split {uneven[0][1]} ways"
        if t.matrix and model.formats[t.kind] == "mxfp4" and t.axes[1:2] == ("experts",):
            inputs, ways = t.shape[2], _splits(t, mc)[2]  # an expert weight's input axis: after layers, experts
            if inputs % (MXFP4_BLOCK * ways):
                return (f"MXFP4 weight {t.name}: its {inputs} inputs (blocks of {MXFP4_BLOCK}) cannot be split "
                        f"{ways} ways into whole blocks")
    return None


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    model: str
    mesh: str
    num_devices: int
    device_memory: int
    utilization: float
    weights: dict[str, float]  # kind -> bytes per device
    activations: float
    workspace: float
    logits: float
    kv_bytes_per_token: float
    kv_note: str
    kv_capacity: KVCapacity | None = None  # the hybrid KV cache's pages (chunked / window layers), else None
    encoder: float = 0.0  # the vision encoder's largest call's activations (an image encoded beside a step)
    slot_state: float = 0.0  # every request slot's state beside its pages (Qwen3.5's linear layers)

    @property
    def weight_bytes(self) -> float:
        return sum(self.weights.values())

    @property
    def kv_room(self) -> float:
        return (self.device_memory * self.utilization - self.weight_bytes - self.activations - self.workspace
                - self.logits - self.encoder - self.slot_state)

    @property
    def kv_pages(self) -> int:
        """Pages of the hybrid KV cache per device (each `page_layers` layers of `page_size` tokens)."""
        c = self.kv_capacity
        layer_token = self.kv_bytes_per_token / c.groups.num_layers
        return max(0, int(self.kv_room // (c.groups.page_layers * c.page_size * layer_token)))

    def context_tokens(self, num_seqs: int = 1) -> int:
        """Tokens of context each of `num_seqs` sequences can hold at once."""
        if self.kv_capacity is None:
            return max(0, int(self.kv_room // self.kv_bytes_per_token)) // num_seqs
        c = dataclasses.replace(self.kv_capacity, num_pages=self.kv_pages)
        tokens = c.context_tokens(num_seqs) if c.num_pages > 1 else 0
        return (c.num_pages - 1) * c.page_size if tokens is None else tokens

    @property
    def kv_tokens(self) -> int:
        return self.context_tokens(1)

    def describe(self) -> str:
        g = lambda b: f"{b / GiB:8.2f} GiB"  # noqa: E731
        lines = [f"model {self.model} on {self.num_devices} devices x {self.device_memory / GiB:.1f} GiB, mesh "
                 f"{os.path.basename(self.mesh)}; {self.utilization:.0%} of each device usable "
                 f"({self.device_memory * self.utilization / GiB:.2f} GiB)", "weights per device:"]
        lines += [f"  {k:<12}{g(self.weights[k])}" for k in KINDS]
        lines += [f"  {'total':<12}{g(self.weight_bytes)}",
                  f"activations (largest step) {g(self.activations)}",
                  f"dequantization workspace {g(self.workspace)}",
                  f"logits and sampling {g(self.logits)}",
                  *([f"image encoder (largest call) {g(self.encoder)}"] if self.encoder else []),
                  *([f"request slots' linear-attention state, and its prefix-cache snapshots {g(self.slot_state)}"]
                    if self.slot_state else []),
                  f"KV room per device: {self.kv_room / GiB:.2f} GiB",
                  f"KV room in all: {self.num_devices} x {self.kv_room / GiB:.2f} GiB = "
                  f"{self.num_devices * self.kv_room / GiB:.2f} GiB",
                  f"KV bytes per token per device: {self.kv_bytes_per_token:.0f} ({self.kv_note})"]
        c = self.kv_capacity
        if c is not None:
            lines.append(f"hybrid KV cache: {c.groups.describe()}; {self.kv_pages} pages of {c.page_size} tokens "
                         f"per device; each sequence holds every page of its global layers and at most its chunk's "
                         f"or window's pages in the others, a step of {c.step_tokens} tokens their transient ones")
        lines.append(f"KV tokens that fit: {self.kv_tokens} (one sequence)")
        lines += [f"KV tokens that fit, {n} sequences: {self.context_tokens(n)} each" for n in (8, 64)]
        return "\n".join(lines)


def memory_plan(model: PlanModel, mc: MeshConfig, device_memory: int, *, dtype: str = "bfloat16",
                kv_dtype: str | None = None, utilization: float = 0.90, max_num_batched_tokens: int = 8192,
                max_num_seqs: int = 64, dequant: str = "per-layer", page_size: int = 16) -> MemoryPlan:
    """The plan of `model` on the mesh; ValueError naming the problem if the mesh cannot hold it.

    `dequant`: "per-layer" (the XLA path: the scan dequantizes one layer's quantized dense weights
    to `dtype` before its matmuls, and the grouped matmul one routed expert at a time, a workspace of
    one layer's dense weights plus one local expert; the dense and MoE stacks' weights are summed,
    an upper bound) or "fused" (the GPU's Pallas kernels, pallas_kernels/quant_matmul.py: routed
    experts are read in place, no workspace for them; dense ones are too in decode-sized steps,
    but a longer prompt chunk still dequantizes one layer of them, which stays in the workspace).
    `page_size`: the engine's KV page, for a hybrid KV cache's pages (chunked or window layers; the
    engine refuses those under pp, so a pp mesh keeps every page).
    """
    if dequant not in DEQUANT:
        raise ValueError(f"dequant must be one of {list(DEQUANT)}, got {dequant!r}")
    problem = check_fits(model, mc)
    if problem:
        raise ValueError(f"{mc.name} does not fit {model.name}: {problem}")
    itemsize = FORMAT_BYTES[dtype]
    weights = {k: 0.0 for k in KINDS}
    dense_workspace = expert_workspace = 0.0  # a layer's quantized dense weights, and one local routed expert
    for t in model.tensors:
        b = tensor_bytes(t, model, mc, dtype)
        weights[t.kind] += b
        fmt = model.formats[t.kind]
        if t.matrix and fmt != dtype and t.axes[0] == "layers":  # dequantized one layer at a time in the scan
            layer = b / layer_slots(t.shape[0], model, mc) * mc.sizes["pp"] * itemsize / FORMAT_BYTES[fmt]
            if "experts" in t.axes:
                expert_workspace += layer / _local_experts(t, mc)
            else:
                dense_workspace += layer
    for t in model.kept:  # int4 parts (dense Llama-family weights): one layer's weight dequantized to `dtype`
        b = tensor_bytes(dataclasses.replace(t, store=dtype), model, mc, dtype)
        dense_workspace += b / layer_slots(t.shape[0], model, mc) * mc.sizes["pp"]
    layers = layers_per_device(model.num_layers, mc)
    kv_items = sum(n / (mc.sizes[mc.rule(axis)] if axis and mc.rule(axis) else 1) for n, axis in model.kv_per_token_layer)
    kv_itemsize = FORMAT_BYTES[kv_dtype or dtype]
    draft_axis = model.draft_kv_axis and mc.rule(model.draft_kv_axis)
    draft_items = model.draft_kv_per_token / (mc.sizes[draft_axis] if draft_axis else 1)
    tokens = max_num_batched_tokens
    heads = model.num_heads / (mc.sizes["tp"] if mc.rule("q_heads") else 1)
    mlp_axis = mc.rule("mlp")
    width = model.mlp_width / (mc.sizes[mlp_axis] if mlp_axis and mlp_axis != mc.rule("experts") else 1)
    # An estimate: the residual stream and its temporaries (8 x hidden), q/k/v of this device's
    # heads (3 x heads x head dim) and the MLP's gate, up and product (3 x width) for every token.
    activations = tokens * itemsize * (8 * model.hidden_size + 3 * heads * model.qk_head_dim + 3 * width)
    note = (f"MLA latent + rope key, {int(kv_items)} values x {layers} layers, {kv_dtype or dtype}" if model.mla
            else f"k and v, {kv_items:g} values x {layers} layers, {kv_dtype or dtype}")
    groups = KVGroupLayout.of(model.local_attention, model.num_layers)
    capacity = (KVCapacity(groups, 0, page_size, max_num_batched_tokens)
                if groups.bounded and mc.sizes["pp"] == 1 else None)
    return MemoryPlan(model=model.name, mesh=mc.name, num_devices=mc.num_devices, device_memory=device_memory,
                      utilization=utilization, weights=weights, activations=activations,
                      workspace=dense_workspace + (expert_workspace if dequant == "per-layer" else 0.0), logits=2 * max_num_seqs * model.vocab_size * 4,
                      kv_bytes_per_token=layers * kv_items * kv_itemsize + draft_items * itemsize,
                      kv_note=note + (f"; a draft head's layer, {draft_items:g} values, {dtype}"
                                      if model.draft_kv_per_token else ""), kv_capacity=capacity,
                      encoder=model.encoder_elements[0] * itemsize + model.encoder_elements[1] * 4,
                      # the engine's slots, its dummy one and the prefix cache's default snapshots, tp splitting
                      # each by head (models/gated_delta.py)
                      slot_state=(max_num_seqs + 1 + default_snapshots(max_num_seqs)) * model.slot_state_bytes * heads
                      / model.num_heads)


def shipped_meshes(num_devices: int) -> list[MeshConfig]:
    """Every shipped mesh file for exactly `num_devices` devices (`N.yaml`, `N-*.yaml`)."""
    paths = sorted(glob.glob(os.path.join(CONFIG_DIR, f"{num_devices}.yaml"))
                   + glob.glob(os.path.join(CONFIG_DIR, f"{num_devices}-*.yaml")))
    return [mc for mc in map(MeshConfig.from_yaml, paths) if mc.num_devices == num_devices]


def best_plan(model_for: Callable[[MeshConfig], PlanModel], num_devices: int, device_memory: int,
              **kw) -> MemoryPlan:
    """The shipped mesh that leaves the most KV tokens (`model_for`: the model as placed on a mesh);
    ValueError listing why each mesh failed if none holds the model."""
    plans, problems = [], []
    for mc in shipped_meshes(num_devices):
        try:
            plans.append(memory_plan(model_for(mc), mc, device_memory, **kw))
        except ValueError as e:
            problems.append(f"{os.path.basename(mc.name)}: {e}")
    if not plans:
        raise ValueError(f"no shipped mesh for {num_devices} devices holds the model: {problems}")
    return max(plans, key=lambda p: (p.kv_tokens, p.kv_room))
