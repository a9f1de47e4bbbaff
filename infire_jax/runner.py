"""The device side: holds the weights and the KV pool, runs the jitted step. The only module with device arrays.

One jitted function serves every step: embed, all decoder layers over the paged pool, LM head at
each row's last token, sampling. It is compiled once per token bucket at warmup. The pool and the
per-slot sampling history are donated, so each step updates them in place.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from infire_jax import multihost
from infire_jax.batch import TOKEN_OUTPUT, TOKEN_PROMPT, StepBatch, build_batch
from infire_jax.buckets import Buckets, StepShape
from infire_jax.models.config import ModelConfig
from infire_jax.sampler import SamplerOutput, sample
from infire_jax.scheduler import SchedulerOutput
from sharding.plan import KV_POOL_AXES, ShardPlan


class DeviceCache(NamedTuple):
    """State that lives on the device across steps; donated to every step."""

    k_pages: Float[Array, "L N ps Hkv D"]
    v_pages: Float[Array, "L N ps Hkv D"]
    counts: Int[Array, "R V"]  # output-token counts per request slot (penalties)
    prompt_mask: Bool[Array, "R V"]  # prompt tokens per request slot (repetition penalty)
    last_tokens: Int[Array, "R"]  # last sampled token per slot (asynchronous scheduling)


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    page_size: int
    num_pages: int
    max_model_len: int
    max_num_seqs: int
    buckets: Buckets
    attn_impl: str = "reference"

    @property
    def pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)

    @property
    def num_slots(self) -> int:
        return self.max_num_seqs + 1  # the last slot absorbs padding rows

    @property
    def dummy_slot(self) -> int:
        return self.max_num_seqs


def kv_bytes_per_page(cfg: ModelConfig, page_size: int, dtype) -> int:
    return 2 * cfg.num_layers * page_size * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize


def _step(graphdef: nnx.GraphDef, attn_impl: str, plan: ShardPlan | None, state: nnx.State, cache: DeviceCache,
          b: StepBatch) -> tuple[DeviceCache, SamplerOutput]:
    model = nnx.merge(graphdef, state)
    dummy = cache.last_tokens.shape[0] - 1
    rows = b.row_slots.shape[0]
    valid = b.meta.seq_ids < rows
    tok_slot = jnp.where(valid, b.row_slots[jnp.clip(b.meta.seq_ids, 0, rows - 1)], dummy)
    tokens = jnp.where(b.from_device, cache.last_tokens[tok_slot], b.token_ids)

    # Each slot's token history, for the penalties: reset on admission, then add this step's tokens.
    reset = jnp.where(b.reset_rows, b.row_slots, dummy)
    counts = cache.counts.at[reset].set(0)
    prompt_mask = cache.prompt_mask.at[reset].set(False)
    counts = counts.at[jnp.where(b.token_kind == TOKEN_OUTPUT, tok_slot, dummy), tokens].add(1)
    prompt_mask = prompt_mask.at[jnp.where(b.token_kind == TOKEN_PROMPT, tok_slot, dummy), tokens].set(True)

    logits, (k_pages, v_pages) = model(
        tokens, (cache.k_pages, cache.v_pages), b.meta, b.logits_indices, attn_impl=attn_impl, plan=plan)
    if plan is not None:
        # Gather the vocab-split logits once: the sampler's branches then hold no collectives
        # (a collective inside a branch can stall the CPU backend's per-device threads).
        logits = jax.lax.with_sharding_constraint(logits, plan.replicated)
    out = sample(logits, b.sampling, counts, prompt_mask, b.row_slots)
    last = cache.last_tokens.at[jnp.where(b.sample_rows, b.row_slots, dummy)].set(out.tokens)
    return DeviceCache(k_pages, v_pages, counts, prompt_mask, last), out


def _load_history(cache: DeviceCache, slot: Int[Array, ""], prompt_ids: Int[Array, "M"],
                  output_ids: Int[Array, "M"]) -> DeviceCache:
    """Rebuilds one slot's token history (ids >= vocab are padding and dropped)."""
    counts = cache.counts.at[slot].set(0).at[slot, output_ids].add(1, mode="drop")
    prompt_mask = cache.prompt_mask.at[slot].set(False).at[slot, prompt_ids].set(True, mode="drop")
    return cache._replace(counts=counts, prompt_mask=prompt_mask)


def _uses_penalties(p) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0 or p.frequency_penalty != 0


class PendingStep(NamedTuple):
    work: SchedulerOutput
    out: SamplerOutput  # device arrays, not yet read back
    want_logprobs: bool


class StepResult(NamedTuple):
    tokens: np.ndarray  # [rows] int32
    logprob: np.ndarray | None  # [rows]
    top_ids: np.ndarray | None  # [rows, MAX_LOGPROBS]
    top_logprobs: np.ndarray | None


class ModelRunner:
    def __init__(self, cfg: ModelConfig, graphdef: nnx.GraphDef, state: nnx.State, rc: RunnerConfig,
                 *, dtype, plan: ShardPlan | None = None):
        """`cfg` is the placed model's config (a plan's effective config on a mesh)."""
        self.cfg = cfg
        self.rc = rc
        self.graphdef = graphdef
        self.state = state
        self.dtype = dtype
        self.plan = plan
        self.cache = self._allocate_cache()
        # On a mesh the sampled tokens come back replicated, so every process can read them locally.
        out_shardings = (jax.tree.map(lambda a: a.sharding, self.cache), plan.replicated) if plan else None
        self._step = jax.jit(functools.partial(_step, graphdef, rc.attn_impl, plan), donate_argnums=(1,),
                             out_shardings=out_shardings)
        self._history = jax.jit(_load_history, donate_argnums=(0,))

    def _allocate_cache(self) -> DeviceCache:
        """The pool is split like the kv heads and layers; the per-slot history is replicated."""
        c, rc, plan = self.cfg, self.rc, self.plan
        pages_shape = (c.num_layers, rc.num_pages, rc.page_size, c.num_kv_heads, c.head_dim)
        pool = plan.sharding(KV_POOL_AXES) if plan else None
        replicated = plan.replicated if plan else None

        def make(shape, dtype, sharding):
            return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()

        return DeviceCache(
            k_pages=make(pages_shape, self.dtype, pool),
            v_pages=make(pages_shape, self.dtype, pool),
            counts=make((rc.num_slots, c.vocab_size), jnp.int32, replicated),
            prompt_mask=make((rc.num_slots, c.vocab_size), jnp.bool_, replicated),
            last_tokens=make((rc.num_slots,), jnp.int32, replicated),
        )

    def model(self) -> nnx.Module:
        """The model bound to the placed weights, for direct forwards outside the step (tests, tools)."""
        return nnx.merge(self.graphdef, self.state)

    @property
    def kv_cache_bytes(self) -> int:
        return self.cache.k_pages.nbytes + self.cache.v_pages.nbytes

    def _run(self, batch: StepBatch) -> SamplerOutput:
        self.cache, out = self._step(self.state, self.cache, batch)
        return out

    def _load(self, slot: int, prompt: np.ndarray, output: np.ndarray) -> None:
        self.cache = self._history(self.cache, np.int32(slot), prompt, output)

    def warmup(self, on_shape: Callable[[StepShape], None] | None = None) -> None:
        """Compiles and runs every bucket once, on an all-padding batch that touches no real page.

        With several processes, each process also runs every broadcast shape once.
        """
        pad = np.full(self._history_len, self.cfg.vocab_size, np.int32)
        if multihost.is_multiprocess():
            multihost.receive_header()
            multihost.receive((pad, pad))
        self._load(self.rc.dummy_slot, pad, pad)
        for shape in self.rc.buckets.shapes:
            batch = self._empty_batch(shape)
            if multihost.is_multiprocess():
                batch = multihost.receive(batch)
            jax.block_until_ready(self._run(batch))
            if on_shape:
                on_shape(shape)

    def _empty_batch(self, shape: StepShape) -> StepBatch:
        return self._build(SchedulerOutput([], []), shape)

    def follow(self) -> None:
        """Follower processes: run the leader's device commands until it stops."""
        shapes = self.rc.buckets.shapes
        pad = np.full(self._history_len, self.cfg.vocab_size, np.int32)
        while True:
            command, arg = multihost.receive_header()
            if command == multihost.STOP:
                return
            if command == multihost.HISTORY:
                self._load(arg, *multihost.receive((pad, pad)))
            else:
                self._run(multihost.receive(self._empty_batch(shapes[arg])))

    def stop_followers(self) -> None:
        if multihost.is_multiprocess() and multihost.is_leader():
            multihost.send(multihost.STOP, 0)

    def _build(self, work: SchedulerOutput, shape: StepShape) -> StepBatch:
        return build_batch(work, shape, page_size=self.rc.page_size, pages_per_seq=self.rc.pages_per_seq,
                           dummy_slot=self.rc.dummy_slot)

    @property
    def _history_len(self) -> int:
        return self.rc.pages_per_seq * self.rc.page_size

    def _restore_history(self, req, upto: int) -> None:
        """A request admitted with cached tokens needs its skipped tokens in its penalty history."""
        prompt = np.full(self._history_len, self.cfg.vocab_size, np.int32)  # ids >= vocab are dropped
        output = prompt.copy()
        n_prompt = min(upto, req.num_prompt_tokens)
        prompt[:n_prompt] = req.prompt_token_ids[:n_prompt]
        output[:upto - n_prompt] = req.output_token_ids[:upto - n_prompt]
        if multihost.is_multiprocess():
            multihost.send(multihost.HISTORY, req.slot, (prompt, output))
        self._load(req.slot, prompt, output)

    def dispatch(self, work: SchedulerOutput) -> PendingStep:
        """Enqueues one step on the device and returns without waiting for it."""
        for sq in work.seqs:
            if sq.reset_slot and sq.start > 0 and _uses_penalties(sq.req.params):
                self._restore_history(sq.req, sq.start)
        shape = self.rc.buckets.shape_for(work.num_tokens, len(work.seqs))
        batch = self._build(work, shape)
        if multihost.is_multiprocess():
            multihost.send(multihost.STEP, self.rc.buckets.shapes.index(shape), batch)
        out = self._run(batch)
        want_lp = any(s.samples and s.req.params.logprobs is not None for s in work.seqs)
        return PendingStep(work, out, want_lp)

    @staticmethod
    def fetch(p: PendingStep) -> StepResult:
        """Reads the sampled tokens (and logprobs when asked for) back to the host: the step's one sync.

        The outputs are replicated, so this process's first copy is the whole value.
        """
        local = [x.addressable_data(0) for x in p.out] if p.want_logprobs else [p.out.tokens.addressable_data(0)]
        host = jax.device_get(local)
        return StepResult(*host) if p.want_logprobs else StepResult(host[0], None, None, None)

