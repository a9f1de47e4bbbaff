"""The device side: holds the weights and the KV pool, compiles and runs the step's programs
(step_programs.py). The only module with device arrays.

A step is two jitted calls, launched back to back without waiting: the forward (embed, all decoder
layers over the paged pool, the LM head at each row's last token), compiled once per token bucket,
and the sampler, compiled once per row count and sampler variant (see sampler.py). Keeping the
sampler apart means its variants do not multiply the forward's compilations. The pool, the
per-slot sampling history and the last sampled tokens are donated, so each step updates them in
place; the logits stay on the device between the two calls.

A decode burst (scheduler.py) is one program instead, compiled per decode-sized bucket and
sampler variant: up to `decode_steps` forwards and samplers in a device loop
(step_programs.decode_burst), read back once.

With speculative decoding, a step in which some row carries proposed tokens is a verifying step:
a forward with logits at every proposed position (one more program per bucket), then the
verifier (speculative/verify.py) in place of the sampler.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array

from infire_jax import executable_cache, multihost
from infire_jax import step_programs as programs
from infire_jax.batch import (BurstInputs, DraftInputs, StepBatch, build_batch, burst_inputs, draft_inputs,
                              grammar_bitmask)
from infire_jax.buckets import Buckets, StepShape
from infire_jax.models.config import ModelConfig
from infire_jax.models.kv_entry import kv_entry
from infire_jax.models.panels import kernel_layout
from infire_jax.sampler import BRANCHING, SamplerOutput, choose_variant
from infire_jax.scheduler import SchedulerOutput
from infire_jax.speculative.verify import VerifyOutput
from infire_jax.step_programs import BurstOutput, DeviceCache, StepForward, matmul_precision
from pallas_kernels.kv_quant import is_fp8
from pallas_kernels.metadata import NULL_PAGE
from pallas_kernels.reference import pool_storage_dtype
from sharding.plan import ShardPlan

# A program to compile: its name in the executable cache, the jitted function, its arguments.
ProgramSpec = tuple[str, Callable, tuple]


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    page_size: int
    num_pages: int
    max_model_len: int
    max_num_seqs: int
    buckets: Buckets
    attn_impl: str = "reference"
    # Compiled sampler variants: (BRANCHING,) where conditionals are free (CPU), else the branch-free ones.
    sampler_variants: tuple[str, ...] = (BRANCHING,)
    num_spec: int = 0  # speculative decoding: proposed tokens a row may carry (0: off)
    aux_layers: tuple[int, ...] | None = None  # EAGLE-3: the target states the forward also returns
    decode_steps: int = 1  # most steps of a decode burst (1: no bursts)
    kv_cache_dtype: str | None = None  # the KV pool's dtype (None: the model's); float8_e4m3fn takes scales

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
    return kv_entry(cfg).bytes_per_page(cfg.num_layers, page_size, jnp.dtype(dtype))


def _host_copy(a: np.ndarray) -> np.ndarray:
    """An array that owns its memory: on CPU, device_get may alias the device buffer about to be freed."""
    return a if a.base is None and a.flags.owndata else np.array(a, copy=True)


def _uses_penalties(p) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0 or p.frequency_penalty != 0


TRANSFER_PAGES = 16  # pages per compiled page read or write (KV transfer between engines)


def _padded_pages(pages: list[int]) -> np.ndarray:
    out = np.full(TRANSFER_PAGES, NULL_PAGE, np.int32)
    out[:len(pages)] = pages
    return out


class PendingStep(NamedTuple):
    work: SchedulerOutput
    out: SamplerOutput | VerifyOutput | BurstOutput  # device arrays, not yet read back
    want_logprobs: bool
    drafts: Array | None = None  # [S, k] proposals the step's observer made (EAGLE-3), read back with the tokens


class StepResult(NamedTuple):
    """Each row's new tokens: [rows, P] (P = 1, K + 1 when verifying, or a burst's steps), the first
    num_tokens valid."""

    tokens: np.ndarray  # [rows, P] int32
    num_tokens: np.ndarray  # [rows] int32
    logprob: np.ndarray | None  # [rows, P]
    top_ids: np.ndarray | None  # [rows, P, MAX_LOGPROBS]
    top_logprobs: np.ndarray | None
    drafts: np.ndarray | None = None  # [rows, k]


class ModelRunner:
    def __init__(self, cfg: ModelConfig, graphdef: nnx.GraphDef, state: nnx.State, rc: RunnerConfig,
                 *, dtype, plan: ShardPlan | None = None):
        """`cfg` is the placed model's config (a plan's effective config on a mesh); `state` may be
        the weights' shapes alone (attach_weights gives the weights). The runner owns the weights
        it is given: on CPU it may repack some for its matmul kernel (models/panels.py)."""
        self.cfg = cfg
        self.rc = rc
        self.plain_graphdef = graphdef  # the layout `attach_weights` receives
        self.graphdef, self.state = kernel_layout(graphdef, state, plan=plan)
        graphdef = self.graphdef
        self.dtype = dtype
        self.plan = plan
        self._host_weights: tuple[nnx.State, nnx.State] | None = None  # a host copy and the shardings, once offloaded
        # Called with every step (its plan, batch, forward and sampled tokens) once it is launched: a
        # draft model or an EAGLE-3 head keeps its KV in step with the target's (speculative/). What
        # it returns (EAGLE-3's next proposals) is read back with the step's tokens.
        self.observer: Callable[[SchedulerOutput, StepBatch, StepForward, SamplerOutput | VerifyOutput],
                                Array | None] | None = None
        self.resident = True
        self.kv_dtype = jnp.dtype(rc.kv_cache_dtype or dtype)
        # An fp8 pool's [k_scale, v_scale] per (layer, kv head) (pallas_kernels/kv_quant.py): kept on the
        # host too, so a pool allocated again (restore, resize_pool) gets them back.
        self.kv_scales = (np.ones((cfg.num_layers, 2, kv_entry(cfg).heads), np.float32)
                          if is_fp8(self.kv_dtype) else None)
        self.cache = self._allocate_cache()
        # On a mesh the sampled tokens come back replicated, so every process can read them locally.
        cache_shardings = jax.tree.map(lambda a: a.sharding, self.cache) if plan else None
        self._forward = jax.jit(functools.partial(programs.forward, graphdef, rc.attn_impl, plan, matmul_precision(dtype),
                                                  rc.aux_layers), donate_argnums=(1,),
                                out_shardings=StepForward(cache_shardings, plan.replicated, plan.replicated,
                                                          None) if plan else None)
        self._samplers = {v: jax.jit(functools.partial(programs.sample_step, v), donate_argnums=(0,),
                                     out_shardings=plan.replicated if plan else None)
                          for v in rc.sampler_variants}
        self._verifier = jax.jit(functools.partial(programs.verify_step, rc.sampler_variants == (BRANCHING,)),
                                 donate_argnums=(0, 1), out_shardings=plan.replicated if plan else None)
        self._bursts = {v: jax.jit(functools.partial(programs.decode_burst, graphdef, rc.attn_impl, plan,
                                                     matmul_precision(dtype), v, rc.decode_steps,
                                                     rc.sampler_variants == (BRANCHING,)), donate_argnums=(1,),
                                   out_shardings=(cache_shardings, plan.replicated) if plan else None)
                        for v in rc.sampler_variants}
        # The step programs, compiled ahead of time per bucket (and per row count and variant): the
        # steps call these, so nothing can compile after warmup, and warmup needs no weights.
        self._compiled_forward: dict[StepShape, jax.stages.Compiled] = {}
        self._compiled_samplers: dict[tuple[int, str], jax.stages.Compiled] = {}
        self._compiled_verify_forward: dict[StepShape, jax.stages.Compiled] = {}  # speculative decoding
        self._compiled_verifiers: dict[int, jax.stages.Compiled] = {}
        self._compiled_bursts: dict[tuple[StepShape, str], jax.stages.Compiled] = {}
        self._compiled_small: dict[str, jax.stages.Compiled] = {}  # history, read_pages, write_pages
        # Structured outputs: a step with no constrained row passes its row bucket's all-allowed
        # grammar mask, kept on the device, instead of copying one (structured/, sampler.py).
        self.mask_words = -(-cfg.vocab_size // 32)
        self._all_allowed: dict[int, jax.Array | None] = {}  # None while offloaded
        # Warm starts load the step programs without tracing them (executable_cache.py).
        self._executables = executable_cache.for_runner(repr((cfg, rc, str(jnp.dtype(dtype)), plan, graphdef)))
        self._history = jax.jit(programs.load_history, donate_argnums=(0,))
        self._read_pages = jax.jit(programs.read_pages)
        self._write_pages = jax.jit(programs.write_pages, donate_argnums=(0,),
                                    out_shardings=cache_shardings if plan else None)

    def _allocate_cache(self) -> DeviceCache:
        """The pool is split like the kv heads and layers; the per-slot history is replicated."""
        self._cache_program()
        return self._new_cache(self.kv_scales)

    def _cache_program(self) -> None:
        """The program that allocates an empty cache of the current sizes (kept, so a model coming back
        to the device allocates its pool without compiling), and the cache as shapes."""
        c, rc, plan = self.cfg, self.rc, self.plan
        entry = kv_entry(c)
        pool = plan.sharding(entry.pool_axes) if plan else None
        replicated = plan.replicated if plan else None

        stored = pool_storage_dtype(self.kv_dtype, rc.attn_impl)
        shapes = DeviceCache(
            k_pages=((c.num_layers, rc.num_pages, rc.page_size, entry.heads, entry.k_dim), stored),
            v_pages=((c.num_layers, rc.num_pages, rc.page_size, entry.heads, entry.v_dim), stored),
            counts=((rc.num_slots, c.vocab_size), jnp.int32), prompt_mask=((rc.num_slots, c.vocab_size), jnp.bool_),
            last_tokens=((rc.num_slots,), jnp.int32))
        shardings = DeviceCache(pool, pool, replicated, replicated, replicated,
                                None if self.kv_scales is None else replicated)
        # Kept, so a model coming back to the device (restore) allocates its pool without compiling;
        # an fp8 pool's scales come from their host copy (set_kv_scales).
        self._new_cache = jax.jit(lambda scales: DeviceCache(*(jnp.zeros(shape, dtype) for shape, dtype in shapes[:5]),
                                                             kv_scales=scales),
                                  out_shardings=shardings if plan else None)
        # Without a plan the allocated arrays are uncommitted: shapes without a sharding lower alike.
        scales = None if self.kv_scales is None else jax.ShapeDtypeStruct(self.kv_scales.shape, jnp.float32,
                                                                          sharding=replicated)
        self._cache_shapes = DeviceCache(*(jax.ShapeDtypeStruct(shape, dtype, sharding=s)
                                           for (shape, dtype), s in zip(shapes[:5], shardings[:5])), kv_scales=scales)

    def set_kv_scales(self, scales: np.ndarray) -> None:
        """An fp8 pool's scales, [layers, 2, kv heads] float32 (k, v); only before any page is written."""
        if self.kv_scales is None or scales.shape != self.kv_scales.shape:
            raise ValueError(f"kv scales of shape {scales.shape} for a {self.kv_dtype} pool "
                             f"(expected {None if self.kv_scales is None else self.kv_scales.shape})")
        self.kv_scales = np.asarray(scales, np.float32)
        self.cache = self.cache._replace(kv_scales=jax.device_put(self.kv_scales,
                                                                  self.plan.replicated if self.plan else None))

    def resize_pool(self, num_pages: int, allocate: bool = True) -> None:
        """Frees the KV pool and sizes it to `num_pages` (before warmup: the steps do not depend on it).

        With `allocate=False` the pool stays shapes alone until `allocate_pool`, so that the warmup
        compiles with the pool's memory still free: on a GPU, XLA's autotuning takes scratch memory
        (1.97 GiB at once for the 8B model), which a pool filling the allocator's share left no
        room for (kv_pool.py)."""
        self.rc = dataclasses.replace(self.rc, num_pages=num_pages)
        for a in jax.tree.leaves(self.cache):
            a.delete()
        if allocate:
            self.cache = self._allocate_cache()
        else:
            self._cache_program()
            self.cache = self._cache_shapes

    def allocate_pool(self) -> None:
        """Allocates the cache that `resize_pool(..., allocate=False)` left as shapes."""
        self.cache = jax.block_until_ready(self._new_cache(self.kv_scales))

    def offload(self) -> int:
        """Frees the weights, the KV pool, the per-slot state and the all-allowed grammar masks on the
        device (hot standby: another model takes the device); returns the weight bytes. The weights
        never change, so the host copy made the first time serves every later offload: only that
        one copies device to host. Nothing of the model stays on the device: a buffer left behind
        the freed pool would split the free space that the next model's pool needs in one piece."""
        if multihost.is_multiprocess():
            raise RuntimeError("models cannot leave the device across several processes")
        if self._host_weights is None:
            # An uncommitted array (one device, no explicit placement) comes back uncommitted: the
            # compiled steps were specialized to that, and a committed one would make them recompile.
            shardings = jax.tree.map(lambda a: a.sharding if a.committed else None, self.state)
            self._host_weights = (jax.tree.map(_host_copy, jax.device_get(self.state)), shardings)
        for a in jax.tree.leaves(self.state) + jax.tree.leaves(self.cache) + list(self._all_allowed.values()):
            a.delete()
        self.state, self.cache, self.resident = None, None, False
        self._all_allowed = dict.fromkeys(self._all_allowed)
        return self.weight_bytes

    def restore(self) -> int:
        """Places the weights back on their shardings and allocates an empty pool: the compiled steps
        see the same shapes and shardings, so nothing recompiles. Returns the weight bytes placed.

        If the device runs out of memory meanwhile, what was placed is freed again and the error
        (jax's RESOURCE_EXHAUSTED) is raised: the model stays off the device."""
        host, shardings = self._host_weights
        placed: list[jax.Array] = []

        def put(x: np.ndarray, sharding) -> jax.Array:
            placed.append(jax.device_put(x, sharding))
            return placed[-1]

        try:
            state = jax.block_until_ready(jax.tree.map(put, host, shardings, is_leaf=lambda x: x is None))
            cache = jax.block_until_ready(self._new_cache(self.kv_scales))
            placed += jax.tree.leaves(cache)
            for rows in self._all_allowed:
                self._put_all_allowed(rows)
                placed.append(self._all_allowed[rows])
        except BaseException:
            for a in placed:
                a.delete()
            self._all_allowed = dict.fromkeys(self._all_allowed)
            raise
        self.state, self.cache, self.resident = state, cache, True
        return self.weight_bytes

    def _put_all_allowed(self, rows: int) -> None:
        self._all_allowed[rows] = jax.device_put(np.full((rows, self.mask_words), -1, np.int32),
                                                 self.plan.replicated if self.plan else None)

    @property
    def weight_bytes(self) -> int:
        return sum(a.nbytes for a in jax.tree.leaves(self.state if self.resident else self._host_weights[0]))

    def peak_activation_bytes(self) -> int:
        """Temporaries of the largest step on one device, from XLA's memory analysis of the compiled
        forward and samplers (the larger of the two: they run one after the other)."""
        shape = self.rc.buckets.shapes[-1]
        batch = self._empty_batch(shape)
        peaks = [self._executable(self._forward_spec(batch)).memory_analysis().temp_size_in_bytes]
        for variant in self.rc.sampler_variants:
            m = self._executable(self._sampler_spec(variant, batch)).memory_analysis()
            peaks.append(m.temp_size_in_bytes + shape.num_rows * self.cfg.vocab_size * 4)
        if self.rc.decode_steps > 1:  # the widest burst: its temporaries are one step's, looped
            shape = self.rc.buckets.decode_shapes[-1]
            batch = self._empty_batch(shape)
            peaks += [self._executable(self._burst_spec(v, shape, batch)).memory_analysis().temp_size_in_bytes
                      for v in self.rc.sampler_variants]
        if self.rc.num_spec:
            shape = self.rc.buckets.shapes[-1]
            batch = self._empty_batch(shape, verify=True)
            peaks.append(self._executable(self._forward_spec(batch)).memory_analysis().temp_size_in_bytes)
            m = self._executable(self._verifier_spec(batch, self._empty_drafts(shape))).memory_analysis()
            peaks.append(m.temp_size_in_bytes + batch.logits_indices.shape[0] * self.cfg.vocab_size * 4)
        return max(peaks)

    def _executable(self, spec: ProgramSpec) -> jax.stages.Compiled:
        """A program compiled for its arguments: from the executable cache when it has it (nothing traced)."""
        name, jitted, args = spec
        if self._executables is None:
            return jitted.lower(*args).compile()
        return self._executables.get(name, args, lambda: jitted.lower(*args))

    @property
    def executables_loaded(self) -> int:
        """Step programs deserialized from the executable cache (not traced) so far."""
        return self._executables.loaded if self._executables else 0

    def _forward_spec(self, batch: StepBatch) -> ProgramSpec:
        return "forward", self._forward, (self.state, self.cache, batch)

    def _sampler_spec(self, variant: str, batch: StepBatch) -> ProgramSpec:
        c = self.cache
        return f"sampler-{variant}", self._samplers[variant], (
            c.last_tokens, c.counts, c.prompt_mask, self._logits_struct(batch), batch.sampling, batch.row_slots,
            batch.sample_rows, self._mask_struct(batch))

    def _burst_spec(self, variant: str, shape: StepShape, batch: StepBatch) -> ProgramSpec:
        return f"burst-{variant}", self._bursts[variant], (self.state, self.cache, batch,
                                                           burst_inputs(SchedulerOutput([], []), shape.num_rows))

    def _logits_struct(self, batch: StepBatch) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((batch.logits_indices.shape[0], self.cfg.vocab_size), jnp.float32,
                                    sharding=self.plan.replicated if self.plan else None)

    def _mask_struct(self, batch: StepBatch) -> jax.ShapeDtypeStruct:
        """The grammar mask: a row per logits row (K + 1 per row of a verifying step)."""
        return jax.ShapeDtypeStruct((batch.logits_indices.shape[0], self.mask_words), jnp.int32,
                                    sharding=self.plan.replicated if self.plan else None)

    def _verifier_spec(self, batch: StepBatch, drafts: DraftInputs) -> ProgramSpec:
        c = self.cache
        return "verifier", self._verifier, (c.last_tokens, c.counts, c.prompt_mask, self._logits_struct(batch),
                                            batch.sampling, batch.row_slots, batch.sample_rows, drafts,
                                            self._mask_struct(batch))

    def _programs(self, shape: StepShape, batch: StepBatch) -> dict[tuple[str, object], ProgramSpec]:
        """The step programs of one bucket, by (table, key)."""
        for rows in (shape.num_rows, shape.num_rows * (self.rc.num_spec + 1)):  # plain, verifying steps
            if rows not in self._all_allowed:
                self._put_all_allowed(rows)
        specs = {("forward", shape): self._forward_spec(batch)}
        for variant in self.rc.sampler_variants:
            specs["sampler", (shape.num_rows, variant)] = self._sampler_spec(variant, batch)
        if self.rc.decode_steps > 1 and shape in self.rc.buckets.decode_shapes:
            for variant in self.rc.sampler_variants:
                specs["burst", (shape, variant)] = self._burst_spec(variant, shape, batch)
        if self.rc.num_spec:
            batch = self._empty_batch(shape, verify=True)
            specs["verify_forward", shape] = self._forward_spec(batch)
            specs["verifier", shape.num_rows] = self._verifier_spec(batch, self._empty_drafts(shape))
        return specs

    def model(self) -> nnx.Module:
        """The model bound to the placed weights, for direct forwards outside the step (tests, tools)."""
        return nnx.merge(self.graphdef, self.state)

    @property
    def kv_cache_bytes(self) -> int:
        return self.cache.k_pages.nbytes + self.cache.v_pages.nbytes

    def _run(self, shape: StepShape, batch: StepBatch, variant: str,
             grammar_mask: np.ndarray | None = None) -> tuple[StepForward, SamplerOutput]:
        """Launches the bucket's compiled forward and sampler; neither waits for the device."""
        fwd = self._compiled_forward[shape](self.state, self.cache, batch)
        cache = fwd.cache
        mask = self._all_allowed[shape.num_rows] if grammar_mask is None else grammar_mask
        last, out = self._compiled_samplers[shape.num_rows, variant](
            cache.last_tokens, cache.counts, cache.prompt_mask, fwd.logits, batch.sampling, batch.row_slots,
            batch.sample_rows, mask)
        self.cache = cache._replace(last_tokens=last)
        return fwd, out

    def _run_verify(self, shape: StepShape, batch: StepBatch, drafts: DraftInputs,
                    grammar_mask: np.ndarray | None) -> tuple[StepForward, VerifyOutput]:
        """Launches a verifying step: the forward with logits at every proposed position, then the verifier."""
        fwd = self._compiled_verify_forward[shape](self.state, self.cache, batch)
        cache = fwd.cache
        mask = self._all_allowed[batch.logits_indices.shape[0]] if grammar_mask is None else grammar_mask
        last, counts, out = self._compiled_verifiers[shape.num_rows](
            cache.last_tokens, cache.counts, cache.prompt_mask, fwd.logits, batch.sampling, batch.row_slots,
            batch.sample_rows, drafts, mask)
        self.cache = cache._replace(last_tokens=last, counts=counts)
        return fwd, out

    def _run_burst(self, shape: StepShape, batch: StepBatch, burst: BurstInputs, variant: str) -> BurstOutput:
        """Launches a decode burst; it does not wait for the device."""
        self.cache, out = self._compiled_bursts[shape, variant](self.state, self.cache, batch, burst)
        return out

    def read_pages(self, pages: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """The KV of `pages`, [L, len(pages), page_size, heads, dim] each (models/kv_entry.py), on the
        host (in chunks of TRANSFER_PAGES: one compiled shape)."""
        chunks = [pages[i:i + TRANSFER_PAGES] for i in range(0, len(pages), TRANSFER_PAGES)]
        read = self._compiled_small["read_pages"]
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
            self.cache = self._compiled_small["write_pages"](self.cache, _padded_pages(chunk), kc, vc)

    def _command(self, shape: StepShape, variant: str) -> int:
        """A step's (bucket, sampler variant) as one integer, for the multi-process header."""
        return self.rc.buckets.shapes.index(shape) * len(self.rc.sampler_variants) + \
            self.rc.sampler_variants.index(variant)

    def _load(self, slot: int, prompt: np.ndarray, output: np.ndarray) -> None:
        self.cache = self._compiled_small.get("history", self._history)(self.cache, np.int32(slot), prompt, output)

    def _small_programs(self) -> dict[tuple[str, object], ProgramSpec]:
        """The history program, and the page programs of KV transfer (one process only)."""
        ids = jax.ShapeDtypeStruct((self._history_len,), jnp.int32)
        pages = jax.ShapeDtypeStruct((TRANSFER_PAGES,), jnp.int32)
        c = self.cache
        chunk = [jax.ShapeDtypeStruct((p.shape[0], TRANSFER_PAGES, *p.shape[2:]), self.kv_dtype)
                 for p in (c.k_pages, c.v_pages)]
        args = {"history": (self._history, (c, jax.ShapeDtypeStruct((), jnp.int32), ids, ids)),
                "read_pages": (self._read_pages, (c.k_pages, c.v_pages, pages)),
                "write_pages": (self._write_pages, (c, pages, *chunk))}
        return {("small", name): (name, jitted, a) for name, (jitted, a) in args.items()}

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
        specs: dict[tuple[str, object], ProgramSpec] = {}
        if multihost.is_multiprocess():
            pad = np.full(self._history_len, self.cfg.vocab_size, np.int32)
            multihost.receive_header()
            multihost.receive((pad, pad))
            self._load(self.rc.dummy_slot, pad, pad)
        else:
            specs.update(self._small_programs())
        for shape in self.rc.buckets.shapes:
            batch = self._empty_batch(shape)
            if multihost.is_multiprocess():
                batch = multihost.receive(batch)
                if self.rc.decode_steps > 1 and shape in self.rc.buckets.decode_shapes:
                    multihost.receive(self._empty_burst(shape))
            for key, spec in self._programs(shape, batch).items():
                specs.setdefault(key, spec)  # a sampler serves every bucket of its row count
        tables = {"forward": self._compiled_forward, "sampler": self._compiled_samplers,
                  "verify_forward": self._compiled_verify_forward, "verifier": self._compiled_verifiers,
                  "burst": self._compiled_bursts, "small": self._compiled_small}
        cache, done = self._executables, {}
        # XLA compiles and deserializes with the GIL released: a few threads overlap them.
        workers = 1 if multihost.is_multiprocess() else min(4, os.cpu_count() or 1)
        with concurrent.futures.ThreadPoolExecutor(workers, "infire-compile") as pool:
            if cache is not None:
                loads = pool.map(lambda spec: cache.load(spec[0], spec[2]), specs.values())
                done = {key: got for key, got in zip(specs, loads) if got is not None}
                if len(done) < len(specs) and before_compiling:
                    before_compiling()
            compiling = {key: pool.submit(self._executable, spec) for key, spec in specs.items() if key not in done}
            for (table, key) in specs:
                tables[table][key] = done[table, key] if (table, key) in done else compiling[table, key].result()
                if table == "forward" and on_shape:
                    on_shape(key)

    def attach_weights(self, state: nnx.State) -> None:
        """The weights, once read, for a runner built (and warmed up) on their shapes alone."""
        _, state = kernel_layout(self.plain_graphdef, state, plan=self.plan)
        want = jax.tree.map(lambda a: (a.shape, a.dtype), self.state)
        got = jax.tree.map(lambda a: (a.shape, a.dtype), state)
        if jax.tree.structure(want) != jax.tree.structure(got) or want != got:
            raise RuntimeError("the loaded weights do not match the shapes the steps were compiled for")
        self.state = state

    def _empty_batch(self, shape: StepShape, verify: bool = False) -> StepBatch:
        return self._build(SchedulerOutput([], []), shape, verify)

    def empty_batches(self) -> list[StepBatch]:
        """A padding-only batch of every token bucket (to compile programs that take step batches)."""
        return [self._empty_batch(shape) for shape in self.rc.buckets.shapes]

    def _empty_burst(self, shape: StepShape) -> tuple[StepBatch, BurstInputs]:
        return self._empty_batch(shape), burst_inputs(SchedulerOutput([], []), shape.num_rows)

    def _empty_drafts(self, shape: StepShape) -> DraftInputs:
        return draft_inputs(SchedulerOutput([], []), shape, self.rc.num_spec)

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
                shape, variant = divmod(arg, len(self.rc.sampler_variants))
                shape, variant = shapes[shape], self.rc.sampler_variants[variant]
                if command == multihost.BURST:
                    self._run_burst(shape, *multihost.receive(self._empty_burst(shape)), variant)
                else:
                    self._run(shape, multihost.receive(self._empty_batch(shape)), variant)

    def stop_followers(self) -> None:
        if multihost.is_multiprocess() and multihost.is_leader():
            multihost.send(multihost.STOP, 0)

    def _build(self, work: SchedulerOutput, shape: StepShape, verify: bool = False) -> StepBatch:
        return build_batch(work, shape, page_size=self.rc.page_size, pages_per_seq=self.rc.pages_per_seq,
                           dummy_slot=self.rc.dummy_slot, num_spec=self.rc.num_spec if verify else 0)

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
        want_lp = any(s.samples and s.req.params.logprobs is not None for s in work.seqs)
        if work.is_burst:  # no grammar, no proposals, no observer (the scheduler and the engine check)
            batch = self._build(work, shape)
            burst = burst_inputs(work, shape.num_rows)
            variant = choose_variant(batch.sampling, self.rc.sampler_variants)
            if multihost.is_multiprocess():
                multihost.send(multihost.BURST, self._command(shape, variant), (batch, burst))
            return PendingStep(work, self._run_burst(shape, batch, burst, variant), want_lp)
        if any(s.drafts for s in work.seqs):  # one process only (the engine checks)
            mask = grammar_bitmask(work, shape.num_rows, self.mask_words, self.rc.num_spec + 1)
            batch = self._build(work, shape, verify=True)
            fwd, out = self._run_verify(shape, batch, draft_inputs(work, shape, self.rc.num_spec), mask)
        else:
            mask = grammar_bitmask(work, shape.num_rows, self.mask_words)
            batch = self._build(work, shape)
            variant = choose_variant(batch.sampling, self.rc.sampler_variants)
            if multihost.is_multiprocess():
                multihost.send(multihost.STEP, self._command(shape, variant), batch)
            fwd, out = self._run(shape, batch, variant, mask)
        drafts = self.observer(work, batch, fwd, out) if self.observer is not None else None
        return PendingStep(work, out, want_lp, drafts)

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
        host = jax.device_get([x.addressable_data(0) for x in wanted])
        drafts = host.pop() if p.drafts is not None else None
        tokens = host.pop(0)
        if several:
            num = host.pop(0)
        else:  # one token per row
            tokens, num = tokens[:, None], np.ones(len(tokens), np.int32)
            host = [host[0][:, None], host[1][:, None], host[2][:, None]] if host else host
        return StepResult(tokens, num, *(host or (None, None, None)), drafts)

