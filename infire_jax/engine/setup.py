"""An engine's construction, up to a runner ready to step: the settings (`EngineConfig`) checked
against the model's config before any weight is read, the runner's settings, the weights loaded and
placed, the step programs compiled (on another thread while the weights are read, when the KV
pool's size is known in advance), the pool sized, and an fp8 pool's scales. `Engine.__init__`
(engine.py) builds the host side around what this returns.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import os
import threading
import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from infire_jax.runner import multihost
from infire_jax.runner.buckets import Buckets, default_token_buckets
from infire_jax.engine.stats import timed
from infire_jax.errors import ConfigError
from infire_jax.core.kv_groups import KVGroupLayout
from infire_jax.runner.kv_pool import PoolPlanner, PoolSizing
from infire_jax.runner.kv_scales import CALIBRATION_TEXT, calibrate, resolve_kv_cache_dtype
from infire_jax.loaders.weights import LoadedModel
from infire_jax.loaders.kv_scales_hf import read_kv_scales
from infire_jax.loaders.load import load_config, load_placed, load_quantized_placed, load_resident_placed
from infire_jax.loaders.paths import cache_dir
from infire_jax.loaders.pooler import declared_pooler
from infire_jax.loaders.weights import Placed, rotating_as
from infire_jax.lora.config import LoRAConfig
from infire_jax.models.config import ModelConfig, served_rope
from infire_jax.models.gated_delta import default_snapshots
from infire_jax.models.registry import abstract_state
from infire_jax.pooling.config import PoolerConfig
from infire_jax.runner.model_runner import ModelRunner
from infire_jax.runner.config import RunnerConfig
from infire_jax.sample.sampler import BRANCH_FREE_VARIANTS, BRANCHING
from infire_jax.sample.sampling_params import MAX_LOGPROBS
from infire_jax.speculative.config import SpeculativeConfig
from infire_jax.speculative.head_proposer import DraftHead
from infire_jax.speculative.setup import extra_page_bytes, parse_speculation
from infire_jax.loaders.tokenizer import Tokenizer
from infire_jax.loaders.vision import load_vision_config, vision_hf_config
from infire_jax.loaders.vllm_quantization import weights_quantization_of
from infire_jax.vision.encoder import IMAGE_POOL_PROMPTS
from infire_jax.vision.towers import TowerConfig, device_bytes, pool_rows
from pallas_kernels.attention import choose_impl, resolve_impl
from pallas_kernels.kv_quant import is_fp8
from pallas_kernels import placement
from pallas_kernels.mla import choose_mla_impl
from pallas_kernels.triton_backend import check_fp8_device
from sharding.mesh import MeshConfig, load_mesh_config
from sharding.plan import ShardPlan

log = logging.getLogger(__name__)

_DTYPES = {"float32": jnp.float32, "fp32": jnp.float32, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16}

# (stage, done, total): "load" and "compile" progress, for a progress bar.
Progress = Callable[[str, int, int], None]


@dataclasses.dataclass
class EngineConfig:
    """Engine settings. None means: derive a default from the model and the device."""

    model: str | None = None
    dtype: str = "auto"  # float32 on CPU, bfloat16 on GPU
    # default: min(model's context, 8192); -1 or "auto" (vLLM's): the model's context, capped to what one
    # sequence has of a pool sized in advance (num_kv_pages, kv_cache_memory, CPU's default budget)
    max_model_len: int | str | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # token budget of one step; default the last bucket, else 512 on
    # CPU, 8192 on GPU
    token_buckets: tuple[int, ...] | None = None  # the step sizes compiled; default powers of two up to the budget
    page_size: int = 16
    num_kv_pages: int | None = None  # overrides the two below
    kv_cache_memory: int | None = None  # bytes per device; default: sized by gpu_memory_utilization, 1 GiB on CPU
    gpu_memory_utilization: float = 0.90  # of each GPU: weights + activations + KV pool (kv_pool.py)
    enable_prefix_caching: bool = True
    # Models with linear-attention layers (Qwen3.5): copies of a slot's state kept on the device for the
    # prefix cache (core/state_cache.py), each as large as a request slot's state. None: min(16, max_num_seqs);
    # 0 turns the prefix cache off for such models.
    linear_state_snapshots: int | None = None
    attn_impl: str = "auto"
    # The KV pool's dtype: "auto" (the model's), bfloat16, float32 or float8_e4m3 (aliases fp8, fp8_e4m3):
    # fp8 pages with per-(layer, kv head) scales hold twice the tokens of bfloat16 (kv_scales.py).
    kv_cache_dtype: str = "auto"
    # An fp8 pool's scales are the checkpoint's `k_scale` / `v_scale` where it has them; True calibrates anyway.
    calibrate_kv_scales: bool = False
    # A mesh-config YAML, or a MeshConfig (vLLM's -tp/-pp flags, mesh.parallel_config); default: the shipped
    # file for jax.device_count()
    mesh: str | MeshConfig | None = None
    seed: int = 0
    branch_free_sampler: bool | None = None  # default: on GPU (see sample/sampler.py), off on CPU
    weights_compression: str | None = None  # "palette[:mlp,attn]": kept compressed on the device (compression/)
    # Kept quantized on the device (quant/): "gguf" (a GGUF's Q4_1/Q8_0 blocks), "int8" or "fp8" (any model,
    # at load, a scale per output channel), "int4" (any Llama-family model at load, round to nearest in the
    # AWQ / GPTQ form; a dummy: model's drawn) or "checkpoint" (a published GPTQ / AWQ / 8-bit / DeepSeek-V3 /
    # Kimi / gpt-oss checkpoint's own int4, fp8, int8 or MXFP4 weights)
    weights_quantization: str | None = None
    # vLLM's `quantization` (the checkpoint's method, "fp8" at load on a float model, "gguf"): sets
    # weights_quantization from the model's config at construction (loaders/vllm_quantization.py).
    quantization: str | None = None
    # "int4": inputs per scale and zero point, 32 or 128 (None: 128); refused with any other mode.
    int4_group_size: int | None = None
    # Speculative decoding, vLLM's `speculative_config`: a SpeculativeConfig, a dict or a JSON string.
    speculative_config: SpeculativeConfig | dict | str | None = None
    grammar_compile_timeout: float = 10.0  # seconds a structured-output grammar may take to compile
    # vLLM's sampling defaults from the model's generation_config.json (sample/generation_config.py):
    # "auto" (the model folder's), "vllm" (none) or a folder; override_generation_config (a dict or its
    # JSON) is laid over them.
    generation_config: str = "auto"
    override_generation_config: dict | str | None = None
    # Decode bursts: up to this many decode steps in one device launch when a step is decodes alone
    # and nobody waiting could join (scheduler.py); 1 turns them off. Not with speculative decoding.
    num_decode_steps: int = 4
    # Prompt logprobs: the most top alternatives a prompt position may ask for (vLLM's max_logprobs).
    max_prompt_logprobs: int = 20
    # Sampled logprobs: the most a request may ask for (vLLM's max_logprobs; never above MAX_LOGPROBS, the
    # top-k the sampler computes).
    max_logprobs: int = 20
    # Hot standby (residency.py): the weight bytes a pool sized from device memory leaves room for,
    # when more than the model's own (the heaviest models that may be resident with it).
    pool_weight_bytes: int = 0
    # LoRA adapters (infire_jax/lora/), vLLM's flags: adapters in device slots at once, their largest
    # rank, and loaded adapters kept in host memory (None: max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    # Images (Llama 4 and Gemma 3 checkpoints with a vision tower): vLLM's limit_mm_per_prompt, {"image": N}
    # images a prompt may carry (None: 1; 0 leaves the tower unloaded). The device holds the encoder outputs of
    # IMAGE_POOL_PROMPTS such prompts' images at once (runner/image_pool.py).
    limit_mm_per_prompt: dict[str, int] | None = None

    # vLLM's `--runner`: "pooling" also serves embeddings (infire_jax/pooling/: a pooling program per
    # bucket), pooled as `pooler_config` says (a PoolerConfig, a dict or its JSON) over what the checkpoint
    # declares (loaders/pooler.py); such an engine still generates.
    runner: str = "generate"
    pooler_config: PoolerConfig | dict | str | None = None

    # A model with chunked or sliding-window layers keeps only the pages those layers still see
    # (core/kv_groups.py, core/hybrid_kv_cache.py); False keeps every page of every layer in one group (the
    # kernels mask the same way): for comparisons and tests.
    hybrid_kv_cache: bool = True

    def __post_init__(self):
        if self.quantization is None:
            return
        mode = weights_quantization_of(self.model, self.quantization)
        if self.weights_quantization not in (None, mode):
            raise ConfigError(f"quantization={self.quantization!r} means weights_quantization={mode!r} for "
                              f"{self.model or 'the default model'}, not {self.weights_quantization!r}; set one")
        self.weights_quantization = mode

    @property
    def images_per_prompt(self) -> int:
        limits = dict(self.limit_mm_per_prompt or {})
        unknown = sorted(set(limits) - {"image"})
        if unknown or any(not isinstance(v, int) or v < 0 for v in limits.values()):
            raise ConfigError(f"limit_mm_per_prompt={self.limit_mm_per_prompt!r}: only {{'image': N}}, N >= 0")
        return limits.get("image", 1)

    @property
    def lora(self) -> LoRAConfig | None:
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras) if self.enable_lora else None


def enable_compilation_cache() -> None:
    """Keeps compiled steps on disk (under the cache dir), so a second start skips XLA compilation."""
    if jax.config.jax_compilation_cache_dir is None and not os.environ.get("INFIRE_JAX_NO_COMPILE_CACHE"):
        jax.config.update("jax_compilation_cache_dir", os.path.join(cache_dir(), "xla"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # every step: a warm start compiles nothing


def on_gpu() -> bool:
    """Whether the engine builds for a GPU: this machine's, or the target being compiled for
    (`placement.compiling_for`), whose defaults (dtype, step budget, sampler) it then takes."""
    return placement.platform() == "gpu"


def resolve_dtype(name: str):
    if name == "auto":
        return jnp.bfloat16 if on_gpu() else jnp.float32
    if name not in _DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; choose auto, float32 or bfloat16")
    return _DTYPES[name]


# max_model_len's spellings of "the model's context, as much as fits" (vLLM's -1 and auto).
AUTO_MODEL_LEN = (-1, "auto")


class Settings(NamedTuple):
    """What an EngineConfig comes to for its model, all known before any weight is read."""

    dtype: DTypeLike  # of the weights and activations: jnp.float32 or jnp.bfloat16
    kv_dtype: jnp.dtype  # of the KV pool
    model_config: ModelConfig  # the checkpoint's (the loaded model brings its own)
    plan: ShardPlan | None  # None: one device
    placed_config: ModelConfig  # what the runner runs: on a mesh, the plan's effective config
    max_model_len: int
    max_num_batched_tokens: int  # the token budget of one step
    spec_config: SpeculativeConfig | None
    draft_head: DraftHead | None  # EAGLE-3's or MTP's, on the device
    kv_groups: KVGroupLayout | None  # a hybrid KV cache's layer groups; None: one group, every page kept
    pool: PoolPlanner
    sizing: PoolSizing | None  # the pool's size where it is known before the weights are on the device
    runner_config: RunnerConfig  # the pool at its final size if `sizing`, else at its least
    checkpoint_kv_scales: np.ndarray | None  # an fp8 pool's scales as the checkpoint carries them
    vision: TowerConfig | None = None  # the checkpoint's vision tower, served (None: text only)
    pooler: PoolerConfig | None = None  # how embeddings are pooled (None: the engine serves none)


def _pooler(ec: EngineConfig) -> PoolerConfig | None:
    """The embeddings' pooling, with `runner="pooling"` (on one process: followers would need the
    pooling program's launches too)."""
    if ec.runner not in ("generate", "pooling"):
        raise ConfigError(f"runner must be 'generate' or 'pooling', got {ec.runner!r}")
    if ec.runner == "generate":
        if ec.pooler_config is not None:
            raise ConfigError("pooler_config applies to runner='pooling' (embeddings) only")
        return None
    if multihost.is_multiprocess():
        raise ConfigError("runner='pooling' (embeddings) is not supported across several processes yet")
    return PoolerConfig.parse(ec.pooler_config, declared_pooler(ec.model))


def _vision(ec: EngineConfig, plan: ShardPlan | None) -> TowerConfig | None:
    """The vision tower to serve: a Llama 4 HF directory's or dummy's, or a Gemma 3 HF directory's
    (vision/towers.py), unless images are limited to 0, whatever form the text weights are kept in (the
    tower is read apart, dequantized where the checkpoint quantized it: loaders/vision.py). On a mesh the
    tower and the image pool are replicated (engine.py). Not across processes: an image is encoded where
    its request is added, on process 0 alone, and the others would not join the program."""
    hf = vision_hf_config(ec.model) if ec.images_per_prompt and ec.model else None
    if hf is None:
        return None
    if multihost.is_multiprocess():
        raise ConfigError(f"{ec.model}: images are not served on a mesh over several processes (the vision "
                          "tower runs where a request is added, on process 0 alone); "
                          "limit_mm_per_prompt={'image': 0} serves text")
    return load_vision_config(ec.model, hf)


def resolve_settings(ec: EngineConfig, loaded: LoadedModel | None) -> Settings:
    """Checks `ec` against the model's config and fixes everything the weights do not decide; switches
    the compilation cache on before anything (a draft head's loading included) compiles."""
    dtype = resolve_dtype(ec.dtype)
    kv_dtype = resolve_kv_cache_dtype(ec.kv_cache_dtype, dtype)
    cfg = loaded.config if loaded else load_config(ec.model)
    plan = _check_settings(ec, cfg)
    if cfg.gemma4 is not None and is_fp8(kv_dtype):  # its layers view the pool two ways
        raise ConfigError(f"Gemma 4 runs with a bfloat16 or float32 KV cache; kv_cache_dtype {ec.kv_cache_dtype} "
                          "is not supported for it yet")
    # Read before the weights, so that malformed scales fail fast (loaders/kv_scales_hf.py).
    checkpoint_kv_scales = (read_kv_scales(ec.model, cfg) if is_fp8(kv_dtype) and not ec.calibrate_kv_scales
                            else None)
    enable_compilation_cache()
    auto_len = ec.max_model_len in AUTO_MODEL_LEN
    max_model_len = cfg.max_position_embeddings if auto_len else ec.max_model_len or min(cfg.max_position_embeddings,
                                                                                         8192)
    budget = ec.max_num_batched_tokens or (ec.token_buckets[-1] if ec.token_buckets else 8192 if on_gpu() else 512)
    branch_free = ec.branch_free_sampler if ec.branch_free_sampler is not None else on_gpu()
    placed = plan.effective_config(cfg) if plan else cfg  # on a pipeline: the stacked slots, stage by stage
    layout = KVGroupLayout.of(placed.local_attention, placed.num_layers, hybrid=ec.hybrid_kv_cache,
                              stages=plan.num_stages if plan else 1)
    kv_groups = layout if layout.bounded else None
    spec_config, draft_head = parse_speculation(
        ec.speculative_config, cfg, model=ec.model, dtype=dtype, multiprocess=multihost.is_multiprocess(),
        plan=plan, compressed=bool(ec.weights_compression), kv_groups=kv_groups)
    pool = PoolPlanner(
        PoolPlanner.page_bytes_of(cfg, plan, ec.page_size, kv_dtype,
                                  extra_page_bytes(spec_config, draft_head, ec.page_size, dtype, plan), kv_groups),
        ec.page_size, max_model_len, ec.num_kv_pages, ec.kv_cache_memory, ec.gpu_memory_utilization,
        kv_groups, budget, plan.mesh_config.num_devices if plan else 1)
    if auto_len:
        pool = pool.fitted()
        max_model_len = pool.max_model_len
    cfg = served_rope(cfg, max_model_len)  # LongRoPE's factors for this context (the pool's pages do not care)
    placed = plan.effective_config(cfg) if plan else cfg
    sizing = pool.fixed()
    vision, pooler = _vision(ec, plan), _pooler(ec)
    rc = RunnerConfig(page_size=ec.page_size, num_pages=sizing.num_pages if sizing else pool.min_pages,
                      max_model_len=max_model_len, max_num_seqs=ec.max_num_seqs,
                      buckets=_buckets(ec, budget), attn_impl=_attention(ec, cfg, dtype, kv_dtype),
                      sampler_variants=BRANCH_FREE_VARIANTS if branch_free else (BRANCHING,),
                      num_spec=spec_config.num_speculative_tokens if spec_config else 0,
                      aux_layers=draft_head.aux_layers(cfg.num_layers) if draft_head else None,
                      decode_steps=1 if spec_config else ec.num_decode_steps,
                      kv_cache_dtype=kv_dtype.name, kv_groups=kv_groups, lora=ec.lora,
                      max_prompt_logprobs=ec.max_prompt_logprobs,
                      image_pool=None if vision is None else (
                          pool_rows(vision, IMAGE_POOL_PROMPTS * ec.images_per_prompt), vision.text_hidden_size),
                      pooling=pooler is not None, linear_snapshots=linear_state_snapshots(ec, cfg))
    return Settings(dtype, kv_dtype, cfg, plan, placed, max_model_len, budget,
                    spec_config, draft_head, kv_groups, pool, sizing, rc, checkpoint_kv_scales, vision, pooler)


def _check_settings(ec: EngineConfig, cfg: ModelConfig) -> ShardPlan | None:
    """Everything that can be checked from the config alone, before any weight is read."""
    if ec.max_num_seqs < 1 or ec.page_size < 1 or ec.num_decode_steps < 1:
        raise ConfigError("max_num_seqs, page_size and num_decode_steps must be positive")
    for name in ("max_model_len", "max_num_batched_tokens", "num_kv_pages"):
        value = getattr(ec, name)
        if name == "max_model_len" and value in AUTO_MODEL_LEN:
            continue
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    if ec.max_prompt_logprobs < 0:
        raise ConfigError(f"max_prompt_logprobs must be >= 0, got {ec.max_prompt_logprobs}")
    if not 0 <= ec.max_logprobs <= MAX_LOGPROBS:
        raise ConfigError(f"max_logprobs must be in [0, {MAX_LOGPROBS}] (the sampler's top-{MAX_LOGPROBS}), "
                          f"got {ec.max_logprobs}")
    if not 0.0 < ec.gpu_memory_utilization <= 1.0:
        raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {ec.gpu_memory_utilization}")
    if ec.int4_group_size is not None and ec.weights_quantization != "int4":
        raise ConfigError(f"int4_group_size sets weights_quantization='int4''s groups; weights_quantization is "
                          f"{ec.weights_quantization!r}")
    if ec.lora is not None:
        ec.lora.check(cfg, multiprocess=multihost.is_multiprocess())
    try:
        resolve_impl(ec.attn_impl)
        devices = placement.devices()
        mesh_config = load_mesh_config(ec.mesh, len(devices))
    except ValueError as e:  # unknown attention name, MeshConfigError
        raise ConfigError(str(e)) from e
    if cfg.gated_delta is not None:
        _check_linear_state(ec)
    try:
        return ShardPlan.create(cfg, mesh_config, devices) if mesh_config.num_devices > 1 else None
    except ValueError as e:
        raise ConfigError(str(e)) from e


def _check_linear_state(ec: EngineConfig) -> None:
    """A model with linear-attention layers (Qwen3.5) keeps each sequence's state in its slot, advanced once
    per token: nothing that skips tokens by reusing pages serves it yet; nor do weights kept in a GGUF
    file's format (those quantized at load, and a checkpoint's 8-bit ones, are). An fp8 pool is served (it
    holds the attention layers' keys and values alone), and so are n-gram and MTP proposals: a verifying
    step's state advances over the tokens the verifier keeps (step_programs.commit_linear_state)."""
    sc = SpeculativeConfig.parse(ec.speculative_config)
    if sc is not None and sc.method not in ("ngram", "mtp"):
        raise ConfigError(f"speculative_config.method {sc.method!r} is not supported for Qwen3.5 "
                          "(linear-attention layers) yet: use ngram or mtp")
    served = ec.weights_quantization != "gguf"  # at load, or an 8-bit checkpoint's (loaders/kept_8bit.py)
    refused = {"weights_quantization": None if served else ec.weights_quantization,
               "weights_compression": ec.weights_compression}
    for name, value in refused.items():
        if value:
            raise ConfigError(f"{name}={value!r} is not supported for Qwen3.5 (linear-attention layers) yet")
    if multihost.is_multiprocess():
        raise ConfigError("Qwen3.5 (linear-attention layers) runs on one host's devices yet, not across "
                          "jax.distributed processes")


def linear_state_snapshots(ec: EngineConfig, cfg: ModelConfig) -> int:
    """Linear-state snapshots the device keeps for the prefix cache: none without linear-attention layers
    or prefix caching, else as asked (default min(16, max_num_seqs))."""
    if cfg.gated_delta is None or not ec.enable_prefix_caching:
        return 0
    n = default_snapshots(ec.max_num_seqs) if ec.linear_state_snapshots is None else ec.linear_state_snapshots
    if n < 0:
        raise ConfigError(f"linear_state_snapshots must be 0 or more, got {n}")
    return n


def prefix_caching(ec: EngineConfig, cfg: ModelConfig) -> bool:
    """Whether the prefix cache runs: as asked; for a model with linear-attention layers, only with
    snapshots of their state to resume a hit from (core/state_cache.py)."""
    if ec.enable_prefix_caching and cfg.gated_delta is not None and not linear_state_snapshots(ec, cfg):
        log.info("prefix caching is off: %s keeps no linear-attention state for cached pages "
                 "(linear_state_snapshots=0)", cfg.architecture)
        return False
    return ec.enable_prefix_caching


def _attention(ec: EngineConfig, cfg: ModelConfig, dtype, kv_dtype) -> str:
    try:
        if cfg.mla is not None:
            impl = choose_mla_impl(ec.attn_impl, kv_lora_rank=cfg.mla.kv_lora_rank,
                                   rope_dim=cfg.mla.qk_rope_head_dim, dtype=dtype)
        else:
            impl = choose_impl(ec.attn_impl, head_dim=cfg.head_dim, num_q_heads=cfg.num_heads,
                               num_kv_heads=cfg.num_kv_heads, dtype=dtype)
        if impl == "pallas" and is_fp8(kv_dtype):
            check_fp8_device()
        return impl
    except ValueError as e:
        raise ConfigError(str(e)) from e


def _buckets(ec: EngineConfig, budget: int) -> Buckets:
    try:  # their order first: out-of-order buckets would also make the budget (their last) look wrong
        buckets = Buckets(tuple(ec.token_buckets or default_token_buckets(budget)), ec.max_num_seqs)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if budget < ec.max_num_seqs:
        raise ConfigError(f"max_num_batched_tokens ({budget}) must be >= max_num_seqs ({ec.max_num_seqs})")
    if buckets.token_buckets[-1] != budget:
        raise ConfigError(f"the largest token bucket must equal max_num_batched_tokens ({budget})")
    return buckets


class Built(NamedTuple):
    """The model on the device, its steps compiled and its pool allocated."""

    runner: ModelRunner
    placed: Placed  # the loaded model (config, tokenizer, name) with its placed weights
    sizing: PoolSizing
    load_seconds: float
    warmup_seconds: float
    overlapped: bool  # the steps compiled while the weights were read


def load_and_compile(ec: EngineConfig, s: Settings, loaded: LoadedModel | None, report: Progress) -> Built:
    """Loads and places the weights, builds the runner and compiles every step bucket, sizes the pool
    (from the device's free memory once the weights are on it, unless known before) and sets an fp8
    pool's scales."""
    rc, sizing = s.runner_config, s.sizing
    shapes = rc.buckets.shapes
    done = itertools.count(1)
    # Compiling needs only the weights' shapes: with a pool fixed in advance, one process and
    # uncompressed weights, another thread allocates the KV pool and compiles (or loads) the
    # steps while the weights are read.
    # What the executable cache lacks compiles once the weights are read (executable_cache.py).
    warmup, weights_read = None, threading.Event()
    if sizing is not None and not (ec.weights_compression or ec.weights_quantization) \
            and not multihost.is_multiprocess():
        def build_and_warm_up() -> tuple[ModelRunner, float]:
            runner = ModelRunner(s.placed_config, *abstract_state(s.model_config, s.dtype, s.plan), rc,
                                 dtype=s.dtype, plan=s.plan)
            return runner, timed(runner.warmup, lambda shape: report("compile", next(done), len(shapes)),
                                 weights_read.wait)

        report("compile", 0, len(shapes))
        pool = concurrent.futures.ThreadPoolExecutor(1, "infire-warmup")
        warmup = pool.submit(build_and_warm_up)
        pool.shutdown(wait=False)  # its thread ends with the warmup

    report("load", 0, 1)
    t_load = time.monotonic()
    try:
        placed = rotating_as(_load_placed(ec, s.dtype, s.plan, loaded), s.model_config.rope_scaling)
    finally:
        weights_read.set()
    jax.block_until_ready(placed.state)
    load_seconds = time.monotonic() - t_load
    report("load", 1, 1)

    if warmup is not None:
        runner, warmup_seconds = warmup.result()  # re-raises what the warmup raised
        runner.attach_weights(placed.state)
    else:
        t_warmup = time.monotonic()
        runner = ModelRunner(s.placed_config, placed.graphdef, placed.state, rc, dtype=s.dtype, plan=s.plan)
        # Fill the card: measure the largest step's activations with a minimal pool, then compile
        # before the pool takes its memory (XLA's autotuning needs room; one process only: the
        # followers' warmup runs a step on the pool).
        deferred = sizing is None and not multihost.is_multiprocess()
        if sizing is None:
            # The vision tower is placed after the pool (engine.py), and encodes while a step may run.
            tower, encoding = (0, 0) if s.vision is None else \
                device_bytes(s.vision, s.dtype, s.plan.replicated if s.plan else None)
            sizing = s.pool.from_device_memory(runner.state, (runner.cache.k_pages, runner.cache.v_pages),
                                               runner.peak_activation_bytes() + encoding, ec.pool_weight_bytes,
                                               tower)
            runner.resize_pool(sizing.num_pages, allocate=not deferred)
        report("compile", 0, len(shapes))
        runner.warmup(lambda shape: report("compile", next(done), len(shapes)))
        if deferred:
            runner.allocate_pool()
        warmup_seconds = time.monotonic() - t_warmup
    if runner.kv_scales is not None:
        runner.set_kv_scales(_kv_scales(ec, s, runner, placed.loaded.tokenizer))
    return Built(runner, placed, sizing, load_seconds, warmup_seconds, warmup is not None)


def _load_placed(ec: EngineConfig, dtype, plan: ShardPlan | None, loaded: LoadedModel | None) -> Placed:
    """The weights on the devices: plain, palette-compressed or kept quantized."""
    if ec.weights_quantization:
        if ec.weights_compression or loaded is not None:
            raise ConfigError("weights_quantization reads the model itself: it combines with neither "
                              "weights_compression nor a preloaded model")
        return load_quantized_placed(ec.model, dtype, plan, ec.weights_quantization, ec.int4_group_size)
    if ec.weights_compression:
        return load_resident_placed(ec.model, dtype, plan, ec.weights_compression, loaded=loaded)
    return load_placed(ec.model, dtype, plan, loaded=loaded)


def _kv_scales(ec: EngineConfig, s: Settings, runner: ModelRunner, tokenizer: Tokenizer) -> np.ndarray:
    """An fp8 pool's scales: the checkpoint's own `k_scale` / `v_scale` where it carries them
    (loaders/kv_scales_hf.py), else calibrated on the loaded model (kv_scales.py)."""
    if s.checkpoint_kv_scales is not None:
        log.info("fp8 KV cache: scales from the checkpoint's k_scale / v_scale tensors (%s)", ec.model)
        scales = s.checkpoint_kv_scales
        return scales if s.plan is None else s.plan.prepare_kv_scales(scales)
    log.info("fp8 KV cache: scales calibrated on a fixed text (%s)",
             "calibrate_kv_scales set" if ec.calibrate_kv_scales else "the checkpoint carries none")
    return calibrate(runner.graphdef, runner.state, s.placed_config, tokenizer.encode(CALIBRATION_TEXT), s.plan)
