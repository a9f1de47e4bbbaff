"""The step's programs, compiled ahead of time for the runner (model_runner.py): step_programs.py's pure
functions jitted once, with their donations and shardings, then compiled at warmup for every token
bucket (a sampler per row count and variant, a burst per decode-sized bucket and variant, with
speculation the verifying forward and the verifier, and a linear-attention model's commit of its state;
for prompt logprobs a block gather per bucket and one head program; for embeddings a pooling program per
bucket), or deserialized from the executable cache (executable_cache.py). The steps call only these
executables, so nothing compiles after warmup, and compiling needs the weights' and the pool's shapes
alone. XLA's memory analysis of the same programs gives the largest step's temporaries, which the pool is
sized around (kv_pool.py).
"""

from __future__ import annotations

import concurrent.futures
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from infire_jax.models.gated_delta import LINEAR_INPUTS_AXES, LinearInputs, linear_inputs_shapes
from infire_jax.runner import executable_cache
from infire_jax.runner import step_programs as programs
from infire_jax.runner.batch import DraftInputs, StepBatch, burst_inputs, draft_inputs
from infire_jax.runner.buckets import StepShape
from infire_jax.runner.device_memory import DeviceMemory
from infire_jax.sample.sampler import BRANCHING
from infire_jax.core.scheduler import SchedulerOutput
from infire_jax.runner.step_programs import StepForward, matmul_precision

# A program to compile: its name in the executable cache, the jitted function, its arguments.
ProgramSpec = tuple[str, Callable, tuple]
# A program's place among the compiled ones: (table, key), e.g. ("sampler", (rows, variant)).
ProgramKey = tuple[str, object]

TRANSFER_PAGES = 16  # pages per compiled page read or write (KV transfer between engines)


class CompiledSteps:
    def __init__(self, memory: DeviceMemory, platform: executable_cache.Platform | None = None):
        """The programs of the model in `memory`, jitted for its settings; they take its weights and
        cache as arguments, of the shapes and shardings they have (or will have) there. Their
        executables are cached for this machine, or for `platform` (a GPU compiled for elsewhere)."""
        self.memory = memory
        m, rc, plan = memory, memory.rc, memory.plan
        graphdef, precision = m.graphdef, matmul_precision(m.dtype)
        branching = rc.sampler_variants == (BRANCHING,)
        # On a mesh the sampled tokens come back replicated, so every process can read them locally.
        cache_shardings = jax.tree.map(lambda a: a.sharding, m.cache) if plan else None
        forward = functools.partial(programs.forward, graphdef, rc.attn_impl, plan, precision, rc.aux_layers)
        outs = StepForward(cache_shardings, plan.replicated, plan.replicated, None, plan.replicated) if plan else None
        self.forward = jax.jit(forward, donate_argnums=(1,), out_shardings=outs)
        # A linear-attention model's verifying forward returns its layers' inputs too, each device its heads'.
        self.linear_inputs = None
        if m.cache.linear is not None:
            self.linear_inputs = LinearInputs(*(
                jax.ShapeDtypeStruct(*s, sharding=plan.sharding(axes) if plan else None)
                for s, axes in zip(linear_inputs_shapes(m.cfg, 0, m.dtype), LINEAR_INPUTS_AXES)))
        self.verify_forward = self.forward if not (plan and self.linear_inputs) else jax.jit(
            forward, donate_argnums=(1,), out_shardings=outs._replace(linear_inputs=LinearInputs(
                *(a.sharding for a in self.linear_inputs))))
        self.samplers = {v: jax.jit(functools.partial(programs.sample_step, v), donate_argnums=(0,),
                                    out_shardings=plan.replicated if plan else None)
                         for v in rc.sampler_variants}
        self.verifier = jax.jit(functools.partial(programs.verify_step, branching),
                                donate_argnums=(0, 1), out_shardings=plan.replicated if plan else None)
        self.commit = jax.jit(functools.partial(programs.commit_linear_state, graphdef, plan), donate_argnums=(1,),
                              out_shardings=cache_shardings if plan else None)
        self.bursts = {v: jax.jit(functools.partial(programs.decode_burst, graphdef, rc.attn_impl, plan, precision, v,
                                                    rc.decode_steps, branching), donate_argnums=(1,),
                                  out_shardings=(cache_shardings, plan.replicated) if plan else None)
                       for v in rc.sampler_variants}
        self.prompt_rows = jax.jit(programs.gather_rows, out_shardings=plan.replicated if plan else None)
        self.prompt_block = jax.jit(functools.partial(programs.prompt_logprobs_block, graphdef, plan, precision,
                                                      rc.max_prompt_logprobs),
                                    out_shardings=plan.replicated if plan else None)
        self.pool = {shape: jax.jit(functools.partial(programs.pool_rows, graphdef, shape.num_rows),
                                    out_shardings=plan.replicated if plan else None)
                     for shape in rc.buckets.shapes} if rc.pooling else {}
        self.history = jax.jit(programs.load_history, donate_argnums=(0,))
        self.linear_state = {name: jax.jit(fn, donate_argnums=(0,), out_shardings=cache_shardings if plan else None)
                             for name, fn in (("save_state", programs.save_linear_state),
                                              ("restore_state", programs.restore_linear_state))}
        self.read_pages = jax.jit(programs.read_pages)
        self.write_pages = jax.jit(programs.write_pages, donate_argnums=(0,),
                                   out_shardings=cache_shardings if plan else None)
        # Compiled per bucket (and per row count and variant) by `compile`; the steps call these.
        self.compiled_forward: dict[StepShape, jax.stages.Compiled] = {}
        self.compiled_samplers: dict[tuple[int, str], jax.stages.Compiled] = {}
        self.compiled_verify_forward: dict[StepShape, jax.stages.Compiled] = {}  # speculative decoding
        self.compiled_verifiers: dict[int, jax.stages.Compiled] = {}
        self.compiled_commits: dict[StepShape, jax.stages.Compiled] = {}  # linear state after a verifier (Qwen3.5)
        self.compiled_bursts: dict[tuple[StepShape, str], jax.stages.Compiled] = {}
        self.compiled_prompt_rows: dict[StepShape, jax.stages.Compiled] = {}  # prompt logprobs' block gathers
        self.compiled_pool: dict[StepShape, jax.stages.Compiled] = {}  # embeddings (rc.pooling)
        # history, read_pages, write_pages, prompt_logprobs (the head over a block of prompt positions),
        # save_state and restore_state (the linear state's snapshots)
        self.compiled_small: dict[str, jax.stages.Compiled] = {}
        # Warm starts load the step programs without tracing them (executable_cache.py).
        self.executables = executable_cache.for_runner(repr((m.cfg, rc, str(jnp.dtype(m.dtype)), plan, graphdef)),
                                                       platform)

    # ---- the programs' arguments, as shapes -------------------------------------------------------
    def forward_spec(self, batch: StepBatch) -> ProgramSpec:
        return "forward", self.forward, (self.memory.state, self.memory.cache, batch)

    def verify_forward_spec(self, batch: StepBatch) -> ProgramSpec:
        return "forward", self.verify_forward, (self.memory.state, self.memory.cache, batch)

    def sampler_spec(self, variant: str, batch: StepBatch) -> ProgramSpec:
        c = self.memory.cache
        return f"sampler-{variant}", self.samplers[variant], (
            c.last_tokens, c.counts, c.prompt_mask, self._logits_struct(batch), batch.sampling, batch.row_slots,
            batch.sample_rows, self._mask_struct(batch))

    def burst_spec(self, variant: str, shape: StepShape, batch: StepBatch) -> ProgramSpec:
        return f"burst-{variant}", self.bursts[variant], (self.memory.state, self.memory.cache, batch,
                                                          burst_inputs(SchedulerOutput([], []), shape.num_rows))

    def verifier_spec(self, batch: StepBatch, drafts: DraftInputs) -> ProgramSpec:
        c = self.memory.cache
        return "verifier", self.verifier, (c.last_tokens, c.counts, c.prompt_mask, self._logits_struct(batch),
                                           batch.sampling, batch.row_slots, batch.sample_rows, drafts,
                                           self._mask_struct(batch))

    def _logits_struct(self, batch: StepBatch) -> jax.ShapeDtypeStruct:
        plan = self.memory.plan
        return jax.ShapeDtypeStruct((batch.logits_indices.shape[0], self.memory.cfg.vocab_size), jnp.float32,
                                    sharding=plan.replicated if plan else None)

    def _mask_struct(self, batch: StepBatch) -> jax.ShapeDtypeStruct:
        """The grammar mask: a row per logits row (K + 1 per row of a verifying step)."""
        plan = self.memory.plan
        return jax.ShapeDtypeStruct((batch.logits_indices.shape[0], self.memory.mask_words), jnp.int32,
                                    sharding=plan.replicated if plan else None)

    def _empty_drafts(self, shape: StepShape) -> DraftInputs:
        return draft_inputs(SchedulerOutput([], []), shape, self.memory.rc.num_spec)

    def bucket_specs(self, shape: StepShape, batch: StepBatch) -> dict[ProgramKey, ProgramSpec]:
        """The step programs of one bucket, by (table, key)."""
        rc = self.memory.rc
        specs = {("forward", shape): self.forward_spec(batch)}
        for variant in rc.sampler_variants:
            specs["sampler", (shape.num_rows, variant)] = self.sampler_spec(variant, batch)
        if rc.decode_steps > 1 and shape in rc.buckets.decode_shapes:
            for variant in rc.sampler_variants:
                specs["burst", (shape, variant)] = self.burst_spec(variant, shape, batch)
        if rc.num_spec:
            batch = rc.empty_batch(shape, verify=True)
            specs["verify_forward", shape] = self.verify_forward_spec(batch)
            specs["verifier", shape.num_rows] = self.verifier_spec(batch, self._empty_drafts(shape))
            if self.linear_inputs is not None:
                specs["commit", shape] = self.commit_spec(shape, batch)
        return specs

    def commit_spec(self, shape: StepShape, batch: StepBatch) -> ProgramSpec:
        m = self.memory
        inputs = LinearInputs(*(a.update(shape=(a.shape[0], shape.num_tokens, *a.shape[2:]))
                                for a in self.linear_inputs))
        rows = jax.ShapeDtypeStruct((shape.num_rows,), jnp.int32)
        return "commit-linear", self.commit, (m.state, m.cache, batch, inputs, rows, rows)

    def small_specs(self) -> dict[ProgramKey, ProgramSpec]:
        """The history program, the page programs of KV transfer, prompt logprobs' programs (a block
        gather per bucket, the head over a block) and embeddings' (a pooling program per bucket) (one
        process only)."""
        m = self.memory
        ids = jax.ShapeDtypeStruct((m.rc.history_len,), jnp.int32)
        pages = jax.ShapeDtypeStruct((TRANSFER_PAGES,), jnp.int32)
        c = m.cache
        chunk = [jax.ShapeDtypeStruct((p.shape[0], TRANSFER_PAGES, *p.shape[2:]), m.kv_dtype)
                 for p in (c.k_pages, c.v_pages)]
        args = {"history": (self.history, (c, jax.ShapeDtypeStruct((), jnp.int32), ids, ids)),
                "read_pages": (self.read_pages, (c.k_pages, c.v_pages, pages)),
                "write_pages": (self.write_pages, (c, pages, *chunk)),
                "prompt_logprobs": self.prompt_block_spec()[1:]}
        if c.linear_snapshots is not None:
            index = jax.ShapeDtypeStruct((), jnp.int32)
            args.update({name: (jitted, (c, index, index)) for name, jitted in self.linear_state.items()})
        specs = {("small", name): (name, jitted, a) for name, (jitted, a) in args.items()}
        block = jax.ShapeDtypeStruct((m.rc.prompt_logprobs_block,), jnp.int32)
        for shape in m.rc.buckets.shapes:
            hidden = self._hidden_struct(shape.num_tokens)
            specs["prompt_rows", shape] = ("prompt-rows", self.prompt_rows, (hidden, block))
            if shape in self.pool:
                tokens = [jax.ShapeDtypeStruct((shape.num_tokens,), t) for t in (jnp.float32, jnp.int32)]
                specs["pool", shape] = (f"pool-{shape.num_rows}", self.pool[shape], (m.state, hidden, *tokens))
        return specs

    def _hidden_struct(self, num_tokens: int) -> jax.ShapeDtypeStruct:
        plan = self.memory.plan
        return jax.ShapeDtypeStruct((num_tokens, self.memory.cfg.hidden_size), self.memory.dtype,
                                    sharding=plan.replicated if plan else None)

    def prompt_block_spec(self) -> ProgramSpec:
        block = self.memory.rc.prompt_logprobs_block
        targets = jax.ShapeDtypeStruct((block,), jnp.int32)
        return "prompt-logprobs", self.prompt_block, (self.memory.state, self._hidden_struct(block), targets)

    # ---- compiling --------------------------------------------------------------------------------
    def compile(self, specs: dict[ProgramKey, ProgramSpec], workers: int,
                on_shape: Callable[[StepShape], None] | None = None,
                before_compiling: Callable[[], None] | None = None) -> None:
        """Fills the tables with `specs`: deserialized where the executable cache has them, the rest
        compiled once `before_compiling` returns; `on_shape` hears of each bucket's forward."""
        tables = {"forward": self.compiled_forward, "sampler": self.compiled_samplers,
                  "verify_forward": self.compiled_verify_forward, "verifier": self.compiled_verifiers,
                  "commit": self.compiled_commits,
                  "burst": self.compiled_bursts, "small": self.compiled_small,
                  "prompt_rows": self.compiled_prompt_rows, "pool": self.compiled_pool}
        cache, done = self.executables, {}
        # XLA compiles and deserializes with the GIL released: a few threads overlap them.
        with concurrent.futures.ThreadPoolExecutor(workers, "infire-compile") as pool:
            if cache is not None:
                loads = pool.map(lambda spec: cache.load(spec[0], spec[2]), specs.values())
                done = {key: got for key, got in zip(specs, loads) if got is not None}
                if len(done) < len(specs) and before_compiling:
                    before_compiling()
            compiling = {key: pool.submit(self.executable, spec) for key, spec in specs.items() if key not in done}
            for (table, key) in specs:
                tables[table][key] = done[table, key] if (table, key) in done else compiling[table, key].result()
                if table == "forward" and on_shape:
                    on_shape(key)

    def executable(self, spec: ProgramSpec) -> jax.stages.Compiled:
        """A program compiled for its arguments: from the executable cache when it has it (nothing traced)."""
        name, jitted, args = spec
        if self.executables is None:
            return jitted.lower(*args).compile()
        return self.executables.get(name, args, lambda: jitted.lower(*args))

    @property
    def executables_loaded(self) -> int:
        """Step programs deserialized from the executable cache (not traced) so far."""
        return self.executables.loaded if self.executables else 0

    def peak_activation_bytes(self) -> int:
        """Temporaries of the largest step on one device, from XLA's memory analysis of the compiled
        forward and samplers (the larger of the two: they run one after the other)."""
        rc, vocab = self.memory.rc, self.memory.cfg.vocab_size
        shape = rc.buckets.shapes[-1]
        batch = rc.empty_batch(shape)
        peaks = [self.executable(self.forward_spec(batch)).memory_analysis().temp_size_in_bytes]
        for variant in rc.sampler_variants:
            m = self.executable(self.sampler_spec(variant, batch)).memory_analysis()
            peaks.append(m.temp_size_in_bytes + shape.num_rows * vocab * 4)
        if rc.decode_steps > 1:  # the widest burst: its temporaries are one step's, looped
            shape = rc.buckets.decode_shapes[-1]
            batch = rc.empty_batch(shape)
            peaks += [self.executable(self.burst_spec(v, shape, batch)).memory_analysis().temp_size_in_bytes
                      for v in rc.sampler_variants]
        peaks.append(self.executable(self.prompt_block_spec()).memory_analysis().temp_size_in_bytes)
        if rc.num_spec:
            shape = rc.buckets.shapes[-1]
            batch = rc.empty_batch(shape, verify=True)
            peaks.append(self.executable(self.verify_forward_spec(batch)).memory_analysis().temp_size_in_bytes)
            m = self.executable(self.verifier_spec(batch, self._empty_drafts(shape))).memory_analysis()
            peaks.append(m.temp_size_in_bytes + batch.logits_indices.shape[0] * vocab * 4)
            if self.linear_inputs is not None:  # the commit, and the step's inputs it reads
                spec = self.commit_spec(shape, batch)
                inputs = sum(a.size * a.dtype.itemsize for a in spec[2][3])
                peaks.append(self.executable(spec).memory_analysis().temp_size_in_bytes + inputs)
        return max(peaks)
