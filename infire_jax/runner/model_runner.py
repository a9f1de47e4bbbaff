"""The device side: launches the step's programs on the model's weights and KV pool and reads the
tokens back. The runner is a DeviceMemory (device_memory.py: the weights, the pool, hot standby's
offload and restore) with CompiledSteps (compiled_steps.py: step_programs.py's functions compiled
per bucket); these are the only modules that hold device arrays.

A step is two jitted calls, launched back to back without waiting: the forward (embed, all decoder
layers over the paged pool, the LM head at each row's last token), compiled once per token bucket,
and the sampler, compiled once per row count and sampler variant (see sample/sampler.py). Keeping the
sampler apart means its variants do not multiply the forward's compilations. The pool, the
per-slot sampling history and the last sampled tokens are donated, so each step updates them in
place; the logits stay on the device between the two calls.

A decode burst (scheduler.py) is one program instead, compiled per decode-sized bucket and
sampler variant: up to `decode_steps` forwards and samplers in a device loop
(step_programs.decode_burst), read back once.

With speculative decoding, a step in which some row carries proposed tokens is a verifying step:
a forward with logits at every proposed position (one more program per bucket), then the
verifier (speculative/verify.py) in place of the sampler.

A step with prompt positions whose logprobs are asked for (prompt_logprobs.py) launches, after its
forward, the LM head over those positions' hidden states a block at a time; their logprobs come
back with the step's tokens. A step with rows that pool (embeddings, infire_jax/pooling/plan.py)
launches the bucket's pooling program on its hidden states; each row's sum comes back with the
tokens. Other steps launch nothing more.
"""

from __future__ import annotations

import os
from typing import Callable, NamedTuple

import jax
import numpy as np
from flax import nnx
from jaxtyping import Array

from infire_jax.runner import multihost
from infire_jax.runner.batch import BurstInputs, DraftInputs, StepBatch, burst_inputs, draft_inputs, grammar_bitmask
from infire_jax.runner.buckets import StepShape
from infire_jax.runner.compiled_steps import TRANSFER_PAGES, CompiledSteps, ProgramKey, ProgramSpec
from infire_jax.runner.device_memory import DeviceMemory
from infire_jax.models.config import ModelConfig
from infire_jax.sample.prompt_logprobs import PromptLogprobPlan, PromptLogprobResult, plan_prompt_logprobs
from infire_jax.pooling.plan import PoolingPlan, plan_pooling
from infire_jax.runner.config import RunnerConfig
from infire_jax.sample.sampler import SamplerOutput, choose_variant
from infire_jax.core.scheduler import SchedulerOutput
from infire_jax.speculative.verify import VerifyOutput
from infire_jax.runner.step_programs import BurstOutput, PromptLogprobs, StepForward
from pallas_kernels.metadata import NULL_PAGE
from sharding.plan import ShardPlan


def _uses_penalties(p) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0 or p.frequency_penalty != 0


def _padded_pages(pages: list[int]) -> np.ndarray:
    out = np.full(TRANSFER_PAGES, NULL_PAGE, np.int32)
    out[:len(pages)] = pages
    return out


class PendingStep(NamedTuple):
    work: SchedulerOutput
    out: SamplerOutput | VerifyOutput | BurstOutput  # device arrays, not yet read back
    want_logprobs: bool
    drafts: Array | None = None  # [S, k] proposals the step's observer made (EAGLE-3), read back with the tokens
    prompt_logprobs: tuple[PromptLogprobPlan, list[PromptLogprobs]] | None = None  # a block's outputs per block
    pooling: tuple[PoolingPlan, Array] | None = None  # the rows' pooled sums [S, E]


class StepResult(NamedTuple):
    """Each row's new tokens: [rows, P] (P = 1, K + 1 when verifying, or a burst's steps), the first
    num_tokens valid."""

    tokens: np.ndarray  # [rows, P] int32
    num_tokens: np.ndarray  # [rows] int32
    logprob: np.ndarray | None  # [rows, P]
    top_ids: np.ndarray | None  # [rows, P, MAX_LOGPROBS]
    top_logprobs: np.ndarray | None
    drafts: np.ndarray | None = None  # [rows, k]
    prompt_logprobs: PromptLogprobResult | None = None  # the planned prompt positions'
    pooled: np.ndarray | None = None  # [rows, E] float32: each pooling row's weighted sum


class ModelRunner(DeviceMemory):
    """A model's device memory (device_memory.py: `__init__` takes the weights and allocates the pool)
    and its compiled programs (`steps`, compiled_steps.py): launches steps, reads them back, and
    mirrors them on the other processes of a multi-host mesh."""

    def __init__(self, cfg: ModelConfig, graphdef: nnx.GraphDef, state: nnx.State, rc: RunnerConfig,
                 *, dtype, plan: ShardPlan | None = None):
        """Takes the weights and allocates the pool (DeviceMemory says what `cfg` and `state` may be),
        and jits the step's programs; `warmup` compiles them."""
        super().__init__(cfg, graphdef, state, rc, dtype=dtype, plan=plan)
        # Called with every step (its plan, batch, forward and sampled tokens) once it is launched: a
        # draft model or an EAGLE-3 head keeps its KV in step with the target's (speculative/). What
        # it returns (EAGLE-3's next proposals) is read back with the step's tokens.
        self.observer: Callable[[SchedulerOutput, StepBatch, StepForward, SamplerOutput | VerifyOutput],
                                Array | None] | None = None
        self.steps = CompiledSteps(self)

    def warmup(self, on_shape: Callable[[StepShape], None] | None = None,
               before_compiling: Callable[[], None] | None = None) -> None:
        """Compiles every bucket's programs ahead of time (deserialized from the executable cache
        after the first start), without running them: that needs only the weights' shapes, so it
        may run while they load. What the executable cache lacks is compiled after
        `before_compiling` returns (the engine's: once the weights are read, since those compiles
        switch XLA's persistent cache off).

        With several processes, each process also runs every broadcast shape once, and the history
        program once on the padding slot (the page programs of KV transfer serve one process only).
        """
        specs: dict[ProgramKey, ProgramSpec] = {}
        if multihost.is_multiprocess():
            pad = np.full(self.rc.history_len, self.cfg.vocab_size, np.int32)
            multihost.receive_header()
            multihost.receive((pad, pad))
            self._load(self.rc.dummy_slot, pad, pad)
        else:
            specs.update(self.steps.small_specs())
        for shape in self.rc.buckets.shapes:
            batch = self.rc.empty_batch(shape)
            if multihost.is_multiprocess():
                batch = multihost.receive(batch)
                if self.rc.decode_steps > 1 and shape in self.rc.buckets.decode_shapes:
                    multihost.receive(self._empty_burst(shape))
            for rows in (shape.num_rows, shape.num_rows * (self.rc.num_spec + 1)):  # plain, verifying steps
                if rows not in self._all_allowed:
                    self._put_all_allowed(rows)
            for key, spec in self.steps.bucket_specs(shape, batch).items():
                specs.setdefault(key, spec)  # a sampler serves every bucket of its row count
        workers = 1 if multihost.is_multiprocess() else min(4, os.cpu_count() or 1)
        self.steps.compile(specs, workers, on_shape, before_compiling)

    def peak_activation_bytes(self) -> int:
        """Temporaries of the largest step on one device (XLA's memory analysis; compiled_steps.py)."""
        return self.steps.peak_activation_bytes()

    @property
    def executables_loaded(self) -> int:
        """Step programs deserialized from the executable cache (not traced) so far."""
        return self.steps.executables_loaded

    def empty_batches(self) -> list[StepBatch]:
        """A padding-only batch of every token bucket (to compile programs that take step batches)."""
        return [self.rc.empty_batch(shape) for shape in self.rc.buckets.shapes]

    def _empty_burst(self, shape: StepShape) -> tuple[StepBatch, BurstInputs]:
        return self.rc.empty_batch(shape), burst_inputs(SchedulerOutput([], []), shape.num_rows)

    # ---- launching --------------------------------------------------------------------------------
    def dispatch(self, work: SchedulerOutput) -> PendingStep:
        """Enqueues one step on the device and returns without waiting for it."""
        states = self.rc.linear_snapshots > 0  # the prefix cache keeps linear states (core/state_cache.py)
        for sq in work.seqs:
            if sq.reset_slot and sq.start > 0 and _uses_penalties(sq.req.params):
                self._restore_history(sq.req, sq.start)
            if states and sq.state_restore is not None:  # a prefix hit's linear state
                self._copy_state("restore_state", sq.state_restore, sq.req.slot)
        shape = self.rc.buckets.shape_for(work.num_tokens, len(work.seqs))
        want_lp = any(s.samples and s.req.params.logprobs is not None for s in work.seqs)
        if work.is_burst:  # no grammar, no proposals, no observer (the scheduler and the engine check)
            batch = self.rc.batch(work, shape)
            burst = burst_inputs(work, shape.num_rows)
            variant = choose_variant(batch.sampling, self.rc.sampler_variants)
            if multihost.is_multiprocess():
                multihost.send(multihost.BURST, self._command(shape, variant), (batch, burst))
            return PendingStep(work, self._run_burst(shape, batch, burst, variant), want_lp)
        if any(s.drafts for s in work.seqs):  # one process only (the engine checks)
            mask = grammar_bitmask(work, shape.num_rows, self.mask_words, self.rc.num_spec + 1)
            batch = self.rc.batch(work, shape, verify=True)
            fwd, out = self._run_verify(shape, batch, draft_inputs(work, shape, self.rc.num_spec), mask)
        else:
            mask = grammar_bitmask(work, shape.num_rows, self.mask_words)
            batch = self.rc.batch(work, shape)
            variant = choose_variant(batch.sampling, self.rc.sampler_variants)
            if multihost.is_multiprocess():
                multihost.send(multihost.STEP, self._command(shape, variant), batch)
            fwd, out = self._run(shape, batch, variant, mask)
        for sq in work.seqs if states else ():  # the states kept at save points (one process: setup refuses more)
            if sq.state_save is not None:
                self._copy_state("save_state", sq.req.slot, sq.state_save)
        drafts = self.observer(work, batch, fwd, out) if self.observer is not None else None
        return PendingStep(work, out, want_lp, drafts, self._launch_prompt_logprobs(work, shape, fwd.hidden),
                           self._launch_pooling(work, shape, fwd.hidden))

    def _launch_pooling(self, work: SchedulerOutput, shape: StepShape, hidden: Array) -> tuple[PoolingPlan, Array] | None:
        """The bucket's pooling program over the step's hidden states, when a row pools (one process
        only: the engine checks); launched, not awaited."""
        if not self.rc.pooling:
            return None
        plan = plan_pooling(work.seqs, shape.num_tokens)
        if plan is None:
            return None
        return plan, self.steps.compiled_pool[shape](self.state, hidden, plan.weights, plan.token_rows)

    def _launch_prompt_logprobs(self, work: SchedulerOutput, shape: StepShape,
                                hidden: Array) -> tuple[PromptLogprobPlan, list[PromptLogprobs]] | None:
        """The head over the step's planned prompt positions, a block at a time (one process only: the
        engine checks); launched, not awaited."""
        plan = plan_prompt_logprobs(work.seqs, self.rc.prompt_logprobs_block)
        if plan is None:
            return None
        gather, head = self.steps.compiled_prompt_rows[shape], self.steps.compiled_small["prompt_logprobs"]
        return plan, [head(self.state, gather(hidden, index), targets)
                      for index, targets in zip(plan.token_index, plan.targets)]

    def _run(self, shape: StepShape, batch: StepBatch, variant: str,
             grammar_mask: np.ndarray | None = None) -> tuple[StepForward, SamplerOutput]:
        """Launches the bucket's compiled forward and sampler; neither waits for the device."""
        fwd = self.steps.compiled_forward[shape](self.state, self.cache, batch)
        cache = fwd.cache
        mask = self._all_allowed[shape.num_rows] if grammar_mask is None else grammar_mask
        last, out = self.steps.compiled_samplers[shape.num_rows, variant](
            cache.last_tokens, cache.counts, cache.prompt_mask, fwd.logits, batch.sampling, batch.row_slots,
            batch.sample_rows, mask)
        self.cache = cache._replace(last_tokens=last)
        return fwd, out

    def _run_verify(self, shape: StepShape, batch: StepBatch, drafts: DraftInputs,
                    grammar_mask: np.ndarray | None) -> tuple[StepForward, VerifyOutput]:
        """Launches a verifying step: the forward with logits at every proposed position, then the verifier."""
        fwd = self.steps.compiled_verify_forward[shape](self.state, self.cache, batch)
        cache = fwd.cache
        mask = self._all_allowed[batch.logits_indices.shape[0]] if grammar_mask is None else grammar_mask
        last, counts, out = self.steps.compiled_verifiers[shape.num_rows](
            cache.last_tokens, cache.counts, cache.prompt_mask, fwd.logits, batch.sampling, batch.row_slots,
            batch.sample_rows, drafts, mask)
        self.cache = cache._replace(last_tokens=last, counts=counts)
        if fwd.linear_inputs is not None:  # the linear state over the tokens the verifier kept (Qwen3.5)
            self.cache = self.steps.compiled_commits[shape](self.state, self.cache, batch, fwd.linear_inputs,
                                                            drafts.num, out.num_tokens)
        return fwd, out

    def _run_burst(self, shape: StepShape, batch: StepBatch, burst: BurstInputs, variant: str) -> BurstOutput:
        """Launches a decode burst; it does not wait for the device."""
        self.cache, out = self.steps.compiled_bursts[shape, variant](self.state, self.cache, batch, burst)
        return out

    def _restore_history(self, req, upto: int) -> None:
        """A request admitted with cached tokens needs its skipped tokens in its penalty history."""
        prompt = np.full(self.rc.history_len, self.cfg.vocab_size, np.int32)  # ids >= vocab are dropped
        output = prompt.copy()
        n_prompt = min(upto, req.num_prompt_tokens)
        prompt[:n_prompt] = req.prompt_token_ids[:n_prompt]
        output[:upto - n_prompt] = req.output_token_ids[:upto - n_prompt]
        if multihost.is_multiprocess():
            multihost.send(multihost.HISTORY, req.slot, (prompt, output))
        self._load(req.slot, prompt, output)

    def _copy_state(self, name: str, src: int, dst: int) -> None:
        """A slot's linear state to a snapshot, or back (runner/step_programs.py save_/restore_linear_state)."""
        self.cache = self.steps.compiled_small[name](self.cache, np.int32(src), np.int32(dst))

    def _load(self, slot: int, prompt: np.ndarray, output: np.ndarray) -> None:
        history = self.steps.compiled_small.get("history", self.steps.history)
        self.cache = history(self.cache, np.int32(slot), prompt, output)

    # ---- reading back -----------------------------------------------------------------------------
    @staticmethod
    def fetch(p: PendingStep) -> StepResult:
        """Reads the sampled tokens (and logprobs when asked for) back to the host: the step's one sync.

        The outputs are replicated, so this process's first copy is the whole value.
        """
        several = isinstance(p.out, (VerifyOutput, BurstOutput))  # tokens a row: [rows, P]
        wanted = [p.out.tokens] + ([p.out.num_tokens] if several else [])
        if p.want_logprobs:
            wanted += [p.out.logprob, p.out.top_ids, p.out.top_logprobs]
        if p.drafts is not None:
            wanted.append(p.drafts)
        if p.pooling is not None:
            wanted.append(p.pooling[1])
        blocks = [x for block in p.prompt_logprobs[1] for x in block] if p.prompt_logprobs is not None else []
        host = jax.device_get([x.addressable_data(0) for x in wanted + blocks])
        blocks, host = host[len(host) - len(blocks):], host[:len(host) - len(blocks)]
        pooled = host.pop() if p.pooling is not None else None
        drafts = host.pop() if p.drafts is not None else None
        tokens = host.pop(0)
        if several:
            num = host.pop(0)
        else:  # one token per row
            tokens, num = tokens[:, None], np.ones(len(tokens), np.int32)
            host = [host[0][:, None], host[1][:, None], host[2][:, None]] if host else host
        fields = len(PromptLogprobResult._fields)
        prompt = PromptLogprobResult(*(np.concatenate(blocks[i::fields]) for i in range(fields))) if blocks else None
        return StepResult(tokens, num, *(host or (None, None, None)), drafts, prompt, pooled)

    # ---- KV pages in and out (KV transfer between engines) ----------------------------------------
    def read_pages(self, pages: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """The KV of `pages`, [L, len(pages), page_size, heads, dim] each (models/kv_entry.py), on the
        host (in chunks of TRANSFER_PAGES: one compiled shape)."""
        chunks = [pages[i:i + TRANSFER_PAGES] for i in range(0, len(pages), TRANSFER_PAGES)]
        read = self.steps.compiled_small["read_pages"]
        host = jax.device_get([read(self.cache.k_pages, self.cache.v_pages, _padded_pages(c)) for c in chunks])

        def empty(pool):  # so that no pages still concatenates
            return np.zeros((pool.shape[0], 0, *pool.shape[2:]), self.kv_dtype)

        k = np.concatenate([empty(self.cache.k_pages)] + [k[:, :len(c)] for (k, _), c in zip(host, chunks)], axis=1)
        v = np.concatenate([empty(self.cache.v_pages)] + [v[:, :len(c)] for (_, v), c in zip(host, chunks)], axis=1)
        return k, v

    def write_pages(self, pages: list[int], k: np.ndarray, v: np.ndarray) -> None:
        """Writes host KV [L, len(pages), page_size, heads, dim] into `pages` (padding lands on the null page)."""
        for i in range(0, len(pages), TRANSFER_PAGES):
            chunk = pages[i:i + TRANSFER_PAGES]
            pad = [(0, 0), (0, TRANSFER_PAGES - len(chunk))] + [(0, 0)] * 3
            kc, vc = (np.pad(np.asarray(x[:, i:i + len(chunk)], self.kv_dtype), pad) for x in (k, v))
            self.cache = self.steps.compiled_small["write_pages"](self.cache, _padded_pages(chunk), kc, vc)

    # ---- several processes ------------------------------------------------------------------------
    def _command(self, shape: StepShape, variant: str) -> int:
        """A step's (bucket, sampler variant) as one integer, for the multi-process header."""
        return self.rc.buckets.shapes.index(shape) * len(self.rc.sampler_variants) + \
            self.rc.sampler_variants.index(variant)

    def follow(self) -> None:
        """Follower processes: run the leader's device commands until it stops."""
        shapes = self.rc.buckets.shapes
        pad = np.full(self.rc.history_len, self.cfg.vocab_size, np.int32)
        while True:
            command, arg = multihost.receive_header()
            if command == multihost.STOP:
                return
            if command == multihost.HISTORY:
                self._load(arg, *multihost.receive((pad, pad)))
            else:
                shape, variant = divmod(arg, len(self.rc.sampler_variants))
                shape, variant = shapes[shape], self.rc.sampler_variants[variant]
                if command == multihost.BURST:
                    self._run_burst(shape, *multihost.receive(self._empty_burst(shape)), variant)
                else:
                    self._run(shape, multihost.receive(self.rc.empty_batch(shape)), variant)

    def stop_followers(self) -> None:
        if multihost.is_multiprocess() and multihost.is_leader():
            multihost.send(multihost.STOP, 0)
