"""Static model configuration: the dataclasses every model family's config parser fills in.

The config is a frozen dataclass so it can be a static (hashable) argument of jitted functions.
The parsers (models/llama_config.py, models/deepseek_config.py) import these; models/hf_config.py
picks the parser for an HF `config.json` by its model_type.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, NamedTuple

from infire_jax.errors import UnsupportedModelError

# The architecture families a ModelConfig may name (models/registry.py builds each).
ARCHITECTURES = ("llama", "qwen2", "qwen3", "mixtral", "qwen3_moe", "deepseek_v3", "llama4", "gpt_oss", "gemma3",
                 "gemma4", "glm4_moe", "minimax_m2", "qwen3_5")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `kind` is "linear", "llama3", "yarn" (DeepSeek-V3 family, gpt-oss) or
    "longrope" (Phi-3.5, Phi-4-mini: `models/layers.rope_cos_sin`)."""

    kind: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # YaRN (models/yarn.py)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    truncate: bool = True  # YaRN's ramp bounds rounded to whole dimensions (gpt-oss: false)
    # LongRoPE: each rotated frequency's divisor (the checkpoint's long_factor where it extends its
    # original context, else its short_factor) and the factor on cos and sin; an extending checkpoint's
    # short_factor too, which an engine serving no more than the original context rotates by instead
    # (`served_rope`)
    freq_factors: tuple[float, ...] = ()
    attention_factor: float = 1.0
    short_factors: tuple[float, ...] = ()


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Multi-head Latent Attention sizes (DeepSeek-V3 family)."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclasses.dataclass(frozen=True)
class DeepseekMoEConfig:
    """DeepSeek-V3 MoE: grouped sigmoid router with score-correction bias, shared experts, dense first layers."""

    n_group: int
    topk_group: int
    routed_scaling_factor: float
    num_shared_experts: int
    first_k_dense_replace: int


@dataclasses.dataclass(frozen=True)
class Llama4Config:
    """What sets a Llama 4 layer apart (models/llama4_config.py parses it, models/llama4.py runs it).

    Layer i is a MoE layer when (i + 1) % moe_step == 0 (HF's `interleave_moe_layer_step` and
    `moe_layers`), else a dense one of ModelConfig.intermediate_size; a MoE layer's routed experts
    and its shared expert are ModelConfig.moe_intermediate_size wide. Which layers attend within a
    chunk is ModelConfig.local_attention."""

    rope_layers: tuple[bool, ...]  # layer i rotates q and k (HF no_rope_layers[i] == 1); else a NoPE layer
    moe_step: int
    qk_l2_norm: bool  # use_qk_norm: a weightless L2 norm of q and k after the rotation, on RoPE layers
    temperature_tuning: bool  # attn_temperature_tuning: NoPE layers scale q by log1p(floor((p + 1) / floor_scale))
    floor_scale: float  # * attn_scale + 1
    attn_scale: float

    def is_moe_layer(self, i: int) -> bool:
        return (i + 1) % self.moe_step == 0

    @property
    def stack_sizes(self) -> dict[str, int]:
        """Layers in each of models/llama4.py's stacks: "dense", "moe"."""
        moe = len(self.rope_layers) // self.moe_step
        return {"dense": len(self.rope_layers) - moe, "moe": moe}


@dataclasses.dataclass(frozen=True)
class GptOssConfig:
    """gpt-oss's clamped SwiGLU experts (models/gpt_oss_config.py parses it, models/gpt_oss.py runs it):
    the gate clamped above at `swiglu_limit`, the up projection to +-limit, out = (up + 1) * gate *
    sigmoid(alpha * gate). Its other traits (attention sinks, biases, top-k softmax routing) hold for
    every gpt-oss model."""

    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0


@dataclasses.dataclass(frozen=True)
class Gemma3Config:
    """What sets Gemma 3's decoder apart (models/gemma3_config.py parses it, models/gemma3.py runs it):
    attention scaled by `query_pre_attn_scalar` ** -0.5 rather than head_dim's, and the windowed layers'
    own RoPE base (ModelConfig.rope_theta and rope_scaling are the global layers'). Its other traits
    (sandwich norms, the embedding scaled by sqrt(hidden), GELU-tanh MLP) hold for every Gemma 3."""

    query_pre_attn_scalar: float = 256.0
    local_rope_theta: float = 10000.0


@dataclasses.dataclass(frozen=True)
class Gemma4Config:
    """What sets Gemma 4's decoder apart (models/gemma4_config.py parses it, models/gemma4.py runs it).

    Layers come in blocks of `period`: period - 1 windowed ("sliding") layers, then one full layer.
    ModelConfig.head_dim and num_kv_heads describe the KV pool's per-token slot (models/gemma4.py):
    the windowed layers' head_dim, and as many heads as the wider kind needs. The windowed layers have
    `sliding_kv_heads` kv heads; full layers `global_kv_heads` of `global_head_dim`, with no v_proj
    when `k_eq_v` (values are the raw k projection). RoPE: windowed layers rotate every dimension with
    base `local_rope_theta`; full layers ("proportional") rotate the first
    `global_rotary_fraction` of each half with ModelConfig.rope_theta, the frequencies over the whole
    global_head_dim. ModelConfig.num_experts > 0: each layer's MoE block beside its dense MLP."""

    period: int
    sliding_kv_heads: int
    global_kv_heads: int
    global_head_dim: int
    k_eq_v: bool
    local_rope_theta: float = 10000.0
    global_rotary_fraction: float = 0.25
    global_rope_factor: float = 1.0
    final_logit_softcapping: float | None = None


@dataclasses.dataclass(frozen=True)
class Glm4Config:
    """What sets GLM-4.5's and MiniMax-M2's decoder apart (models/glm4_config.py and
    models/minimax_m2_config.py parse it, models/glm4_moe.py runs it): q and k rotate only their first
    `rotary_dim` dimensions (HF's partial_rotary_factor). Their MoE is DeepSeek-V3's
    (ModelConfig.deepseek_moe), their attention GQA with ModelConfig's bias and q/k norm: over each head
    (GLM-4.5), or over all heads' q (k) at once (`qk_norm_whole`: MiniMax-M2's)."""

    rotary_dim: int
    qk_norm_whole: bool = False


@dataclasses.dataclass(frozen=True)
class GatedDeltaNetConfig:
    """Qwen3.5's (and Qwen3-Next's) hybrid decoder (models/qwen3_5_config.py parses it, models/qwen3_5.py
    runs it): layer i attends (gated GQA over the paged pool, rotating the first `rotary_dim` dimensions of
    each head) when (i + 1) % interval == 0; every other layer is a Gated DeltaNet, a linear attention whose
    state per sequence (a causal convolution's last inputs and a [v heads, k dim, v dim] matrix) lives in
    the request's device slot instead of the pool (models/gated_delta.py). The MoE models' layers have
    ModelConfig's experts and a shared expert `shared_expert_size` wide, gated by a sigmoid."""

    interval: int
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    rotary_dim: int
    shared_expert_size: int = 0

    @property
    def conv_dim(self) -> int:
        """The channels the convolution runs over: q and k of every k head, v of every v head."""
        return 2 * self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    # Per-frequency divisors stored by GGUF files of Llama 3.x (`rope_freqs.weight`).
    rope_freq_factors: tuple[float, ...] | None = None
    # q and k rotate their first `rotary_dim` dimensions, the rest pass (HF's partial_rotary_factor:
    # Phi-4-mini's three quarters); 0: the whole head. Llama-family layers (models/llama.py).
    rotary_dim: int = 0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts (0 experts means a dense MLP).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    # DeepSeek-V3 family (architecture "deepseek_v3"; models/deepseek_config.py parses and checks them).
    mla: MLAConfig | None = None
    deepseek_moe: DeepseekMoEConfig | None = None
    # Llama 4 (architecture "llama4"; models/llama4_config.py parses and checks it).
    llama4: Llama4Config | None = None
    # gpt-oss (architecture "gpt_oss"; models/gpt_oss_config.py parses and checks it).
    gpt_oss: GptOssConfig | None = None
    # Gemma 3 (architecture "gemma3"; models/gemma3_config.py parses and checks it).
    gemma3: Gemma3Config | None = None
    # Gemma 4 (architecture "gemma4"; models/gemma4_config.py parses and checks it).
    gemma4: Gemma4Config | None = None
    # GLM-4.5 / 4.6 (architecture "glm4_moe", models/glm4_config.py) and MiniMax-M2 ("minimax_m2",
    # models/minimax_m2_config.py): GQA with a partial rotation beside DeepSeek-V3's MoE.
    glm4: Glm4Config | None = None
    # Chunked and sliding-window attention: each layer's (chunk C, window W), as LocalMask in
    # pallas_kernels/metadata.py reads them (C > 0: the query at p sees keys [C*floor(p/C), p]; W > 0:
    # keys [p-W+1, p]; (0, 0): a global layer). Empty: every layer is global.
    local_attention: tuple[tuple[int, int], ...] = ()
    # Layers that do not rotate q and k (SmolLM3's NoPE layers; models/llama.py). Empty: every layer rotates.
    nope_layers: tuple[bool, ...] = ()
    # Qwen3.5 (architecture "qwen3_5", models/qwen3_5_config.py): linear-attention layers between attention ones.
    gated_delta: GatedDeltaNetConfig | None = None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_kv_layers(self) -> int:
        """The layers that keep keys and values in the paged pool (Qwen3.5: its attention layers alone)."""
        return self.num_layers // self.gated_delta.interval if self.gated_delta else self.num_layers

    def kv_layer(self, layer: int) -> int | None:
        """Layer `layer`'s index in the paged pool; None for a layer that keeps no keys and values there
        (Qwen3.5: each group of `interval` layers ends in its attention layer)."""
        if self.gated_delta is None:
            return layer
        interval = self.gated_delta.interval
        return layer // interval if (layer + 1) % interval == 0 else None

    @property
    def num_linear_layers(self) -> int:
        """The layers whose state lives in a request's device slot (Qwen3.5's Gated DeltaNets)."""
        return self.num_layers - self.num_kv_layers

    @property
    def has_local_attention(self) -> bool:
        """Whether any layer attends to a chunk or window only (the KV cache may then drop pages)."""
        return any(c or w for c, w in self.local_attention)

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise UnsupportedModelError(f"unsupported architecture {self.architecture!r}")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.is_moe and not (0 < self.num_experts_per_tok <= self.num_experts):
            raise UnsupportedModelError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, {self.num_experts}]")
        if (self.llama4 is not None) != (self.architecture == "llama4") or (
                self.llama4 is not None and len(self.llama4.rope_layers) != self.num_layers):
            raise UnsupportedModelError("a llama4 config needs its Llama4Config, with a RoPE flag for each layer")
        if (self.gpt_oss is not None) != (self.architecture == "gpt_oss"):
            raise UnsupportedModelError("a gpt_oss config needs its GptOssConfig, and only it has one")
        if (self.gemma3 is not None) != (self.architecture == "gemma3"):
            raise UnsupportedModelError("a gemma3 config needs its Gemma3Config, and only it has one")
        if (self.gemma4 is not None) != (self.architecture == "gemma4"):
            raise UnsupportedModelError("a gemma4 config needs its Gemma4Config, and only it has one")
        if (self.glm4 is not None) != (self.architecture in ("glm4_moe", "minimax_m2")):
            raise UnsupportedModelError("glm4_moe and minimax_m2 configs need their Glm4Config, and only they have one")
        if (self.gated_delta is not None) != (self.architecture == "qwen3_5") or (
                self.gated_delta is not None and self.num_layers % self.gated_delta.interval):
            raise UnsupportedModelError("a qwen3_5 config needs its GatedDeltaNetConfig, with whole groups of "
                                        "linear layers and an attention layer, and only it has one")
        if self.nope_layers and len(self.nope_layers) != self.num_layers:
            raise UnsupportedModelError(f"nope_layers must flag each of the {self.num_layers} layers, "
                                        f"got {len(self.nope_layers)}")
        if self.local_attention and (len(self.local_attention) != self.num_layers or any(
                len(lw) != 2 or min(lw) < 0 for lw in self.local_attention)):
            raise UnsupportedModelError(
                f"local_attention must give (chunk, window) >= 0 for each of the {self.num_layers} layers, "
                f"got {self.local_attention!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**{**d["rope_scaling"], **{
                k: tuple(d["rope_scaling"].get(k, ())) for k in ("freq_factors", "short_factors")}})
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        if d.get("rope_freq_factors") is not None:
            d["rope_freq_factors"] = tuple(d["rope_freq_factors"])
        d["local_attention"] = tuple(tuple(lw) for lw in d.get("local_attention", ()))
        d["nope_layers"] = tuple(d.get("nope_layers", ()))
        if d.get("mla") is not None:
            d["mla"] = MLAConfig(**d["mla"])
        if d.get("deepseek_moe") is not None:
            d["deepseek_moe"] = DeepseekMoEConfig(**d["deepseek_moe"])
        if d.get("llama4") is not None:
            d["llama4"] = Llama4Config(**{**d["llama4"], "rope_layers": tuple(d["llama4"]["rope_layers"])})
        if d.get("gpt_oss") is not None:
            d["gpt_oss"] = GptOssConfig(**d["gpt_oss"])
        if d.get("gemma3") is not None:
            d["gemma3"] = Gemma3Config(**d["gemma3"])
        if d.get("gemma4") is not None:
            d["gemma4"] = Gemma4Config(**d["gemma4"])
        if d.get("glm4") is not None:
            d["glm4"] = Glm4Config(**d["glm4"])
        if d.get("gated_delta") is not None:
            d["gated_delta"] = GatedDeltaNetConfig(**d["gated_delta"])
        return cls(**d)

    def param_count(self) -> int:
        """Number of weights, counted from the shapes (embedding and head counted once if tied)."""
        if self.mla is not None:
            return _deepseek_param_count(self)
        if self.llama4 is not None:
            return _llama4_param_count(self)
        if self.gpt_oss is not None:
            return gpt_oss_param_count(self)
        if self.glm4 is not None:
            return _glm4_param_count(self)
        if self.gated_delta is not None:
            return _qwen3_5_param_count(self)
        if self.gemma4 is not None:  # its stacks' shapes as the model builds them, plus the layer scalars
            stacks = sum(math.prod(t.shape) for ts in gemma4_stacks(self).values() for t in ts)
            embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
            return stacks + embeddings + self.hidden_size
        e, hd = self.hidden_size, self.head_dim
        attn = e * hd * (2 * self.num_heads + 2 * self.num_kv_heads)
        if self.attention_bias:
            attn += hd * (self.num_heads + 2 * self.num_kv_heads)
        if self.is_moe:
            mlp = self.num_experts * 3 * e * self.moe_intermediate_size + e * self.num_experts
        else:
            mlp = 3 * e * self.intermediate_size
        norms = (4 if self.gemma3 else 2) * e + (2 * hd if self.qk_norm else 0)  # Gemma 3: sandwich norms
        head = 0 if self.tie_word_embeddings else self.vocab_size * e
        return self.num_layers * (attn + mlp + norms) + self.vocab_size * e + head + e


def _qwen3_5_param_count(cfg: ModelConfig) -> int:
    """Weights of the Qwen3.5 model (models/qwen3_5.py): attention layers with a gate per q value and q/k
    norms, Gated DeltaNet layers, a SwiGLU MLP and two norms in every layer."""
    g, e, hd = cfg.gated_delta, cfg.hidden_size, cfg.head_dim
    value = g.num_v_heads * g.v_head_dim
    attn = e * hd * (3 * cfg.num_heads + 2 * cfg.num_kv_heads) + 2 * hd
    linear = e * (g.conv_dim + value + 2 * g.num_v_heads) + g.conv_dim * g.conv_kernel + 2 * g.num_v_heads \
        + g.v_head_dim + value * e
    if cfg.is_moe:  # router, experts, shared expert and its gate
        per_layer = e * cfg.num_experts * (1 + 3 * cfg.moe_intermediate_size) + 3 * e * g.shared_expert_size + e + 2 * e
    else:
        per_layer = 3 * e * cfg.intermediate_size + 2 * e
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * e
    return (cfg.num_layers * per_layer + cfg.num_kv_layers * attn + cfg.num_linear_layers * linear
            + cfg.vocab_size * e + head + e)


def _deepseek_param_count(cfg: ModelConfig) -> int:
    """Weights of the DeepSeek-V3 model, counted from the config as HF's module tree holds them."""
    m, d, e, h = cfg.mla, cfg.deepseek_moe, cfg.hidden_size, cfg.num_heads
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    q = e * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * h * qk
    attn = q + e * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank \
        + m.kv_lora_rank * h * (m.qk_nope_head_dim + m.v_head_dim) + h * m.v_head_dim * e
    dense_mlp = 3 * e * cfg.intermediate_size
    f = cfg.moe_intermediate_size
    moe_mlp = cfg.num_experts * (3 * e * f + e + 1) + 3 * e * f * d.num_shared_experts
    n_moe = cfg.num_layers - d.first_k_dense_replace
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * e
    return (cfg.num_layers * (attn + 2 * e) + d.first_k_dense_replace * dense_mlp + n_moe * moe_mlp
            + cfg.vocab_size * e + head + e)


def _glm4_param_count(cfg: ModelConfig) -> int:
    """Weights of a GLM-4.5 (or MiniMax-M2) model as HF's Glm4MoeForCausalLM (MiniMaxM2ForCausalLM)
    holds them: GQA attention (q/k/v biases,
    q/k norms if any), a dense MLP on the first layers, the router with its bias, the routed and shared
    experts on the rest (multi-token-prediction layers, which HF skips too, not counted)."""
    e, hd, d = cfg.hidden_size, cfg.head_dim, cfg.deepseek_moe
    attn = e * hd * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 2 * e
    attn += hd * (cfg.num_heads + 2 * cfg.num_kv_heads) if cfg.attention_bias else 0
    if cfg.qk_norm:  # over a head, or over all heads at once (MiniMax-M2)
        attn += hd * (cfg.num_heads + cfg.num_kv_heads) if cfg.glm4.qk_norm_whole else 2 * hd
    f = cfg.moe_intermediate_size
    moe = cfg.num_experts * (3 * e * f + e + 1) + 3 * e * f * d.num_shared_experts
    n_moe = cfg.num_layers - d.first_k_dense_replace
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * e
    return (cfg.num_layers * attn + d.first_k_dense_replace * 3 * e * cfg.intermediate_size + n_moe * moe
            + cfg.vocab_size * e + head + e)


def _llama4_param_count(cfg: ModelConfig) -> int:
    """Weights of a Llama 4 text model: attention on every layer; a dense MLP, or the routed experts,
    router and shared expert; as HF's Llama4ForCausalLM holds them."""
    e, hd, f = cfg.hidden_size, cfg.head_dim, cfg.moe_intermediate_size
    moe = cfg.llama4.stack_sizes["moe"]
    attn = e * hd * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 2 * e  # q/k/v/o and the two norms
    moe_mlp = cfg.num_experts * 3 * e * f + e * cfg.num_experts + 3 * e * f
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * e
    return (cfg.num_layers * attn + moe * moe_mlp + (cfg.num_layers - moe) * 3 * e * cfg.intermediate_size
            + cfg.vocab_size * e + head + e)


def gpt_oss_param_count(cfg: ModelConfig, active: bool = False) -> int:
    """Weights of a gpt-oss model as HF's GptOssForCausalLM holds them (q/k/v/o with biases, sinks,
    router with bias, experts with biases, two norms a layer); `active`: those one token uses (its
    top-k experts, the router and the rest whole, the embedding row's share not counted)."""
    e, hd, f = cfg.hidden_size, cfg.head_dim, cfg.moe_intermediate_size
    attn = e * hd * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + hd * (cfg.num_heads + 2 * cfg.num_kv_heads) + e
    attn += cfg.num_heads  # sinks
    expert = e * 2 * f + 2 * f + f * e + e
    experts = cfg.num_experts_per_tok if active else cfg.num_experts
    layer = attn + e * cfg.num_experts + cfg.num_experts + experts * expert + 2 * e
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * e
    return cfg.num_layers * layer + (0 if active else cfg.vocab_size * e) + head + e


def served_rope(cfg: ModelConfig, max_model_len: int) -> ModelConfig:
    """`cfg` as an engine serving `max_model_len` tokens rotates, as vLLM chooses: LongRoPE's short
    factors (its attention factor kept) where no sequence outgrows the original context, else the
    long ones; any other RoPE as it is."""
    rs = cfg.rope_scaling
    if rs is None or not rs.short_factors or max_model_len > rs.original_max_position_embeddings:
        return cfg
    return dataclasses.replace(cfg, rope_scaling=dataclasses.replace(rs, freq_factors=rs.short_factors,
                                                                     short_factors=()))


def eos_ids(raw: Any) -> tuple[int, ...]:
    """An `eos_token_id` field (none, one id or a list) as ModelConfig keeps it."""
    if raw is None:
        return ()
    if isinstance(raw, (list, tuple)):
        return tuple(int(x) for x in raw)
    return (int(raw),)


class StackTensor(NamedTuple):
    """One stacked layer weight: its shape and logical axes, the memory plan's kind, and whether it is a
    projection (norms, scalars and routers keep the serving dtype)."""

    name: str
    shape: tuple[int, ...]
    axes: tuple[str, ...]
    kind: str
    matrix: bool


def gemma4_stacks(cfg: ModelConfig) -> dict[str, tuple[StackTensor, ...]]:
    """Gemma 4's two stacks (models/gemma4.py builds them, the memory plan counts them): "sliding" and
    "full" layers, each with its own kv heads and head_dim; q/k/v fused per kv head as models/llama.py's
    (a full layer with k_eq_v has q and k only), q/k norms, four sandwich norms and the layer scalar, the
    dense GELU MLP, and with experts the router (its scale over the hidden size and each expert's
    scale), the experts and the MoE block's three norms."""
    g4, e, hq, f = cfg.gemma4, cfg.hidden_size, cfg.num_heads, cfg.intermediate_size
    blocks = cfg.num_layers // g4.period
    out = {}
    for kind, n, hkv, d, parts in (("sliding", blocks * (g4.period - 1), g4.sliding_kv_heads, cfg.head_dim, 2),
                                   ("full", blocks, g4.global_kv_heads, g4.global_head_dim, 1 if g4.k_eq_v else 2)):
        norm = ("layers", "norm")
        t = [StackTensor("wqkv", (n, e, hkv, hq // hkv + parts, d), ("layers", "embed", "kv_heads", "qkv", "head_dim"),
                         "attention", True),
             StackTensor("wo", (n, hq, d, e), ("layers", "q_heads", "head_dim", "embed"), "attention", True),
             StackTensor("q_norm", (n, d), norm, "attention", False),
             StackTensor("k_norm", (n, d), norm, "attention", False),
             StackTensor("w_gate_up", (n, e, 2, f), ("layers", "embed", "gate_up", "mlp"), "shared", True),
             StackTensor("w_down", (n, f, e), ("layers", "mlp", "embed"), "shared", True),
             StackTensor("layer_scalar", (n, 1), norm, "shared", False)]
        t += [StackTensor(k, (n, e), norm, "attention" if "attn" in k else "shared", False)
              for k in ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm")]
        if cfg.is_moe:
            x, fm = cfg.num_experts, cfg.moe_intermediate_size
            t += [StackTensor("router", (n, e, x), ("layers", "embed", "router"), "shared", False),
                  StackTensor("router_scale", (n, e), norm, "shared", False),
                  StackTensor("expert_scale", (n, x), ("layers", "router"), "shared", False),
                  StackTensor("w_experts_gate_up", (n, x, e, 2, fm), ("layers", "experts", "embed", "gate_up", "mlp"),
                              "experts", True),
                  StackTensor("w_experts_down", (n, x, fm, e), ("layers", "experts", "mlp", "embed"), "experts", True)]
            t += [StackTensor(k, (n, e), norm, "shared", False)
                  for k in ("post_mlp_norm_1", "moe_norm", "post_moe_norm")]
        out[kind] = tuple(t)
    return out
