"""The compiled step holds nothing that makes the host wait for the device.

On XLA GPU a data-dependent `conditional` copies its predicate to the host, and so does the
condition of a `while` whose trip count is not known at compile time: the launch of the step then
blocks until the device reaches it, and host work stops overlapping device work. These tests
inspect the programs the engine runs on a GPU (Pallas attention, branch-free sampler variants)
and pin float32 dots to full precision. They run without the CPU-only FFI kernels
(pallas_kernels/cpu_kernels.py), as a GPU does.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from infire_jax.runner.buckets import Buckets
from infire_jax.models.config import ModelConfig
from infire_jax.models.registry import build_state, drawn_weights
from infire_jax.quant.resident import quantize_channels
from infire_jax.runner.model_runner import ModelRunner
from infire_jax.runner.config import RunnerConfig
from infire_jax.sample.sampler import BRANCH_FREE_VARIANTS, BRANCHING
from pallas_kernels import cpu_kernels, placement

DENSE = ModelConfig(architecture="llama", vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=8, num_kv_heads=2, head_dim=32)
MOE = ModelConfig(architecture="qwen3_moe", vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=8, num_kv_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=32, qk_norm=True)


@pytest.fixture(autouse=True)
def _no_cpu_kernel(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "on_cpu", lambda: False)


def make_runner(cfg: ModelConfig, attn_impl: str, variants=BRANCH_FREE_VARIANTS, dtype=jnp.float32,
                compress: tuple[str, ...] = (), decode_steps: int = 1, int8: bool = False) -> ModelRunner:
    weights, layouts = quantize_channels(drawn_weights(cfg, dtype), "int8") if int8 else (None, None)
    graphdef, state = build_state(cfg, weights, dtype, seed=0, compress=compress, quantized=layouts)
    rc = RunnerConfig(page_size=8, num_pages=24, max_model_len=64, max_num_seqs=4, buckets=Buckets((4, 32), 4),
                      attn_impl=attn_impl, sampler_variants=variants, decode_steps=decode_steps)
    return ModelRunner(cfg, graphdef, state, rc, dtype=dtype)


def primitives(jaxpr, skip=("pallas_call",)) -> set[str]:
    """Every primitive in a jaxpr and its sub-jaxprs, except inside kernels (their loops run on the GPU)."""
    found = set()
    for eqn in jaxpr.eqns:
        found.add(eqn.primitive.name)
        if eqn.primitive.name in skip:
            continue
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found |= primitives(sub, skip)
    return found


def kernel_names(jaxpr) -> list[str]:
    """The names of the Pallas kernels and FFI calls a jaxpr makes, in its sub-jaxprs (the layer scan) too."""
    names = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            names.append(eqn.params["name"])
        elif eqn.primitive.name == "ffi_call":
            names.append(eqn.params["target_name"])
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            names += kernel_names(sub)
    return names


def forward_jaxpr(runner: ModelRunner, rows_tokens: int):
    shape = next(s for s in runner.rc.buckets.shapes if s.num_tokens == rows_tokens)
    batch = runner.rc.empty_batch(shape)
    return jax.make_jaxpr(runner.steps.forward)(runner.state, runner.cache, batch).jaxpr


@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])
def test_gpu_forward_has_no_conditional_or_data_dependent_loop(cfg):
    """The GPU forward (Pallas attention): fixed-trip loops are scans; there is no cond and no while.
    The MoE tile loop runs a static bound of trips."""
    runner = make_runner(cfg, "pallas")
    for tokens in (4, 32):  # a decode-sized and a prefill-sized bucket
        prims = primitives(forward_jaxpr(runner, tokens))
        assert "pallas_call" in prims
        assert not prims & {"cond", "while"}, prims & {"cond", "while"}


@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])
def test_gpu_forward_with_the_quantized_kernels_has_no_conditional_or_data_dependent_loop(cfg, monkeypatch):
    """int8 layer weights read by the quantized matmul, experts by the grouped one (their tile
    bounds and row order computed on the device, by scans of static length)."""
    monkeypatch.setenv("INFIRE_JAX_QUANT_MATMUL", "pallas")
    monkeypatch.setenv("INFIRE_JAX_MOE_GROUPED", "pallas")
    runner = make_runner(cfg, "pallas", int8=True)
    for tokens in (4, 32):
        jaxpr = forward_jaxpr(runner, tokens)
        assert kernel_names(jaxpr).count("quant_matmul") == 4, kernel_names(jaxpr)
        assert not primitives(jaxpr) & {"cond", "while"}, primitives(jaxpr) & {"cond", "while"}


def burst_jaxpr(runner: ModelRunner, variant: str):
    shape = runner.rc.buckets.decode_shapes[0]
    spec = runner.steps.burst_spec(variant, shape, runner.rc.empty_batch(shape))
    return jax.make_jaxpr(spec[1])(*spec[2]).jaxpr


@pytest.mark.parametrize("variant", BRANCH_FREE_VARIANTS)
def test_gpu_decode_burst_loops_a_known_number_of_times(variant):
    """A GPU burst runs all its steps (a scan): no while whose predicate the host would wait for,
    and no conditional, whichever sampler variant it holds."""
    runner = make_runner(DENSE, "pallas", decode_steps=4)
    prims = primitives(burst_jaxpr(runner, variant))
    assert {"pallas_call", "scan"} <= prims
    assert not prims & {"cond", "while"}, prims & {"cond", "while"}


def test_gpu_decode_burst_launches_the_decode_kernel_alone():
    """Every row of a burst is one token, a fact of its program: one attention kernel a layer, the
    decode one (the prefill kernel took 0.26 ms of each H100 decode step for nothing); a forward of
    the same bucket, which may hold a prompt chunk, keeps both."""
    runner = make_runner(DENSE, "pallas", decode_steps=4)
    both = ["write_kv_pages", "paged_decode_attention", "paged_prefill_attention"]
    assert kernel_names(forward_jaxpr(runner, 4)) == both  # the layer scan's body, once
    assert kernel_names(burst_jaxpr(runner, BRANCH_FREE_VARIANTS[0])) == both[:2]
    assert kernel_names(forward_jaxpr(runner, 4)) == both  # traced again after the burst: its own program


def test_cpu_decode_burst_ends_when_every_row_has_stopped():
    """On CPU the host runs the loop anyway, so the burst is a while that ends once no row is active."""
    runner = make_runner(DENSE, "reference", variants=(BRANCHING,), decode_steps=4)
    assert "while" in primitives(burst_jaxpr(runner, BRANCHING))


def test_decode_burst_converts_no_whole_weight_once_a_burst():
    """Work on the weights stays inside the loop, as in one step: XLA CPU gathers a bfloat16
    embedding by converting it to float32, which one step fuses into the gather (the rows alone)
    but a loop would hoist whole, writing the table's float32 copy every burst."""
    runner = make_runner(DENSE, "reference", variants=(BRANCHING,), dtype=jnp.bfloat16, decode_steps=4)
    shape = runner.rc.buckets.decode_shapes[0]
    name, jitted, args = runner.steps.burst_spec(BRANCHING, shape, runner.rc.empty_batch(shape))
    table = f"f32[{DENSE.vocab_size},{DENSE.hidden_size}]"
    made = [line for line in compiled_hlo(jitted, *args).splitlines()
            if re.search(rf"= {re.escape(table)}\S* fusion\(", line)]
    assert not made, made


def test_resident_compression_keeps_the_gpu_forward_branch_free():
    """Palette-coded weights are decoded in the layer body by a gather and a scatter of fixed shapes."""
    runner = make_runner(DENSE, "pallas", dtype=jnp.bfloat16, compress=("mlp", "attn"))
    names = {".".join(map(str, path)) for path, _ in nnx.to_flat_state(runner.state)}
    assert {"layers.w_down.esc_rows", "layers.wqkv.codes"} <= names and "layers.w_down" not in names
    prims = primitives(forward_jaxpr(runner, 4))
    assert {"pallas_call", "scatter"} <= prims
    assert not prims & {"cond", "while"}, prims & {"cond", "while"}


def compiled_hlo(fn, *args) -> str:
    return fn.lower(*args).compile().as_text()


def assert_no_host_sync(hlo: str) -> list[str]:
    """Fails on a conditional or a loop without a known trip count; returns the (fixed-trip) loops."""
    assert not re.search(r"\bconditional\(", hlo), "a conditional in the compiled program"
    loops = [line for line in hlo.splitlines() if re.search(r"\swhile\(", line) and "condition=" in line]
    for line in loops:
        assert "known_trip_count" in line, f"a while loop of unknown trip count: {line.strip()[:200]}"
    return loops


@pytest.mark.parametrize("variant", BRANCH_FREE_VARIANTS)
def test_branch_free_samplers_compile_without_host_syncs(variant):
    """Each GPU sampler variant, compiled: no conditional, and every loop's trip count is known."""
    runner = make_runner(DENSE, "reference")
    shape = runner.rc.buckets.shapes[-1]
    batch, c = runner.rc.empty_batch(shape), runner.cache
    logits = jax.ShapeDtypeStruct((shape.num_rows, DENSE.vocab_size), jnp.float32)
    mask = jax.ShapeDtypeStruct((shape.num_rows, runner.mask_words), jnp.int32)  # structured outputs' bitmask
    hlo = compiled_hlo(runner.steps.samplers[variant], c.last_tokens, c.counts, c.prompt_mask, logits, batch.sampling,
                       batch.row_slots, batch.sample_rows, mask)
    assert_no_host_sync(hlo)


def test_cpu_sampler_is_the_branching_one():
    """The CPU sampler keeps its conditionals (there the host runs the program, so they cost nothing):
    this is the check above seeing one."""
    runner = make_runner(DENSE, "reference", variants=(BRANCHING,))
    shape = runner.rc.buckets.shapes[-1]
    batch, c = runner.rc.empty_batch(shape), runner.cache
    logits = jax.ShapeDtypeStruct((shape.num_rows, DENSE.vocab_size), jnp.float32)
    mask = jax.ShapeDtypeStruct((shape.num_rows, runner.mask_words), jnp.int32)
    with pytest.raises(AssertionError, match="conditional"):
        assert_no_host_sync(compiled_hlo(runner.steps.samplers[BRANCHING], c.last_tokens, c.counts, c.prompt_mask,
                                         logits, batch.sampling, batch.row_slots, batch.sample_rows, mask))


def test_forward_compiles_without_conditionals_on_cpu():
    """The CPU forward (reference attention) has no conditional either; its one loop of unknown trip
    count is the reference attention's walk over cached blocks, which follows real context lengths
    (on the CPU backend the host runs loops anyway). The layer scan's trip count is known."""
    runner = make_runner(DENSE, "reference")
    shape = runner.rc.buckets.shapes[0]
    hlo = compiled_hlo(runner.steps.forward, runner.state, runner.cache, runner.rc.empty_batch(shape))
    assert not re.search(r"\bconditional\(", hlo)
    with pytest.raises(AssertionError, match="unknown trip count"):
        assert_no_host_sync(hlo)
    loops = [line for line in hlo.splitlines() if re.search(r"\swhile\(", line) and "condition=" in line]
    assert sum('"known_trip_count":{"n":"2"}' in line for line in loops) == 1  # the scan over 2 layers


def cuda_forward_text(dtype, monkeypatch) -> str:
    """The forward of the smallest bucket as a GPU traces it, lowered for CUDA (no GPU needed): the
    StableHLO a GPU compiles."""
    monkeypatch.setattr(placement, "platform", lambda: "gpu")
    runner = make_runner(DENSE, "reference", dtype=dtype)
    batch = runner.rc.empty_batch(runner.rc.buckets.shapes[0])
    return runner.steps.forward.trace(runner.state, runner.cache, batch).lower(lowering_platforms=("cuda",)).as_text()


def test_float32_engine_dots_run_at_full_precision_on_a_gpu(monkeypatch):
    """A float32 engine's dots, the LM head's included, are float32 at HIGHEST precision in the
    program a GPU compiles (XLA on a GPU would use TF32 by default)."""
    dots = re.findall(r"stablehlo\.dot_general.*", cuda_forward_text(jnp.float32, monkeypatch))
    assert len(dots) >= 5  # q/k/v, attention (2), o, gate/up, down, LM head
    head = f"tensor<{DENSE.vocab_size}x{DENSE.hidden_size}xf32>"
    assert sum(head in dot for dot in dots) == 1
    for dot in dots:
        assert "precision = [HIGHEST, HIGHEST]" in dot, dot[:200]
        assert "bf16" not in dot.split(" : ")[-1], dot[:200]


def test_bfloat16_head_is_read_in_bfloat16_on_a_gpu(monkeypatch):
    """The LM head's dot takes the bfloat16 head as it is stored and gives bfloat16, cast to float32
    after: no dot with a float32 result from 16-bit operands (XLA's OperandUpcaster turns those into
    float32 operands, which converted the whole head every step on the H100), no converted head."""
    text = cuda_forward_text(jnp.bfloat16, monkeypatch)
    head = f"tensor<{DENSE.vocab_size}x{DENSE.hidden_size}x"
    dots = [d for d in re.findall(r"stablehlo\.dot_general.*", text) if head in d]
    assert len(dots) == 1
    assert dots[0].endswith(f"-> tensor<4x{DENSE.vocab_size}xbf16>"), dots[0]
    assert f"{head}bf16>" in dots[0] and "HIGHEST" not in dots[0]
    assert not re.search(rf"stablehlo\.convert .*: \({re.escape(head)}bf16>\) -> {re.escape(head)}f32>", text)
    for dot in re.findall(r"stablehlo\.dot_general.*", text):  # no layer's dot widens its 16-bit operands either
        operands, result = dot.split(" : ")[-1].split(" -> ")
        assert not ("bf16" in operands and result.endswith("xf32>")), dot[:200]
        assert "HIGHEST" not in dot, dot[:200]  # a bfloat16 engine leaves XLA's default precision


@pytest.mark.parametrize("dtype,platform", [(jnp.float32, "cpu"), (jnp.bfloat16, "cpu"), (jnp.bfloat16, "gpu")])
def test_logits_match_float64(dtype, platform, monkeypatch):
    """The LM head reads the [V, E] weight once: float32 logits agree with float64 (the float32 dot
    is full precision whatever the caller's matmul precision, so on a GPU too); bfloat16 logits, in
    either form (float32 output on CPU, bfloat16 output cast after elsewhere), within a few
    bfloat16 roundings of float64."""
    monkeypatch.setattr(placement, "platform", lambda: platform)
    runner = make_runner(DENSE, "reference", dtype=dtype)
    model = runner.model()
    h = jax.random.normal(jax.random.key(0), (3, DENSE.hidden_size), jnp.float32).astype(dtype)
    got = np.asarray(model.logits(h))
    x = np.asarray(h.astype(jnp.float32), np.float64)
    norm = np.asarray(model.final_norm[...].astype(jnp.float32), np.float64)
    x = x / np.sqrt((x * x).mean(-1, keepdims=True) + DENSE.rms_norm_eps) * norm
    want = x @ np.asarray(model.lm_head[...].astype(jnp.float32), np.float64).T
    assert got.dtype == np.float32
    if dtype == jnp.float32:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        cuda = jax.jit(model.logits).trace(h).lower(lowering_platforms=("cuda",)).as_text()
        assert "precision = [HIGHEST, HIGHEST]" in cuda  # called outside the engine's precision context
    else:  # the normed h rounds to bfloat16 too: a few bfloat16 ulps of the largest logit
        np.testing.assert_allclose(got, want, rtol=0, atol=3 * 2.0 ** -8 * np.abs(want).max())


def test_branch_free_engine_samples_like_the_cpu_engine_and_never_recompiles(request):
    """The GPU configuration: every variant is compiled at warmup, and a mix of greedy, seeded top-p,
    penalty and logprob requests gives the branching engine's exact tokens. Both run decode bursts:
    here the GPU's, a fixed number of steps with branch-free samplers. On the default model where it
    is installed (the session's engine is the branching one), else on random weights of its shapes
    (a GPU machine has no model file)."""
    import importlib.util

    from conftest import SMALL_ENGINE

    from infire_jax import LLM, SamplingParams
    from infire_jax.loaders.paths import DEFAULT_MODEL_PACKAGE

    if importlib.util.find_spec(DEFAULT_MODEL_PACKAGE) is not None:
        engine, cpu_like = SMALL_ENGINE, request.getfixturevalue("smol_llm")
        # Three prompts prefill in the 64-token bucket and decode in the 4-token one: the GPU-like engine
        # compiles only those (every variant's sampler and burst), not the session engine's 8 rows
        # (an 8-token bucket, bursts and samplers of 8 rows: half of its programs).
        gpu_engine = dict(engine, max_num_seqs=4, token_buckets=(4, 64))
    else:
        engine = dict(model="dummy:smollm2-135m", dtype="float32", max_num_seqs=4, max_num_batched_tokens=16,
                      max_model_len=128)
        cpu_like, gpu_engine = LLM(**engine, branch_free_sampler=False), engine
    gpu_like = LLM(**gpu_engine, branch_free_sampler=True)
    assert gpu_like.engine.runner.rc.sampler_variants == BRANCH_FREE_VARIANTS
    assert gpu_like.engine.runner.rc.decode_steps == cpu_like.engine.runner.rc.decode_steps == 4
    prompts = ["The capital of France is", "List three fruits:", "Once upon a time"]
    params = [SamplingParams(max_tokens=12, temperature=0),
              SamplingParams(max_tokens=12, temperature=0.9, top_p=0.8, seed=5, logprobs=2),
              SamplingParams(max_tokens=12, temperature=0.7, repetition_penalty=1.3, seed=9)]
    for batch in ([params[0]] * 3, params):  # the greedy variant alone, then a mixed batch
        want = cpu_like.generate(prompts, batch)
        got = gpu_like.generate(prompts, batch)
        for a, b in zip(got, want):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert gpu_like.engine.compiles_since_warmup == 0
    assert gpu_like.engine.stats.steps < 2 * 12  # two batches of 12 tokens, in fewer launches
