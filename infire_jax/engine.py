"""The engine: requests in, per-step deltas out. Owns the scheduler, the KV manager and the runner.

Each `step()` plans and dispatches step N+1 on the device, then reads back step N's tokens and
turns them into text while the device computes. A front end (the offline `LLM`, the async server
engine) only calls `add_request`, `abort` and `step`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import os
import random
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp

from infire_jax import multihost
from infire_jax.buckets import Buckets, default_token_buckets
from infire_jax.compile_guard import cache_hit_count, compile_count
from infire_jax.detokenizer import IncrementalDetokenizer
from infire_jax.engine_stats import BootTimeline, EngineStats, timed
from infire_jax.errors import ConfigError, InvalidRequestError
from infire_jax.kv_cache import KVCacheManager
from infire_jax.kv_pool import PoolPlanner, PoolSizing
from infire_jax.kv_scales import CALIBRATION_TEXT, calibrate, resolve_kv_cache_dtype
from infire_jax.kv_transfer import KVBlocks, KVLayout
from infire_jax.loaders import LoadedModel
from infire_jax.loaders.kv_scales_hf import read_kv_scales
from infire_jax.loaders.load import load_config, load_placed, load_quantized_placed, load_resident_placed
from infire_jax.loaders.paths import cache_dir
from infire_jax.models.config import ModelConfig
from infire_jax.models.kv_entry import kv_entry
from infire_jax.models.registry import abstract_state
from infire_jax.outputs import Delta
from infire_jax.request import Request, Status
from infire_jax.runner import ModelRunner, PendingStep, RunnerConfig
from infire_jax.sampler import BRANCH_FREE_VARIANTS, BRANCHING
from infire_jax.sampling_params import MAX_STOP_TOKEN_IDS, SamplingParams
from infire_jax.scheduler import Scheduler
from infire_jax.speculative.config import SpeculativeConfig
from infire_jax.speculative.setup import build_speculation, extra_page_bytes, parse_speculation
from infire_jax.structured.backend import CompiledGrammar, GrammarBackend
from pallas_kernels.attention import choose_impl, resolve_impl
from pallas_kernels.kv_quant import is_fp8
from pallas_kernels.mla import choose_mla_impl
from pallas_kernels.triton_backend import check_fp8_device
from sharding.mesh import load_mesh_config
from sharding.plan import ShardPlan

log = logging.getLogger(__name__)

_DTYPES = {"float32": jnp.float32, "fp32": jnp.float32, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16}


@dataclasses.dataclass
class EngineConfig:
    """Engine settings. None means: derive a default from the model and the device."""

    model: str | None = None
    dtype: str = "auto"  # float32 on CPU, bfloat16 on GPU
    max_model_len: int | None = None  # default: min(model's context, 8192)
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # token budget of one step; default 512 on CPU, 8192 on GPU
    token_buckets: tuple[int, ...] | None = None
    page_size: int = 16
    num_kv_pages: int | None = None  # overrides the two below
    kv_cache_memory: int | None = None  # bytes per device; default: sized by gpu_memory_utilization, 1 GiB on CPU
    gpu_memory_utilization: float = 0.90  # of each GPU: weights + activations + KV pool (kv_pool.py)
    enable_prefix_caching: bool = True
    attn_impl: str = "auto"
    # The KV pool's dtype: "auto" (the model's), bfloat16, float32 or float8_e4m3 (aliases fp8, fp8_e4m3):
    # fp8 pages with per-(layer, kv head) scales hold twice the tokens of bfloat16 (kv_scales.py).
    kv_cache_dtype: str = "auto"
    # An fp8 pool's scales are the checkpoint's `k_scale` / `v_scale` where it has them; True calibrates anyway.
    calibrate_kv_scales: bool = False
    mesh: str | None = None  # mesh-config YAML; default: the shipped file for jax.device_count()
    seed: int = 0
    branch_free_sampler: bool | None = None  # default: on GPU (see sampler.py), off on CPU
    weights_compression: str | None = None  # "palette[:mlp,attn]": kept compressed on the device (compression/)
    # Kept quantized on the device (quant/): "gguf" (a GGUF's Q4_1/Q8_0 blocks), "int8" (any model, at load),
    # "int4" (a dummy: model drawn as AWQ / GPTQ-form int4) or
    # "checkpoint" (a published DeepSeek-V3/Kimi checkpoint's own int4 / fp8 weights)
    weights_quantization: str | None = None
    # Speculative decoding, vLLM's `speculative_config`: a SpeculativeConfig, a dict or a JSON string.
    speculative_config: SpeculativeConfig | dict | str | None = None
    grammar_compile_timeout: float = 10.0  # seconds a structured-output grammar may take to compile
    # Decode bursts: up to this many decode steps in one device launch when a step is decodes alone
    # and nobody waiting could join (scheduler.py); 1 turns them off. Not with speculative decoding.
    num_decode_steps: int = 4
    # Hot standby (residency.py): the weight bytes a pool sized from device memory leaves room for,
    # when more than the model's own (the heaviest models that may be resident with it).
    pool_weight_bytes: int = 0


def enable_compilation_cache() -> None:
    """Keeps compiled steps on disk (under the cache dir), so a second start skips XLA compilation."""
    if jax.config.jax_compilation_cache_dir is None and not os.environ.get("INFIRE_JAX_NO_COMPILE_CACHE"):
        jax.config.update("jax_compilation_cache_dir", os.path.join(cache_dir(), "xla"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # every step: a warm start compiles nothing


def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def resolve_dtype(name: str):
    if name == "auto":
        return jnp.bfloat16 if _on_gpu() else jnp.float32
    if name not in _DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; choose auto, float32 or bfloat16")
    return _DTYPES[name]


class Engine:
    def __init__(self, config: EngineConfig | None = None, *, loaded: LoadedModel | None = None,
                 progress: Callable[[str, int, int], None] | None = None):
        """Validates the settings, loads and places the model, and compiles every step bucket."""
        ec = self.config = config or EngineConfig()
        report = progress or (lambda stage, done, total: None)
        self.dtype = resolve_dtype(ec.dtype)
        self.kv_dtype = resolve_kv_cache_dtype(ec.kv_cache_dtype, self.dtype)
        cfg = self.model_config = loaded.config if loaded else load_config(ec.model)
        self.plan = self._check_settings(cfg)
        # Read before the weights, so that malformed scales fail fast (loaders/kv_scales_hf.py).
        self._checkpoint_kv_scales = (read_kv_scales(ec.model, cfg) if is_fp8(self.kv_dtype)
                                      and not ec.calibrate_kv_scales else None)
        enable_compilation_cache()
        self.max_model_len = ec.max_model_len or min(cfg.max_position_embeddings, 8192)
        budget = ec.max_num_batched_tokens or (8192 if _on_gpu() else 512)
        branch_free = ec.branch_free_sampler if ec.branch_free_sampler is not None else _on_gpu()
        self.spec_config, self.eagle_head = parse_speculation(
            ec.speculative_config, cfg, dtype=self.dtype, multiprocess=multihost.is_multiprocess(),
            one_plain_device=self.plan is None and not ec.weights_compression and not ec.weights_quantization)
        self.pool = PoolPlanner(
            PoolPlanner.page_bytes_of(cfg, self.plan, ec.page_size, self.kv_dtype,
                                      extra_page_bytes(self.spec_config, self.eagle_head, ec.page_size, self.dtype)),
            ec.page_size, self.max_model_len, ec.num_kv_pages, ec.kv_cache_memory, ec.gpu_memory_utilization)
        sizing = self.pool.fixed()
        rc = RunnerConfig(page_size=ec.page_size, num_pages=sizing.num_pages if sizing else self.pool.min_pages,
                          max_model_len=self.max_model_len, max_num_seqs=ec.max_num_seqs,
                          buckets=self._buckets(budget), attn_impl=self._attention(cfg),
                          sampler_variants=BRANCH_FREE_VARIANTS if branch_free else (BRANCHING,),
                          num_spec=self.spec_config.num_speculative_tokens if self.spec_config else 0,
                          aux_layers=self.eagle_head.cfg.aux_layers(cfg.num_layers) if self.eagle_head else None,
                          decode_steps=1 if self.spec_config else ec.num_decode_steps,
                          kv_cache_dtype=self.kv_dtype.name)
        placed_cfg = self.plan.effective_config(cfg) if self.plan else cfg
        shapes = rc.buckets.shapes
        done = itertools.count(1)
        t0, events, cached = time.monotonic(), compile_count(), cache_hit_count()
        # Compiling needs only the weights' shapes: with a pool fixed in advance, one process and
        # uncompressed weights, another thread allocates the KV pool and compiles (or loads) the
        # steps while the weights are read.
        # What the executable cache lacks compiles once the weights are read (executable_cache.py).
        warmup, weights_read = None, threading.Event()
        if sizing is not None and not (ec.weights_compression or ec.weights_quantization) \
                and not multihost.is_multiprocess():
            def build_and_warm_up() -> tuple[ModelRunner, float]:
                runner = ModelRunner(placed_cfg, *abstract_state(cfg, self.dtype, self.plan), rc, dtype=self.dtype,
                                     plan=self.plan)
                return runner, timed(runner.warmup, lambda shape: report("compile", next(done), len(shapes)),
                                     weights_read.wait)

            report("compile", 0, len(shapes))
            pool = concurrent.futures.ThreadPoolExecutor(1, "infire-warmup")
            warmup = pool.submit(build_and_warm_up)
            pool.shutdown(wait=False)  # its thread ends with the warmup

        report("load", 0, 1)
        t_load = time.monotonic()
        try:
            placed = self._load_placed(loaded)
        finally:
            weights_read.set()
        self.loaded, graphdef, state = placed.loaded, placed.graphdef, placed.state
        self.model_config = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        self.model_name = self.loaded.name
        jax.block_until_ready(state)
        self.load_seconds = time.monotonic() - t_load
        report("load", 1, 1)

        if warmup is not None:
            self.runner, self.warmup_seconds = warmup.result()  # re-raises what the warmup raised
            self.runner.attach_weights(state)
        else:
            t_warmup = time.monotonic()
            self.runner = ModelRunner(placed_cfg, graphdef, state, rc, dtype=self.dtype, plan=self.plan)
            # Fill the card: measure the largest step's activations with a minimal pool, then compile
            # before the pool takes its memory (XLA's autotuning needs room; one process only: the
            # followers' warmup runs a step on the pool).
            deferred = sizing is None and not multihost.is_multiprocess()
            if sizing is None:
                sizing = self.pool.from_device_memory(self.runner.state, (self.runner.cache.k_pages,
                                                                          self.runner.cache.v_pages),
                                                      self.runner.peak_activation_bytes(), ec.pool_weight_bytes)
                self.runner.resize_pool(sizing.num_pages, allocate=not deferred)
            report("compile", 0, len(shapes))
            self.runner.warmup(lambda shape: report("compile", next(done), len(shapes)))
            if deferred:
                self.runner.allocate_pool()
            self.warmup_seconds = time.monotonic() - t_warmup
        if self.runner.kv_scales is not None:
            self.runner.set_kv_scales(self._kv_scales(placed_cfg))
        # After the warmup: its token trie is built on a thread of its own, which would hold the GIL
        # against the warmup's (the first structured-output request waits for it instead).
        self.grammars = GrammarBackend(self.tokenizer.tk.to_str(), self.model_config.vocab_size,
                                       self.model_config.eos_token_ids, timeout=ec.grammar_compile_timeout)
        self.pool_sizing: PoolSizing = sizing
        log.info("%s", sizing.describe())
        rc = self.runner.rc
        self.kv = KVCacheManager(rc.num_pages, ec.page_size, enable_prefix_caching=ec.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, max_num_seqs=ec.max_num_seqs, max_num_batched_tokens=budget,
                                   num_decode_steps=rc.decode_steps)
        self.spec, self.draft = None, None
        if self.spec_config:
            self.spec, self.draft = build_speculation(self.spec_config, self.eagle_head, self.model_config,
                                                      self.runner, self.kv, max_num_seqs=ec.max_num_seqs,
                                                      dtype=self.dtype, on_gpu=_on_gpu())
        self.boot = BootTimeline(
            weight_bytes=self.runner.weight_bytes, load_seconds=self.load_seconds,
            restored=placed.built_because is None, compile_seconds=self.warmup_seconds, num_steps=len(shapes),
            compiled=compile_count() - events - (cache_hit_count() - cached),
            executables_loaded=self.runner.executables_loaded, cache_loaded=cache_hit_count() - cached,
            overlapped=warmup is not None, ready_seconds=time.monotonic() - t0)
        # Compilations inside step() after warmup: must stay 0 (buckets are fixed).
        self.compiles_since_warmup = 0

        self._rng = random.Random(ec.seed)
        self._ids = itertools.count()
        self._requests: dict[str, list[Request]] = {}
        self._inflight: PendingStep | None = None
        self.stats = EngineStats()

    # ---- set-up -----------------------------------------------------------------------------------
    def _check_settings(self, cfg: ModelConfig) -> ShardPlan | None:
        """Everything that can be checked from the config alone, before any weight is read."""
        ec = self.config
        if ec.max_num_seqs < 1 or ec.page_size < 1 or ec.num_decode_steps < 1:
            raise ConfigError("max_num_seqs, page_size and num_decode_steps must be positive")
        if not 0.0 < ec.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {ec.gpu_memory_utilization}")
        try:
            resolve_impl(ec.attn_impl)
            mesh_config = load_mesh_config(ec.mesh, jax.device_count())
            return ShardPlan.create(cfg, mesh_config) if mesh_config.num_devices > 1 else None
        except ValueError as e:  # unknown attention name, MeshConfigError
            raise ConfigError(str(e)) from e

    def _kv_scales(self, cfg: ModelConfig):
        """An fp8 pool's scales: the checkpoint's own `k_scale` / `v_scale` where it carries them
        (loaders/kv_scales_hf.py), else calibrated on the loaded model (kv_scales.py)."""
        ec = self.config
        if self._checkpoint_kv_scales is not None:
            log.info("fp8 KV cache: scales from the checkpoint's k_scale / v_scale tensors (%s)", ec.model)
            scales = self._checkpoint_kv_scales
            return scales if self.plan is None else self.plan.prepare_kv_scales(scales)
        log.info("fp8 KV cache: scales calibrated on a fixed text (%s)",
                 "calibrate_kv_scales set" if ec.calibrate_kv_scales else "the checkpoint carries none")
        return calibrate(self.runner.graphdef, self.runner.state, cfg, self.tokenizer.encode(CALIBRATION_TEXT),
                         self.plan)

    def _load_placed(self, loaded: LoadedModel | None):
        """The weights on the devices: plain, palette-compressed or kept quantized."""
        ec = self.config
        if ec.weights_quantization:
            if ec.weights_compression or loaded is not None:
                raise ConfigError("weights_quantization reads the model itself: it combines with neither "
                                  "weights_compression nor a preloaded model")
            return load_quantized_placed(ec.model, self.dtype, self.plan, ec.weights_quantization)
        if ec.weights_compression:
            return load_resident_placed(ec.model, self.dtype, self.plan, ec.weights_compression, loaded=loaded)
        return load_placed(ec.model, self.dtype, self.plan, loaded=loaded)

    def _attention(self, cfg: ModelConfig) -> str:
        try:
            if cfg.mla is not None:
                impl = choose_mla_impl(self.config.attn_impl, kv_lora_rank=cfg.mla.kv_lora_rank,
                                       rope_dim=cfg.mla.qk_rope_head_dim, dtype=self.dtype)
            else:
                impl = choose_impl(self.config.attn_impl, head_dim=cfg.head_dim, num_q_heads=cfg.num_heads,
                                   num_kv_heads=cfg.num_kv_heads, dtype=self.dtype)
            if impl == "pallas" and is_fp8(self.kv_dtype):
                check_fp8_device()
            return impl
        except ValueError as e:
            raise ConfigError(str(e)) from e

    def _buckets(self, budget: int) -> Buckets:
        ec = self.config
        if budget < ec.max_num_seqs:
            raise ConfigError(f"max_num_batched_tokens ({budget}) must be >= max_num_seqs ({ec.max_num_seqs})")
        buckets = Buckets(ec.token_buckets or default_token_buckets(budget), ec.max_num_seqs)
        if buckets.token_buckets[-1] != budget:
            raise ConfigError(f"the largest token bucket must equal max_num_batched_tokens ({budget})")
        return buckets

    # ---- requests ---------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty", param="prompt")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            if any(not isinstance(t, int) or isinstance(t, bool) for t in ids):
                raise InvalidRequestError("prompt token ids must be integers", param="prompt")
            bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise InvalidRequestError(f"prompt token id {bad[0]} is outside the vocabulary "
                                          f"[0, {self.model_config.vocab_size})", param="prompt")
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        return ids

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, priority: int = 0, tenant: str | None = None,
                    prefix_hint_tokens: int = 0, session_id: str | None = None,
                    grammar: CompiledGrammar | None = None) -> tuple[str, list[int]]:
        """Queues a prompt (text or token ids) for `params.n` samples; returns (request id, prompt ids).

        `grammar` is `params.structured_outputs` compiled already (the server compiles off this
        thread); without it the constraint is compiled here."""
        params = params or SamplingParams()
        ids = self.tokenize_prompt(prompt)
        if params.structured_outputs is not None:
            grammar = self._grammar(params, grammar)
        n_prompt = len(ids)
        if n_prompt >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {n_prompt} tokens, but max_model_len is {self.max_model_len}", param="prompt")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n_prompt
        if n_prompt + max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but {n_prompt + max_tokens} "
                f"were requested ({n_prompt} in the prompt, {max_tokens} to generate)", param="max_tokens")
        eos = () if params.ignore_eos else self.model_config.eos_token_ids
        stop_ids = tuple(dict.fromkeys((*eos, *params.stop_token_ids)))
        if params.min_tokens and len(stop_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(f"min_tokens supports at most {MAX_STOP_TOKEN_IDS} stop token ids "
                                      f"(eos included), got {len(stop_ids)}", param="stop_token_ids")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        children = []
        for i in range(params.n):
            seed = (params.seed + i) & (2 ** 64 - 1) if params.seed is not None else self._rng.getrandbits(64)
            req = Request(f"{request_id}#{i}", ids, params, eos_token_ids=eos, max_tokens=max_tokens, seed=seed,
                          priority=priority, cache_salt=tenant, prefix_hint_tokens=prefix_hint_tokens,
                          session_id=session_id, min_tokens_stop_ids=stop_ids, parent_id=request_id, index=i)
            req.detok = IncrementalDetokenizer(self.tokenizer, ids, params)
            req.grammar = grammar.matcher() if params.structured_outputs is not None else None
            req.spec_wait = self.spec is not None  # so its first decode step can already carry proposals
            children.append(req)
        self._requests[request_id] = children
        for req in children:
            self.scheduler.add(req)
        self.stats.prompt_tokens += n_prompt * params.n
        return request_id, ids

    def _grammar(self, params: SamplingParams, compiled: CompiledGrammar | None) -> CompiledGrammar:
        if multihost.is_multiprocess():  # followers would need each step's masks broadcast
            raise InvalidRequestError("structured outputs are not supported across several processes yet",
                                      param=params.structured_outputs.param)
        return compiled or self.grammars.compile(params.structured_outputs)

    def abort(self, request_id: str) -> None:
        """Stops a request and frees its pages now; later results for it are dropped."""
        for req in self._requests.pop(request_id, []):
            if not req.is_finished:
                self.scheduler.finish(req, Status.FINISHED_ABORTED)

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or self._inflight is not None

    # ---- the step ---------------------------------------------------------------------------------
    def step(self) -> list[Delta]:
        compiles, start = compile_count(), time.perf_counter()
        deltas = self._step()
        self.stats.step_seconds += time.perf_counter() - start
        self.compiles_since_warmup += compile_count() - compiles
        return deltas

    def _step(self) -> list[Delta]:
        synced = self._sync_for_grammar()
        work = self.scheduler.schedule()
        deltas = []
        if not work.seqs and self._inflight is not None:
            # Every runnable request waits for the step in flight (speculating ones do): read it
            # back first, so the next step can start in this call.
            deltas = self._process(self._inflight)
            self._inflight = None
            work = self.scheduler.schedule()
        pending = None
        if work.seqs:
            pending = self.runner.dispatch(work)
            self.scheduler.commit(work)
            self.stats.steps += 1
            self.stats.step_tokens += work.num_tokens
        if self._inflight is not None:
            deltas = self._process(self._inflight)
        self._inflight = pending
        return synced + deltas

    def _sync_for_grammar(self) -> list[Delta]:
        """A constrained row's next mask needs the token the step in flight samples for it, so that
        step is read back before the next is planned (structured outputs give up the overlap)."""
        p = self._inflight
        if p is None or not any(sq.samples and sq.req.grammar is not None for sq in p.work.seqs):
            return []
        self._inflight = None
        return self._process(p)

    @staticmethod
    def _grammar_ends(req: Request, tok: int) -> bool:
        """Advances the request's matcher; True once its grammar allows nothing but the end."""
        if req.grammar is None:
            return False
        if not req.grammar.accept_token(tok) and tok not in req.eos_token_ids:
            log.warning("request %s: token %d broke its grammar (%s)", req.request_id, tok, req.grammar.error)
        return req.grammar.is_terminated()

    def _process(self, p: PendingStep) -> list[Delta]:
        start = time.perf_counter()
        res = self.runner.fetch(p)
        self.stats.device_wait_seconds += time.perf_counter() - start
        deltas = []
        for row, sq in enumerate(p.work.seqs):
            if not sq.samples:
                continue
            req = sq.req
            req.num_pending_tokens -= sq.num_steps
            if req.is_finished:
                continue  # stopped or aborted while this step was in flight
            num = int(res.num_tokens[row])
            if sq.drafts:
                self.spec.record(req, len(sq.drafts), num - 1)
            if res.drafts is not None:
                req.spec_head_drafts = res.drafts[row].tolist()
            tokens, text, lps, status, reason = [], "", None, Status.RUNNING, None
            for j in range(num):
                tok = int(res.tokens[row, j])
                tokens.append(tok)
                if req.params.logprobs is not None:
                    k = req.params.logprobs
                    entry = {int(i): float(v) for i, v in zip(res.top_ids[row, j, :k], res.top_logprobs[row, j, :k])}
                    entry[tok] = float(res.logprob[row, j])
                    lps = (lps or []) + [entry]
                piece, status, reason = self._append_token(req, tok)
                text += piece
                if status is not Status.RUNNING:
                    break  # tokens accepted after a stop are dropped
            self.stats.generation_tokens += len(tokens)
            finish = None
            if status is not Status.RUNNING:
                if not isinstance(reason, str):
                    text += req.detok.flush()
                self.scheduler.finish(req, status)
                finish = status.value
                self._forget(req)
            elif req.status is Status.RUNNING:  # not preempted while the step was in flight
                if sq.drafts and num > 1:  # the accepted proposals' KV is valid: they join the computed tokens
                    req.num_computed_tokens += num - 1
                    self.kv.register_full_blocks(req)
                if self.spec is not None:
                    self.spec.plan(req, len(self.scheduler.running))
            deltas.append(Delta(req.parent_id, req.index, tokens, text, lps, finish, reason,
                                req.num_prompt_tokens, req.num_cached_tokens))
        if self.spec is not None:
            self.spec.propose_queued()
        return deltas

    @staticmethod
    def _append_token(req: Request, tok: int) -> tuple[str, Status, int | str | None]:
        """Adds one generated token: (its text, the request's status after it, the stop reason)."""
        req.output_token_ids.append(tok)
        grammar_done = Engine._grammar_ends(req, tok)
        n_out = len(req.output_token_ids)
        check = n_out >= req.params.min_tokens
        text, stop_str = req.detok.add(tok, check_stop=check)
        if stop_str is not None:
            return text, Status.FINISHED_STOPPED, stop_str
        if check and tok in req.eos_token_ids:
            return text, Status.FINISHED_STOPPED, None
        if check and tok in req.params.stop_token_ids:
            return text, Status.FINISHED_STOPPED, tok
        if grammar_done:
            return text, Status.FINISHED_STOPPED, None
        if n_out >= req.max_tokens:
            return text, Status.FINISHED_LENGTH, None
        return text, Status.RUNNING, None

    def _forget(self, req: Request) -> None:
        children = self._requests.get(req.parent_id)
        if children is not None and all(c.is_finished for c in children):
            del self._requests[req.parent_id]

    # ---- moving a prompt's KV to another engine (prefill/decode disaggregation) -------------------------
    @property
    def kv_layout(self) -> KVLayout:
        c, rc = self.runner.cfg, self.runner.rc
        entry = kv_entry(c)
        return KVLayout.of(self.model_config.to_dict(), self.kv_dtype.name, rc.page_size,
                           entry.k_page_shape(c.num_layers, rc.page_size),
                           entry.v_page_shape(c.num_layers, rc.page_size), self.runner.kv_scales)

    def _check_single_process(self) -> None:
        if multihost.is_multiprocess():
            raise ConfigError("KV transfer is not supported across several processes yet")

    def export_prompt_kv(self, prompt: str | list[int], *, tenant: str | None = None) -> KVBlocks:
        """The KV of the prompt's full pages that this engine's prefix cache holds (after a prefill)."""
        self._check_single_process()
        ids = self.tokenize_prompt(prompt)
        pages = self.kv.cached_block_pages(ids, tenant)
        k, v = self.runner.read_pages(pages)
        return KVBlocks(self.kv_layout, ids[:len(pages) * self.config.page_size], tenant, k, v)

    def import_prompt_kv(self, blocks: KVBlocks) -> int:
        """Puts another engine's prompt pages into this engine's prefix cache; returns the blocks written.

        A request with that prompt and tenant then finds them cached, like any prefix-cache hit.
        Call it between steps, on the thread that runs them.
        """
        self._check_single_process()
        self.kv_layout.check_compatible(blocks.layout)
        blocks.check()
        if blocks.token_ids:
            self.tokenize_prompt(blocks.token_ids)  # ids inside the vocabulary
        targets = self.kv.import_blocks(blocks.token_ids, blocks.tenant)
        if targets:
            index = [i for i, _ in targets]
            self.runner.write_pages([p for _, p in targets], blocks.k[:, index], blocks.v[:, index])
        return len(targets)

    # ---- hot standby: the model leaves the device and comes back (residency.py) -----------------------
    @property
    def resident(self) -> bool:
        return self.runner.resident

    def demote(self) -> int:
        """Moves the weights to host memory and frees the KV pool, dropping the prefix cache; returns
        the weight bytes moved. Waiting requests stay queued; no request may hold pages."""
        if self._inflight is not None or self.scheduler.running:
            raise RuntimeError("cannot take a model off the device while it runs requests")
        if self.draft is not None:
            raise ConfigError("a model with a draft model or EAGLE-3 head cannot leave the device (hot standby) yet")
        nbytes = self.runner.offload()
        self.kv.drop_cached()
        return nbytes

    def promote(self) -> int:
        """Puts the weights back on the device with an empty KV pool; returns the bytes placed."""
        return self.runner.restore()

    # ---- several processes --------------------------------------------------------------------------
    def follow(self) -> None:
        """On processes other than 0: run process 0's steps until it closes the engine."""
        self.runner.follow()

    def close(self) -> None:
        """Releases follower processes (a no-op in a single process)."""
        self.runner.stop_followers()

    # ---- introspection ----------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)
