"""The engine: requests in, per-step deltas out. Owns the scheduler, the KV manager and the runner.

Each `step()` plans and dispatches step N+1 on the device, then reads back step N's tokens and
turns them into text while the device computes. A front end (the offline `LLM`, the async server
engine) only calls `add_request`, `abort` and `step`. Building one (settings, weights, compiled
steps, the pool) is setup.py's.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from typing import Any, Sequence

from infire_jax.runner import multihost
from infire_jax.runner.compile_guard import cache_hit_count, compile_count
from infire_jax.engine.admission import pooling_run, stop_ids, token_masks
from infire_jax.engine.detokenizer import IncrementalDetokenizer, TokenText
from infire_jax.engine.images import ImageInputs, PreparedImages, salted
from infire_jax.engine.setup import EngineConfig, Progress, load_and_compile, on_gpu, prefix_caching, resolve_settings
from infire_jax.engine.stats import BootTimeline, EngineStats
from infire_jax.errors import ConfigError, InvalidRequestError
from infire_jax.core.hybrid_kv_cache import kv_cache_manager
from infire_jax.kv_transfer import KVBlocks, KVLayout
from infire_jax.kv_transfer.pages import export_pages, import_pages
from infire_jax.loaders.weights import LoadedModel
from infire_jax.loaders.vision import load_vision_weights
from infire_jax.lora.adapters import Adapter, Adapters, cache_salt, resolve_lora
from infire_jax.lora.request import LoRARequest
from infire_jax.models.kv_entry import kv_entry
from infire_jax.outputs import Delta
from infire_jax.pooling.config import PoolingParams
from infire_jax.pooling.plan import embedding, record_pooling
from infire_jax.sample.prompt_logprobs import PromptLogprobs, record_prompt_logprobs
from infire_jax.structured import harmony
from infire_jax.core.request import Request, Status
from infire_jax.runner.image_pool import ImagePool
from infire_jax.runner.model_runner import PendingStep
from infire_jax.sample.generation_config import sampling_defaults
from infire_jax.sample.sampling_params import SamplingParams
from infire_jax.core.scheduler import Scheduler, SchedulerOutput
from infire_jax.core.state_cache import LinearStateCache
from infire_jax.speculative.setup import build_speculation
from infire_jax.structured.backend import CompiledGrammar, GrammarBackend

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, config: EngineConfig | None = None, *, loaded: LoadedModel | None = None,
                 progress: Progress | None = None):
        """Validates the settings, loads and places the model, and compiles every step bucket
        (engine_setup.py); then the host side: KV pages, scheduler, grammars, speculation."""
        ec = self.config = config or EngineConfig()
        s = resolve_settings(ec, loaded)
        # what a request that leaves a sampling field unset gets (vLLM's --generation-config)
        self.sampling_defaults = sampling_defaults(ec.model, ec.generation_config, ec.override_generation_config)
        self.dtype, self.kv_dtype, self.plan, self.max_model_len = s.dtype, s.kv_dtype, s.plan, s.max_model_len
        self.spec_config, self.draft_head, self.pool, self.pooler = s.spec_config, s.draft_head, s.pool, s.pooler
        t0, events, cached = time.monotonic(), compile_count(), cache_hit_count()
        built = load_and_compile(ec, s, loaded, progress or (lambda stage, done, total: None))
        self.runner, self.loaded, self.pool_sizing = built.runner, built.placed.loaded, built.sizing
        self.model_config, self.model_name = self.loaded.config, self.loaded.name
        self.tokenizer = harmony.model_tokenizer(self.loaded.tokenizer)
        self.token_text = TokenText(self.tokenizer)  # logprob entries' decoded tokens
        self.load_seconds, self.warmup_seconds = built.load_seconds, built.warmup_seconds
        # After the warmup: its token trie is built on a thread of its own, which would hold the GIL
        # against the warmup's (the first structured-output request waits for it instead).
        self.grammars = GrammarBackend(self.tokenizer.tk.to_str(), self.model_config.vocab_size,
                                       self.model_config.eos_token_ids, timeout=ec.grammar_compile_timeout)
        log.info("%s", self.pool_sizing.describe())
        rc = self.runner.rc
        self.kv = kv_cache_manager(rc.num_pages, ec.page_size, rc.kv_groups,
                                   enable_prefix_caching=prefix_caching(ec, self.model_config))
        # LoRA adapters (lora/adapters.py): admission pins a request's adapter into a device slot.
        self.lora = Adapters(ec.lora, self.model_config, self.runner, dtype=self.dtype) if ec.lora else None
        # Images (engine/images.py): a Llama 4 or Gemma 3 checkpoint's vision tower and the device's
        # image pool.
        self.images = None
        if s.vision is not None:
            # On a mesh the tower and the pool's rows are replicated (ImagePool).
            placed = s.plan.replicated if s.plan else None
            pool = ImagePool(s.vision, load_vision_weights(ec.model, s.vision, self.dtype, sharding=placed),
                             rc.image_pool[0], placed)
            self.runner.cache = self.runner.cache._replace(images=pool.warmup(self.runner.cache.images))
            self.images = ImageInputs(pool, self.runner, self.tokenizer, ec.images_per_prompt)
        self._images: dict[str, PreparedImages] = {}  # request id -> its images (pool rows, tiles not yet encoded)
        # Linear-attention layers (Qwen3.5): a prefix hit resumes from a kept state (core/state_cache.py).
        self.states = LinearStateCache(rc.linear_snapshots, ec.page_size) if rc.linear_snapshots else None
        self.scheduler = Scheduler(self.kv, max_num_seqs=ec.max_num_seqs,
                                   max_num_batched_tokens=s.max_num_batched_tokens, num_decode_steps=rc.decode_steps,
                                   gate=self.lora, states=self.states)
        self.spec, self.draft = None, None
        if self.spec_config:
            self.spec, self.draft = build_speculation(self.spec_config, self.draft_head, self.model_config,
                                                      self.runner, self.kv, max_num_seqs=ec.max_num_seqs,
                                                      dtype=self.dtype, on_gpu=on_gpu())
        self.boot = BootTimeline(
            weight_bytes=self.runner.weight_bytes, load_seconds=self.load_seconds,
            restored=built.placed.built_because is None, compile_seconds=self.warmup_seconds,
            num_steps=len(rc.buckets.shapes), compiled=compile_count() - events - (cache_hit_count() - cached),
            executables_loaded=self.runner.executables_loaded, cache_loaded=cache_hit_count() - cached,
            overlapped=built.overlapped, ready_seconds=time.monotonic() - t0)
        # Compilations inside step() after warmup: must stay 0 (buckets are fixed).
        self.compiles_since_warmup = 0

        self._rng = random.Random(ec.seed)
        self._ids = itertools.count()
        self._requests: dict[str, list[Request]] = {}
        self._inflight: PendingStep | None = None
        self.stats = EngineStats()

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

    def add_request(self, prompt: str | list[int], params: SamplingParams | PoolingParams | None = None, *,
                    request_id: str | None = None, priority: int = 0, tenant: str | None = None,
                    prefix_hint_tokens: int = 0, session_id: str | None = None,
                    grammar: CompiledGrammar | None = None,
                    lora_request: LoRARequest | str | Adapter | None = None,
                    images: Sequence[Any] | None = None) -> tuple[str, list[int]]:
        """Queues a prompt (text or token ids) for `params.n` samples; returns (request id, prompt ids).

        `grammar` is `params.structured_outputs` compiled already (the server compiles off this
        thread); without it the constraint is compiled here. `lora_request`: the LoRA adapter it
        runs with, a loaded adapter's name, vLLM's LoRARequest (loaded on first use) or an adapter held
        across requests (`Adapters.hold`). `images`:
        PIL images or encoded ones, one per image marker of a text prompt (`<|image|>`, Gemma 3's
        `<start_of_image>`: engine/images.py).
        PoolingParams ask for the prompt's embedding instead (runner="pooling"): its one delta has it."""
        params = params or SamplingParams()
        if images is None:
            return self._add_request(prompt, params, request_id, priority, tenant, prefix_hint_tokens, session_id,
                                     grammar, lora_request, None)
        if self.images is None:
            raise InvalidRequestError(f"{self.model_name} takes no images (a Llama 4 or Gemma 3 checkpoint "
                                      "with a vision tower does, unless limit_mm_per_prompt is 0)",
                                      param="multi_modal_data")
        if isinstance(prompt, str) and not prompt:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        prepared = self.images.prepare(prompt, images)
        try:
            rid, ids = self._add_request(prepared.ids, params, request_id, priority, tenant, prefix_hint_tokens,
                                         session_id, grammar, lora_request, prepared)
        except BaseException:
            self.images.release(prepared.spans)
            raise
        self._images[rid] = prepared
        return rid, ids

    def _add_request(self, prompt, params, request_id, priority, tenant, prefix_hint_tokens, session_id, grammar,
                     lora_request, images: PreparedImages | None) -> tuple[str, list[int]]:
        ids = self.tokenize_prompt(prompt)
        pooling = params if isinstance(params, PoolingParams) else None
        if pooling is not None:
            params = pooling_run(pooling, self.pooler, self.model_name, self.model_config.hidden_size)
        if params.structured_outputs is not None:
            grammar = self._grammar(params, grammar)
        if params.prompt_logprobs is not None:
            self._check_prompt_logprobs(params.prompt_logprobs)
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise InvalidRequestError(f"logprobs must be at most {self.config.max_logprobs} (--max-logprobs), "
                                      f"got {params.logprobs}", param="logprobs")
        n_prompt = len(ids)
        if n_prompt >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {n_prompt} tokens, but max_model_len is {self.max_model_len}", param="prompt")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n_prompt
        if n_prompt + max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but {n_prompt + max_tokens} "
                f"were requested ({n_prompt} in the prompt, {max_tokens} to generate)", param="max_tokens")
        allowed, bad_sequences = token_masks(params, self.tokenizer, self.model_config.vocab_size)
        eos = () if params.ignore_eos else self.model_config.eos_token_ids
        stop = stop_ids(params, eos)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        adapter = resolve_lora(self.lora, lora_request)
        children = []
        for i in range(params.n):
            seed = (params.seed + i) & (2 ** 64 - 1) if params.seed is not None else self._rng.getrandbits(64)
            salt = salted(cache_salt(tenant, adapter), None if images is None else images.digest)
            req = Request(f"{request_id}#{i}", ids, params, eos_token_ids=eos, max_tokens=max_tokens, seed=seed,
                          priority=priority, cache_salt=salt,
                          prefix_hint_tokens=prefix_hint_tokens,
                          session_id=session_id, min_tokens_stop_ids=stop, parent_id=request_id, index=i)
            req.detok = IncrementalDetokenizer(self.tokenizer, ids, params)
            req.grammar = grammar.matcher() if params.structured_outputs is not None else None
            req.allowed_mask = allowed
            req.bad_sequences = bad_sequences
            req.spec_wait = self.spec is not None  # so its first decode step can already carry proposals
            req.lora = adapter
            req.image_rows = None if images is None else images.rows
            if pooling is not None:
                req.pooling, req.pooling_type = pooling, self.pooler.pooling_type
            children.append(req)
        for _ in children if adapter else ():
            self.lora.add_user(adapter)
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

    def _check_prompt_logprobs(self, k: int) -> None:
        if k > self.config.max_prompt_logprobs:
            raise InvalidRequestError(f"prompt_logprobs (on /v1/completions: logprobs with echo) must be at most "
                                      f"{self.config.max_prompt_logprobs} (--max-prompt-logprobs), got {k}",
                                      param="prompt_logprobs")
        if multihost.is_multiprocess():  # followers would need to launch the head's blocks too
            raise InvalidRequestError("prompt logprobs are not supported across several processes yet",
                                      param="prompt_logprobs")

    def abort(self, request_id: str) -> None:
        """Stops a request and frees its pages now; later results for it are dropped."""
        for req in self._requests.pop(request_id, []):
            if not req.is_finished:
                self.scheduler.finish(req, Status.FINISHED_ABORTED)
        self._release_images(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or self._inflight is not None

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prompt page (vLLM's `reset_prefix_cache`): later prompts compute their
        KV afresh. False, and nothing dropped, while requests hold pages."""
        if self.has_unfinished():
            return False
        self._drop_cached()
        return True

    def _drop_cached(self) -> None:
        self.kv.drop_cached()
        if self.states is not None:
            self.states.clear()

    # ---- the step ---------------------------------------------------------------------------------
    def step(self) -> list[Delta]:
        compiles, start = compile_count(), time.perf_counter()
        deltas = self._step()
        self.stats.step_seconds += time.perf_counter() - start
        self.compiles_since_warmup += compile_count() - compiles
        return deltas

    def _step(self) -> list[Delta]:
        synced = self._sync_for_masks()
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
            self._encode_images(work)
            pending = self.runner.dispatch(work)
            self.scheduler.commit(work)
            self.stats.steps += 1
            self.stats.step_tokens += work.num_tokens
        if self._inflight is not None:
            deltas = self._process(self._inflight)
        self._inflight = pending
        return synced + deltas

    def _encode_images(self, work: SchedulerOutput) -> None:
        """Encodes the images whose <|patch|> tokens this step computes first (engine/images.py): a
        prompt whose images' tokens are a prefix hit, or KV a decode worker imported, encodes none."""
        for sq in work.seqs:
            prepared = self._images.get(sq.req.parent_id)
            if prepared is not None and sq.start < sq.req.num_prompt_tokens:
                self.stats.images_encoded += self.images.encode(prepared, sq.start, sq.start + sq.num_tokens)

    def _sync_for_masks(self) -> list[Delta]:
        """A constrained row's next mask (a grammar's, a longer bad word's) needs the token the step in
        flight samples for it, so that step is read back before the next is planned (such requests give
        up the overlap)."""
        p = self._inflight
        if p is None or not any(sq.samples and sq.req.masked_by_output for sq in p.work.seqs):
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
        if res.prompt_logprobs is not None:
            record_prompt_logprobs(p.work.seqs, p.prompt_logprobs[0], res.prompt_logprobs, self.token_text)
        if res.pooled is not None:
            record_pooling(p.work.seqs, p.pooling[0], res.pooled)
        deltas = []
        for row, sq in enumerate(p.work.seqs):
            req = sq.req
            if not sq.samples:
                if req.prefill_only and sq.start + sq.num_tokens == req.num_prompt_tokens and not req.is_finished:
                    deltas.append(self._prompt_done(req))
                continue
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
                                req.num_prompt_tokens, req.num_cached_tokens, self._take_prompt_logprobs(req)))
        if self.spec is not None:
            self.spec.propose_queued()
        return deltas

    def _prompt_done(self, req: Request) -> Delta:
        """A prefill-only request (max_tokens 0) whose prompt has run: it finishes with no token (an
        embedding request, with its embedding)."""
        self.scheduler.finish(req, Status.FINISHED_LENGTH)
        self._forget(req)
        p = req.pooling
        pooled = None if p is None else embedding(req.pooled, req.num_prompt_tokens, self.pooler, p.dimensions,
                                                  p.use_activation)
        return Delta(req.parent_id, req.index, [], "", None, Status.FINISHED_LENGTH.value, None,
                     req.num_prompt_tokens, req.num_cached_tokens, self._take_prompt_logprobs(req), pooled)

    @staticmethod
    def _take_prompt_logprobs(req: Request) -> PromptLogprobs | None:
        """The request's prompt logprobs, whole, for its first delta (the prompt has run by then)."""
        out, req.prompt_logprobs = req.prompt_logprobs, None
        return out

    @staticmethod
    def _append_token(req: Request, tok: int) -> tuple[str, Status, int | str | None]:
        """Adds one generated token: (its text, the request's status after it, the stop reason)."""
        req.output_token_ids.append(tok)
        grammar_done = Engine._grammar_ends(req, tok)
        n_out = len(req.output_token_ids)
        check = n_out >= req.params.min_tokens
        eos = check and tok in req.eos_token_ids
        by_id = check and not eos and tok in req.params.stop_token_ids
        if (eos or by_id) and not req.params.include_stop_str_in_output:  # as vLLM, its text is left out
            return "", Status.FINISHED_STOPPED, tok if by_id else None
        text, stop_str = req.detok.add(tok, check_stop=check)
        if stop_str is not None:
            return text, Status.FINISHED_STOPPED, stop_str
        if eos or by_id:
            return text, Status.FINISHED_STOPPED, tok if by_id else None
        if grammar_done:
            return text, Status.FINISHED_STOPPED, None
        if n_out >= req.max_tokens:
            return text, Status.FINISHED_LENGTH, None
        return text, Status.RUNNING, None

    def _forget(self, req: Request) -> None:
        children = self._requests.get(req.parent_id)
        if children is not None and all(c.is_finished for c in children):
            del self._requests[req.parent_id]
            self._release_images(req.parent_id)

    def _release_images(self, request_id: str) -> None:
        prepared = self._images.pop(request_id, None)
        if prepared is not None:
            self.images.release(prepared.spans)

    # ---- moving a prompt's KV to another engine (prefill/decode disaggregation) -------------------------
    @property
    def kv_layout(self) -> KVLayout:
        c, rc = self.runner.cfg, self.runner.rc
        entry, layers = kv_entry(c), rc.pool_layers(c.num_kv_layers)
        return KVLayout.of(self.model_config.to_dict(), self.kv_dtype.name, rc.page_size,
                           entry.k_page_shape(layers, rc.page_size), entry.v_page_shape(layers, rc.page_size),
                           self.runner.kv_scales, None if rc.kv_groups is None else rc.kv_groups.groups)

    def _check_kv_transfer(self) -> None:
        """KV transfer: one process, and a model whose pages hold its whole context."""
        if multihost.is_multiprocess():
            raise ConfigError("KV transfer is not supported across several processes yet")
        if self.model_config.gated_delta is not None:
            raise ConfigError("KV transfer is not supported for Qwen3.5: its linear-attention layers keep their "
                              "state outside the KV pages")

    def export_prompt_kv(self, prompt: str | list[int], *, tenant: str | None = None,
                         lora_name: str | None = None, image_digest: str | None = None) -> KVBlocks:
        """The KV of the prompt's full pages that this engine's prefix cache holds (after a prefill)
        for this tenant and LoRA adapter, and the images of `image_digest` (engine/images.py's
        `images_digest`; None: a prompt without images); with a hybrid cache, each group's pages that
        a prefix hit of them reads (kv_transfer/pages.py)."""
        self._check_kv_transfer()
        ids, layout = self.tokenize_prompt(prompt), self.kv_layout
        salt = salted(cache_salt(tenant, resolve_lora(self.lora, lora_name)), image_digest)
        token_ids, pages = export_pages(self.kv, layout, ids, salt)
        k, v = self.runner.read_pages(pages)
        return KVBlocks(layout, token_ids, tenant, k, v)

    def import_prompt_kv(self, blocks: KVBlocks, lora_name: str | None = None, image_digest: str | None = None) -> int:
        """Puts another engine's prompt pages into this engine's prefix cache; returns the pages written.

        A request with that prompt, tenant, LoRA adapter and images (`image_digest`, which this engine's
        caller computes from the images it was given) then finds them cached, like any prefix-cache
        hit: its images' tokens among them are never encoded here. Call it between steps, on the
        thread that runs them.
        """
        self._check_kv_transfer()
        layout = self.kv_layout
        layout.check_compatible(blocks.layout)
        blocks.check()
        if blocks.token_ids:
            self.tokenize_prompt(blocks.token_ids)  # ids inside the vocabulary
        pages, index = import_pages(self.kv, layout, blocks.token_ids,
                                    salted(cache_salt(blocks.tenant, resolve_lora(self.lora, lora_name)), image_digest))
        if pages:
            self.runner.write_pages(pages, blocks.k[:, index], blocks.v[:, index])
        return len(pages)

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
            raise ConfigError("a model with a draft model or draft head cannot leave the device (hot standby) yet")
        nbytes = self.runner.offload()
        self._drop_cached()
        if self.lora is not None:
            self.lora.drop_device()
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
