"""What a memory plan needs to know about a model: its tensors, their logical axes and storage.

A `PlanModel` comes from one of our `ModelConfig`s (the engine's exact tensor layout: fused q/k/v
and gate/up, kv heads repeated for tp; a GPTQ / AWQ config's layer weights as the int4 parts
`weights_quantization="checkpoint"` keeps, or a float model's as `"int4"` quantizes them at load)
or from a plain HF `config.json` dict, which also covers DeepSeek-V3-style models (MLA attention, shared experts, `first_k_dense_replace` dense layers)
that the plan must size before the engine runs them. Weights are never allocated.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Mapping

import jax.numpy as jnp

from infire_jax.loaders import kept_8bit
from infire_jax.loaders.hf_quantized import GQA_EXPERT_KINDS, gqa_kept_scheme, hf_skips, quantization_config
from infire_jax.models.config import ModelConfig, gemma4_stacks
from infire_jax.models.gated_delta import linear_state_shapes
from infire_jax.quant.gptq_awq import kept_group
from infire_jax.quant.int4_rtn import layouts_at_load
from infire_jax.quant.resident import QuantLayout

KINDS = ("attention", "experts", "shared", "embeddings", "vision", "speculation")
# Bytes per stored weight of each format (scales included): int4 with a bf16 scale per 32 weights
# (compressed-tensors pack-quantized), fp8 with a float32 scale per 128 x 128 block (DeepSeek-V3),
# GGUF blocks (Q4_1: 20 bytes, Q8_0: 34 bytes per 32 weights), MXFP4 (gpt-oss's experts: two e2m1
# weights a byte and a uint8 e8m0 scale per 32, 4.25 bits).
FORMAT_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "int4-g32": 0.5 + 2 / 32,
                "fp8-block128": 1 + 4 / 128 ** 2, "int8-channel": 1.0, "q4_1": 20 / 32, "q8_0": 34 / 32,
                "mxfp4": 0.5 + 1 / 32,
                "int32": 4.0, "int16": 2.0, "uint8": 1.0,  # kept GPTQ / AWQ parts
                "int8": 1.0, "float8_e4m3fn": 1.0,  # kept 8-bit parts (their float32 scales: "float32")
                "float8_e4m3": 1.0}  # an fp8 KV cache (its per-head scales are a few bytes)
INT4_METHODS = ("gptq", "awq")  # planned as kept int4 parts (`kept_layouts`), not as a kind's format


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One stored tensor (stacked over `layers` layers when `axes[0] == "layers"`)."""

    name: str
    kind: str
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    matrix: bool = True  # a projection (takes the kind's format); norms, biases and routers keep the dtype
    store: str | None = None  # a kept part's own storage (a FORMAT_BYTES key), whatever the kind's format


@dataclasses.dataclass(frozen=True)
class PlanModel:
    name: str
    tensors: tuple[Tensor, ...]
    formats: Mapping[str, str]  # kind -> FORMAT_BYTES key for its matrices
    num_layers: int
    kv_per_token_layer: tuple[tuple[int, str | None], ...]  # (elements, logical axis that splits them) per layer
    hidden_size: int
    vocab_size: int
    num_heads: int
    qk_head_dim: int
    mlp_width: int  # widest per-token MLP activation (dense F, or top_k x expert width)
    num_experts: int = 0
    mla: bool = False
    kept: tuple[Tensor, ...] = ()  # weights held as the int4 parts in `tensors`, dequantized a layer at a time
    local_attention: tuple[tuple[int, int], ...] = ()  # each layer's (chunk, window): ModelConfig.local_attention
    # The vision encoder's largest call (every device runs it whole): its activations' elements in the
    # serving dtype and its float32 attention scores' (`with_vision`); (0, 0) without a tower.
    encoder_elements: tuple[int, int] = (0, 0)
    slot_state_bytes: float = 0.0  # per request slot, beside its pages (Qwen3.5's linear state)
    # A draft head's one-layer pool (EAGLE-3's, MTP's): elements a token, in the dtype, and the logical axis
    # that splits it over the mesh (MTP's GQA pool, by kv head, as the target's; None: whole on every device)
    draft_kv_per_token: int = 0
    draft_kv_axis: str | None = None


def _attention_tensors(cfg: ModelConfig, n: int, prefix: str = "") -> list[Tensor]:
    """A stack of `n` GQA layers' attention and norms (models/llama.py, models/llama4.py)."""
    e, hkv, d, hq = cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim, cfg.num_heads
    g = hq // hkv
    return [Tensor(f"{prefix}attn_norm", "attention", (n, e), ("layers", "norm"), False),
            Tensor(f"{prefix}wqkv", "attention", (n, e, hkv, g + 2, d),
                   ("layers", "embed", "kv_heads", "qkv", "head_dim")),
            Tensor(f"{prefix}wo", "attention", (n, hq, d, e), ("layers", "q_heads", "head_dim", "embed")),
            Tensor(f"{prefix}mlp_norm", "shared", (n, e), ("layers", "norm"), False)]


def _head_tensors(cfg: ModelConfig) -> list[Tensor]:
    e = cfg.hidden_size
    t = [Tensor("embed", "embeddings", (cfg.vocab_size, e), ("vocab", "embed")),
         Tensor("final_norm", "embeddings", (e,), ("norm",), False)]
    if not cfg.tie_word_embeddings:
        t.append(Tensor("lm_head", "embeddings", (cfg.vocab_size, e), ("vocab", "embed")))
    return t


def _llama4_tensors(cfg: ModelConfig) -> list[Tensor]:
    """Llama 4's two stacks (models/llama4.py): every layer's attention; the dense layers' MLP, or the
    MoE layers' router, routed experts and shared expert."""
    e, x, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    t = []
    for kind, n in cfg.llama4.stack_sizes.items():
        if not n:
            continue
        p = f"{kind}_layers."
        t += _attention_tensors(cfg, n, p)
        width = f if kind == "moe" else cfg.intermediate_size
        mlp = [Tensor(f"{p}w{'_shared' if kind == 'moe' else ''}_gate_up", "shared", (n, e, 2, width),
                      ("layers", "embed", "gate_up", "mlp")),
               Tensor(f"{p}w{'_shared' if kind == 'moe' else ''}_down", "shared", (n, width, e),
                      ("layers", "mlp", "embed"))]
        if kind == "moe":
            mlp += [Tensor(f"{p}router", "shared", (n, e, x), ("layers", "embed", "router"), False),
                    Tensor(f"{p}w_gate_up", "experts", (n, x, e, 2, f), ("layers", "experts", "embed", "gate_up", "mlp")),
                    Tensor(f"{p}w_down", "experts", (n, x, f, e), ("layers", "experts", "mlp", "embed"))]
        t += mlp
    return t + _head_tensors(cfg)


def _glm4_tensors(cfg: ModelConfig) -> list[Tensor]:
    """GLM-4.5's (and MiniMax-M2's) two stacks (models/glm4_moe.py): every layer's GQA attention (with its q/k/v bias and
    q/k norms if any); the dense layers' MLP, or the MoE layers' router and its bias, routed experts and
    shared experts."""
    e, hkv, d, x, f = cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim, cfg.num_experts, cfg.moe_intermediate_size
    dense = cfg.deepseek_moe.first_k_dense_replace
    fs = f * cfg.deepseek_moe.num_shared_experts
    t = []
    for kind, n in (("dense", dense), ("moe", cfg.num_layers - dense)):
        if not n:
            continue
        p = f"{kind}_layers."
        t += _attention_tensors(cfg, n, p)
        if cfg.attention_bias:
            t.append(Tensor(f"{p}bqkv", "attention", (n, hkv, cfg.num_heads // hkv + 2, d),
                            ("layers", "kv_heads", "qkv", "head_dim"), False))
        if cfg.qk_norm:  # over a head, or over all heads at once (MiniMax-M2: split with the heads)
            whole = cfg.glm4.qk_norm_whole
            t += [Tensor(f"{p}{k}", "attention", (n, d * h), ("layers", axis if whole else "norm"), False)
                  for k, h, axis in (("q_norm", cfg.num_heads if whole else 1, "q_heads"),
                                     ("k_norm", hkv if whole else 1, "kv_heads"))]
        if kind == "dense":
            width = cfg.intermediate_size
            t += [Tensor(f"{p}w_gate_up", "shared", (n, e, 2, width), ("layers", "embed", "gate_up", "mlp")),
                  Tensor(f"{p}w_down", "shared", (n, width, e), ("layers", "mlp", "embed"))]
            continue
        t += [Tensor(f"{p}router", "shared", (n, e, x), ("layers", "embed", "router"), False),
              Tensor(f"{p}router_bias", "shared", (n, x), ("layers", "router"), False, "float32"),
              Tensor(f"{p}w_gate_up", "experts", (n, x, e, 2, f), ("layers", "experts", "embed", "gate_up", "mlp")),
              Tensor(f"{p}w_down", "experts", (n, x, f, e), ("layers", "experts", "mlp", "embed"))]
        if fs:
            t += [Tensor(f"{p}w_shared_gate_up", "shared", (n, e, 2, fs), ("layers", "embed", "gate_up", "mlp")),
                  Tensor(f"{p}w_shared_down", "shared", (n, fs, e), ("layers", "mlp", "embed"))]
    return t + _head_tensors(cfg)


def _mlp_tensors(cfg: ModelConfig, n: int, p: str) -> list[Tensor]:
    """A stack's dense MLP, or its router, routed experts and shared expert with its gate (models/qwen3_5.py)."""
    e = cfg.hidden_size
    if not cfg.is_moe:
        f = cfg.intermediate_size
        return [Tensor(f"{p}w_gate_up", "shared", (n, e, 2, f), ("layers", "embed", "gate_up", "mlp")),
                Tensor(f"{p}w_down", "shared", (n, f, e), ("layers", "mlp", "embed"))]
    x, f, fs = cfg.num_experts, cfg.moe_intermediate_size, cfg.gated_delta.shared_expert_size
    return [Tensor(f"{p}router", "shared", (n, e, x), ("layers", "embed", "router"), False),
            Tensor(f"{p}w_gate_up", "experts", (n, x, e, 2, f), ("layers", "experts", "embed", "gate_up", "mlp")),
            Tensor(f"{p}w_down", "experts", (n, x, f, e), ("layers", "experts", "mlp", "embed")),
            Tensor(f"{p}w_shared_gate_up", "shared", (n, e, 2, fs), ("layers", "embed", "gate_up", "mlp")),
            Tensor(f"{p}w_shared_down", "shared", (n, fs, e), ("layers", "mlp", "embed")),
            Tensor(f"{p}shared_gate", "shared", (n, e), ("layers", "embed"), False)]


def _qwen3_5_tensors(cfg: ModelConfig) -> list[Tensor]:
    """Qwen3.5's two stacks (models/qwen3_5.py): the Gated DeltaNet layers' and the gated attention layers',
    each with its norms and MLP."""
    g, e, hkv, d, hq = cfg.gated_delta, cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim, cfg.num_heads
    n, value, p = cfg.num_linear_layers, g.num_v_heads * g.v_head_dim, "linear_layers."
    t = [Tensor(f"{p}w_qkv", "attention", (n, e, g.conv_dim), ("layers", "embed", "linear_qkv")),
         Tensor(f"{p}w_z", "attention", (n, e, value), ("layers", "embed", "linear_value")),
         Tensor(f"{p}w_b", "attention", (n, e, g.num_v_heads), ("layers", "embed", "linear_heads")),
         Tensor(f"{p}w_a", "attention", (n, e, g.num_v_heads), ("layers", "embed", "linear_heads")),
         Tensor(f"{p}conv", "attention", (n, g.conv_kernel, g.conv_dim), ("layers", "conv_kernel", "linear_qkv"),
                False),
         Tensor(f"{p}w_out", "attention", (n, value, e), ("layers", "linear_value", "embed"))]
    t += [Tensor(f"{p}{k}", "attention", (n, g.num_v_heads), ("layers", "linear_heads"), False)
          for k in ("dt_bias", "a_log")]
    t.append(Tensor(f"{p}norm", "attention", (n, g.v_head_dim), ("layers", "norm"), False))
    m, p = cfg.num_kv_layers, "attention_layers."
    t += [Tensor(f"{p}wq", "attention", (m, e, hq, 2, d), ("layers", "embed", "q_heads", "qkv", "head_dim")),
          Tensor(f"{p}wk", "attention", (m, e, hkv, d), ("layers", "embed", "kv_heads", "head_dim")),
          Tensor(f"{p}wv", "attention", (m, e, hkv, d), ("layers", "embed", "kv_heads", "head_dim")),
          Tensor(f"{p}wo", "attention", (m, hq, d, e), ("layers", "q_heads", "head_dim", "embed"))]
    t += [Tensor(f"{p}{k}", "attention", (m, d), ("layers", "norm"), False) for k in ("q_norm", "k_norm")]
    for stack, count in (("linear_layers.", n), ("attention_layers.", m)):
        t += [Tensor(f"{stack}attn_norm", "attention", (count, e), ("layers", "norm"), False),
              Tensor(f"{stack}mlp_norm", "shared", (count, e), ("layers", "norm"), False)]
        t += _mlp_tensors(cfg, count, stack)
    return t + _head_tensors(cfg)


def _gqa_tensors(cfg: ModelConfig) -> list[Tensor]:
    """The engine's own tensors (models/llama.py `DecoderLayers`, `Llama`; models/llama4.py's two stacks;
    models/gpt_oss.py's and models/gemma3.py's one) for an effective config."""
    if cfg.llama4 is not None:
        return _llama4_tensors(cfg)
    if cfg.glm4 is not None:
        return _glm4_tensors(cfg)
    if cfg.gated_delta is not None:
        return _qwen3_5_tensors(cfg)
    if cfg.gemma4 is not None:  # models/gemma4.py's two stacks, as config.gemma4_stacks gives them
        return [Tensor(f"{kind}_layers.{t.name}", t.kind, t.shape, t.axes, t.matrix)
                for kind, ts in gemma4_stacks(cfg).items() for t in ts] + _head_tensors(cfg)
    n, e, hkv, d, hq = cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim, cfg.num_heads
    g = hq // hkv
    t = _attention_tensors(cfg, n)
    if cfg.attention_bias:
        t.append(Tensor("bqkv", "attention", (n, hkv, g + 2, d), ("layers", "kv_heads", "qkv", "head_dim"), False))
    if cfg.qk_norm:
        t += [Tensor(k, "attention", (n, d), ("layers", "norm"), False) for k in ("q_norm", "k_norm")]
    if cfg.gemma3 is not None:  # models/gemma3.py's sandwich norms
        t += [Tensor(k, "attention" if k == "post_attn_norm" else "shared", (n, e), ("layers", "norm"), False)
              for k in ("post_attn_norm", "post_mlp_norm")]
    if cfg.gpt_oss is not None:  # models/gpt_oss.py's o bias, sinks, router and expert biases
        x, f = cfg.num_experts, cfg.moe_intermediate_size
        t += [Tensor("bo", "attention", (n, e), ("layers", "norm"), False),
              Tensor("sinks", "attention", (n, hq), ("layers", "q_heads"), False),
              Tensor("router_bias", "shared", (n, x), ("layers", "router"), False),
              Tensor("b_gate_up", "experts", (n, x, 2, f), ("layers", "experts", "gate_up", "mlp"), False),
              Tensor("b_down", "experts", (n, x, e), ("layers", "experts", "norm"), False)]
    if cfg.is_moe:
        x, f = cfg.num_experts, cfg.moe_intermediate_size
        t += [Tensor("router", "shared", (n, e, x), ("layers", "embed", "router"), False),
              Tensor("w_gate_up", "experts", (n, x, e, 2, f), ("layers", "experts", "embed", "gate_up", "mlp")),
              Tensor("w_down", "experts", (n, x, f, e), ("layers", "experts", "mlp", "embed"))]
    else:
        f = cfg.intermediate_size
        t += [Tensor("w_gate_up", "shared", (n, e, 2, f), ("layers", "embed", "gate_up", "mlp")),
              Tensor("w_down", "shared", (n, f, e), ("layers", "mlp", "embed"))]
    return t + _head_tensors(cfg)


def from_model_config(cfg: ModelConfig, dtype: str, name: str = "model", formats: Mapping[str, str] | None = None,
                      quantized: Mapping[str, QuantLayout] | None = None) -> PlanModel:
    """The plan of one of our models as the engine places it (`cfg`: the plan's effective config);
    `quantized` names the layer weights kept as parts (`kept_layouts`, `at_load_layouts`; int4 or
    8-bit), planned part by part."""
    width = cfg.num_experts_per_tok * cfg.moe_intermediate_size if cfg.is_moe else cfg.intermediate_size
    if cfg.llama4 is not None:  # the routed experts and the shared expert, or a dense layer's MLP
        width = max(width + cfg.moe_intermediate_size, cfg.intermediate_size)
    if cfg.glm4 is not None:  # the routed experts and the shared ones, or a dense layer's MLP
        width = max(width + cfg.moe_intermediate_size * cfg.deepseek_moe.num_shared_experts, cfg.intermediate_size)
    if cfg.gated_delta is not None:  # the routed experts and the shared one
        width += cfg.gated_delta.shared_expert_size
    if cfg.gemma4 is not None and cfg.is_moe:  # the MoE block beside the dense MLP
        width += cfg.intermediate_size
    tensors, kept = [], []
    for t in _gqa_tensors(cfg):
        short = _short(t.name)
        layout = (quantized or {}).get(short)
        if layout is None:
            tensors.append(t)
            continue
        kept.append(t)
        tensors += [Tensor(f"{t.name}.{part}", t.kind, shape, axes, False, jnp.dtype(store).name)
                    for part, (shape, store, axes) in layout.part_specs(short, t.shape, t.axes).items()]
    return PlanModel(name=name, tensors=tuple(tensors), formats={k: dtype for k in KINDS} | dict(formats or {}),
                     num_layers=cfg.num_layers, kv_per_token_layer=(
                         # the layers with KV (Qwen3.5: its attention layers alone), over every layer
                         (2 * cfg.num_kv_heads * cfg.head_dim * cfg.num_kv_layers / cfg.num_layers, "kv_heads"),),
                     hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, num_heads=cfg.num_heads,
                     qk_head_dim=cfg.head_dim, mlp_width=width, num_experts=cfg.num_experts, kept=tuple(kept),
                     local_attention=tuple(cfg.local_attention), slot_state_bytes=_slot_state_bytes(cfg, dtype))


def _slot_state_bytes(cfg: ModelConfig, dtype: str) -> float:
    """What a request slot holds on the device besides its pages: Qwen3.5's linear state (the convolution's
    inputs in `dtype`, the delta rule's matrices in float32; runner/device_memory.py)."""
    shapes = linear_state_shapes(cfg, 1, jnp.dtype(dtype))
    return 0.0 if shapes is None else float(sum(math.prod(shape) * dt.itemsize for shape, dt in shapes))


def with_draft_head(model: PlanModel, head, split: Mapping[str, tuple[str | None, ...]], dtype: str) -> PlanModel:
    """`model` with a draft head (an abstract EAGLE-3 or MTP head: nnx.eval_shape, of the placed config) in the
    serving dtype, as speculative/setup.py places it: whole on every device but the weights named in `split`
    (MTP's decoder layer, by its logical axes, the stack's one-layer axis left whole), and its one-layer pool
    per token (MTP's split as the target's pool: head_proposer.py `pool_sharding`)."""
    from flax import nnx

    tensors = []
    for path, var in nnx.to_flat_state(nnx.state(head)):  # its weights, and EAGLE-3's d2t table (int32)
        name = ".".join(map(str, path))
        axes = split.get(name, (None,) * len(var.shape))
        store = dtype if jnp.issubdtype(var.dtype, jnp.floating) else jnp.dtype(var.dtype).name
        tensors.append(Tensor(f"draft.{name}", "speculation", tuple(var.shape), (None, *axes[1:]) if name in split
                              else axes, store=store))
    entry = head.kv_entry
    split_pool = bool(split) and entry.split_heads  # MTP's layer is split, and so is a GQA pool
    return dataclasses.replace(model, tensors=model.tensors + tuple(tensors),
                               draft_kv_per_token=entry.heads * (entry.k_dim + entry.v_dim),
                               draft_kv_axis="kv_heads" if split_pool else None)


def with_vision(model: PlanModel, hf: Mapping[str, Any]) -> PlanModel:
    """`model` with a Llama 4 or Gemma 3 config's vision tower and the engine's image pool (the default one
    image a prompt), each held whole on every device (replicated on a mesh, as engine/setup.py `_vision`
    places them)."""
    import jax
    from flax import nnx

    from infire_jax.vision.encoder import IMAGE_POOL_PROMPTS, VisionTower
    from infire_jax.vision.gemma3_encoder import Gemma3VisionConfig, weight_shapes
    from infire_jax.vision.towers import pool_rows, tile_buckets, vision_config

    vcfg = vision_config(hf)
    if isinstance(vcfg, Gemma3VisionConfig):
        leaves, _ = jax.tree_util.tree_flatten_with_path(weight_shapes(vcfg), is_leaf=lambda x: isinstance(x, tuple))
        named = [(".".join(str(k.key) for k in path), shape) for path, shape in leaves]
        tokens = vcfg.patches_per_side ** 2  # an image's patches
    else:
        tower = nnx.eval_shape(lambda: VisionTower(vcfg))
        named = [(k, tuple(p.shape)) for k, p in sorted(vars(tower).items()) if isinstance(p, nnx.Param)]
        tokens = vcfg.patches_per_side ** 2 + 1  # a tile's patches and class token
    tensors = [Tensor(f"vision.{k}", "vision", shape, (None,) * len(shape), False) for k, shape in named]
    tensors.append(Tensor("image_pool", "vision", (pool_rows(vcfg, IMAGE_POOL_PROMPTS), vcfg.text_hidden_size),
                          (None, None), False))
    # An estimate, as the text step's: over the largest tile bucket's tokens, the residual stream and its
    # temporaries (8 x hidden), q/k/v (3 x hidden) and the MLP's inner width, and one layer's attention
    # scores in float32.
    tiles = tile_buckets(vcfg)[-1]
    elements = tiles * tokens * (11 * vcfg.hidden_size + vcfg.intermediate_size)
    return dataclasses.replace(model, tensors=model.tensors + tuple(tensors),
                               encoder_elements=(elements, tiles * vcfg.num_heads * tokens ** 2))


def kept_layouts(hf: Mapping[str, Any], cfg: ModelConfig) -> dict[str, QuantLayout]:
    """A GPTQ / AWQ, 8-bit or fp8-block config's layer weights as `weights_quantization="checkpoint"`
    keeps them (loaders/llama_quant.py; GLM-4.5's, MiniMax-M2's and Llama 4's 8-bit ones loaders/kept_8bit.py): int4 words, uint8 zeros and fp16 scales (the formats' scale
    dtype) per group, wo's groups cut at head boundaries, or with act-order (`desc_act`) whole tables and
    an int16 index of each input's group; 8-bit values (fp8 or int8) with a float32 scale per output
    channel (fp8 blocks: and block of inputs, wo's within a head).
    {} for any other config, ValueError naming a field it cannot plan."""
    scheme = gqa_kept_scheme(hf)
    if scheme is None:
        return {}
    if cfg.is_moe and scheme.kind not in GQA_EXPERT_KINDS:
        raise ValueError(f"quantization_config.quant_method {scheme.kind!r}: its weights are kept (and planned) "
                         f"for dense Llama-architecture models, not {cfg.architecture}")
    if scheme.kind in GQA_EXPERT_KINDS:
        return kept_8bit.layouts(scheme, quantization_config(hf), cfg)
    inputs = {"wqkv": cfg.hidden_size, "wo": cfg.num_heads * cfg.head_dim, "w_gate_up": cfg.hidden_size,
              "w_down": cfg.intermediate_size}
    layouts = {}
    for short, n in inputs.items():
        size = n if scheme.group == -1 else scheme.group
        group = size if scheme.act_order else kept_group(size, cfg.head_dim if short == "wo" else None)
        layouts[short] = QuantLayout("int4", group, jnp.float16, scheme.act_order)
    return layouts


def at_load_layouts(cfg: ModelConfig, mode: str, group: int) -> dict[str, QuantLayout]:
    """A float model's layer weights as `weights_quantization=mode` keeps them: "int8" / "fp8" 8-bit
    values and a float32 scale per output channel (quant/resident.py `quantize_channels`), "int4" int4
    words, uint8 zeros and fp16 scales per piece of each `group`-input group (quant/int4_rtn.py);
    ValueError naming a weight that cannot be kept so."""
    return layouts_at_load({t.name if "." in t.name else f"layers.{t.name}": t.shape for t in _gqa_tensors(cfg)},
                           mode, group)


def _short(name: str) -> str:
    """A layer weight's name in its stack ("moe_layers.wqkv" -> "wqkv"): what models take layouts by."""
    return name.rpartition(".")[2]


def _field(hf: Mapping[str, Any], key: str, default: Any = None) -> Any:
    value = hf.get(key, default)
    if value is None:
        raise ValueError(f"config field {key!r} is missing")
    return value


def formats_from_hf(hf: Mapping[str, Any], dtype: str) -> dict[str, str]:
    """Each kind's storage from `quantization_config`: compressed-tensors int4 group 32 (Kimi) or fp8
    128 x 128 blocks (DeepSeek-V3); kinds an `ignore` pattern covers keep `dtype`. GPTQ / AWQ and the
    8-bit schemes leave every kind at `dtype`: their layer weights are planned as parts (`kept_layouts`). MXFP4
    (gpt-oss) quantizes the routed experts alone, as transformers does, unless `modules_to_not_convert`
    names them."""
    formats = {k: dtype for k in KINDS}
    q = hf.get("quantization_config")
    method = (q or {}).get("quant_method")
    if not q or gqa_kept_scheme(hf) is not None:
        return formats
    if method == "mxfp4":
        if not hf_skips("model.layers.1.mlp.experts", list(q.get("modules_to_not_convert") or [])):
            formats["experts"] = "mxfp4"
        return formats
    if method == "fp8":
        if list(q.get("weight_block_size") or []) != [128, 128]:
            raise ValueError(f"quantization_config.weight_block_size {q.get('weight_block_size')} is not [128, 128]")
        fmt, ignore = "fp8-block128", list(q.get("modules_to_not_convert") or [])
    elif method == "compressed-tensors":
        groups = list((q.get("config_groups") or {}).values())
        w = groups[0].get("weights", {}) if len(groups) == 1 else {}
        if (w.get("num_bits"), w.get("group_size"), w.get("type"), w.get("symmetric")) != (4, 32, "int", True):
            raise ValueError("quantization_config.config_groups: only one group of symmetric int4 weights with "
                             f"group_size 32 is planned, got {groups}")
        fmt, ignore = "int4-g32", list(q.get("ignore") or [])
    else:
        raise ValueError(f"quantization_config.quant_method {method!r} is not planned (fp8, compressed-tensors, "
                         f"mxfp4, gptq, awq)")
    # A module of each kind, named as DeepSeek-V3 names it; `ignore` entries are names or "re:" patterns.
    probes = {"attention": "model.layers.1.self_attn.kv_b_proj", "experts": "model.layers.1.mlp.experts.0.down_proj",
              "shared": "model.layers.1.mlp.shared_experts.down_proj", "dense": "model.layers.0.mlp.down_proj"}
    ignored = {kind for kind, module in probes.items()
               if any(re.match(p[3:], module) if p.startswith("re:") else p == module for p in ignore)}
    for kind in ("attention", "experts", "shared"):
        if kind not in ignored and not (kind == "shared" and "dense" in ignored):
            formats[kind] = fmt
    return formats  # embeddings and the LM head are never quantized here


def from_hf_config(hf: Mapping[str, Any], dtype: str = "bfloat16", name: str = "model") -> PlanModel:
    """The plan of a DeepSeek-V3-style model (MLA attention: `kv_lora_rank` set) from its HF config
    dict; ValueError naming a missing field."""
    hf = dict(hf.get("text_config") or hf)
    method = (hf.get("quantization_config") or {}).get("quant_method")
    if method in INT4_METHODS:
        raise ValueError(f"quantization_config.quant_method {method!r}: int4 weights are kept (and planned) for "
                         "dense Llama-architecture models, not MLA ones")
    e, n, v = int(_field(hf, "hidden_size")), int(_field(hf, "num_hidden_layers")), int(_field(hf, "vocab_size"))
    h = int(_field(hf, "num_attention_heads"))
    q_lora, kv_lora = int(hf.get("q_lora_rank") or 0), int(_field(hf, "kv_lora_rank"))
    nope, rope, vd = int(_field(hf, "qk_nope_head_dim")), int(_field(hf, "qk_rope_head_dim")), int(_field(hf, "v_head_dim"))
    x, fm = int(hf.get("n_routed_experts") or 0), int(hf.get("moe_intermediate_size") or 0)
    dense = n if x == 0 else int(hf.get("first_k_dense_replace", 0))
    shared_w = int(hf.get("n_shared_experts") or 0) * fm
    f = int(_field(hf, "intermediate_size"))
    t = [Tensor("attn_norm", "attention", (n, e), ("layers", "norm"), False),
         Tensor("kv_a_proj", "attention", (n, e, kv_lora + rope), ("layers", "embed", None)),
         Tensor("kv_a_norm", "attention", (n, kv_lora), ("layers", "norm"), False),
         Tensor("kv_b_proj", "attention", (n, kv_lora, h, nope + vd), ("layers", None, "q_heads", "head_dim")),
         Tensor("o_proj", "attention", (n, h, vd, e), ("layers", "q_heads", "head_dim", "embed")),
         Tensor("mlp_norm", "shared", (n, e), ("layers", "norm"), False)]
    if q_lora:
        t += [Tensor("q_a_proj", "attention", (n, e, q_lora), ("layers", "embed", None)),
              Tensor("q_a_norm", "attention", (n, q_lora), ("layers", "norm"), False),
              Tensor("q_b_proj", "attention", (n, q_lora, h, nope + rope), ("layers", None, "q_heads", "head_dim"))]
    else:
        t.append(Tensor("q_proj", "attention", (n, e, h, nope + rope), ("layers", "embed", "q_heads", "head_dim")))
    if dense:
        t += [Tensor("dense_gate_up", "shared", (dense, e, 2, f), ("layers", "embed", "gate_up", "mlp")),
              Tensor("dense_down", "shared", (dense, f, e), ("layers", "mlp", "embed"))]
    if x and n > dense:
        m = n - dense
        t += [Tensor("router", "shared", (m, e, x), ("layers", "embed", "router"), False),
              Tensor("router_bias", "shared", (m, x), ("layers", "router"), False),
              Tensor("w_gate_up", "experts", (m, x, e, 2, fm), ("layers", "experts", "embed", "gate_up", "mlp")),
              Tensor("w_down", "experts", (m, x, fm, e), ("layers", "experts", "mlp", "embed"))]
        if shared_w:
            t += [Tensor("shared_gate_up", "shared", (m, e, 2, shared_w), ("layers", "embed", "gate_up", "mlp")),
                  Tensor("shared_down", "shared", (m, shared_w, e), ("layers", "mlp", "embed"))]
    t += [Tensor("embed", "embeddings", (v, e), ("vocab", "embed")),
          Tensor("final_norm", "embeddings", (e,), ("norm",), False)]
    if not hf.get("tie_word_embeddings", False):
        t.append(Tensor("lm_head", "embeddings", (v, e), ("vocab", "embed")))
    width = max(f if dense else 0, int(hf.get("num_experts_per_tok") or 0) * fm + shared_w)
    return PlanModel(name=name, tensors=tuple(t), formats=formats_from_hf(hf, dtype), num_layers=n,
                     kv_per_token_layer=((kv_lora + rope, None),),  # the latent and the rope key, shared by all heads
                     hidden_size=e, vocab_size=v, num_heads=h, qk_head_dim=nope + rope, mlp_width=width,
                     num_experts=x, mla=True)


def placed_config(cfg: ModelConfig, mc) -> ModelConfig:
    """The config the engine places on mesh `mc` (ShardPlan.effective_config without devices): kv heads
    repeated up to tp, layers padded to whole pipeline stages; ValueError if the mesh cannot split it."""
    from sharding.plan import (gemma4_kv_repeats, gemma4_problem, linear_layers_problem, repeated_config,
                               spread_config, stage_split)

    sizes, repeat = mc.sizes, 1
    tp = sizes["tp"] if mc.rule("q_heads") else 1
    if cfg.num_kv_heads % tp:
        if tp % cfg.num_kv_heads:
            raise ValueError(f"{cfg.num_kv_heads} kv heads neither divide nor are divisible by tp={tp}")
        repeat = tp // cfg.num_kv_heads
    widths = {cfg.moe_intermediate_size if cfg.is_moe else cfg.intermediate_size}
    if cfg.llama4 is not None or cfg.glm4 is not None:  # its dense layers too
        widths.add(cfg.intermediate_size)
    if cfg.glm4 is not None and cfg.glm4.qk_norm_whole and repeat > 1:
        raise ValueError(f"tp={tp} exceeds {cfg.architecture}'s {cfg.num_kv_heads} kv heads, whose k norm spans "
                         "every kv head")
    if cfg.glm4 is not None and sizes["pp"] > 1:
        raise ValueError(f"pipeline parallelism is not supported for {cfg.architecture} (the DeepSeek-V3 family's MoE)")
    problem = linear_layers_problem(cfg, mc) or gemma4_problem(cfg, mc)
    if problem:
        raise ValueError(problem)
    for width in sorted(widths):
        if mc.rule("mlp") and width % sizes["tp"]:
            raise ValueError(f"MLP width {width} is not divisible by tp={sizes['tp']}")
    if sizes["pp"] > 1:
        cfg = spread_config(cfg, stage_split(cfg, sizes["pp"]))  # a Llama 4 stage: whole super-layers
    return repeated_config(cfg, repeat, gemma4_kv_repeats(cfg, tp))
