"""The engine's H100 programs, compiled on this CPU machine (bench/gpu_target.py, `bench gpu-compile`):
what they launch and copy each step, read from XLA's own dump (bench/program_stats.py).

`dummy:llama-3.1-8b` at its real shapes (32 layers, bfloat16, 16 GB of weights), with the engine's
GPU settings. The stats reader is checked first on a toy layer loop whose copies and launches are
known, and the decode-burst check against the compiler's own copying path (INFIRE_JAX_DENSE_MATMUL=xla),
so that a check passing means the copies are gone, not unseen. Compiled structure only: nothing runs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(shutil.which("nvidia-smi") is not None,
                                reason="a GPU machine compiles its programs on the GPU itself (bench device-checks)")

MODEL = "dummy:llama-3.1-8b"
# Two decode steps a burst, not the engine's four: every figure checked is a layer's or a step's, and an
# unrolled burst compiles in time proportional to its steps.
ENGINE = dict(model=MODEL, token_buckets=(64, 8192), max_num_seqs=64, num_kv_pages=4096, num_decode_steps=2)
LAYERS = 32
# One layer's qkv, o, gate/up and down weights of Llama 3.1 8B in bfloat16: what a layer loop that
# copies its weights out of the stacks copies each trip.
LAYER_WEIGHT_BYTES = 2 * 4096 * (6144 + 4096 + 2 * 14336 + 14336)


def _compile(tmp_path, programs: tuple[str, ...], **engine):
    from infire_jax.bench import gpu_target, program_stats
    from infire_jax.engine.setup import EngineConfig

    target = gpu_target.TargetEngine(EngineConfig(**{**ENGINE, **engine}), gpu_target.target("h100"))
    shapes, layers, _ = target.weights_per_device()
    assert layers == LAYERS
    return {p.name: (p, program_stats.read_dump(p.dump_dir, shapes, layers))
            for p in target.programs(str(tmp_path), programs)}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return _compile(tmp_path_factory.mktemp("gpu"), ("burst-greedy", "forward"))


def test_stats_count_a_layer_loop_that_copies(tmp_path):
    """A four-layer loop over a stacked [4, 4096, 4096] weight: XLA copies each layer's slice out
    (32 MiB each) before cuBLAS reads it, and launches the copy, the GEMM and an
    elementwise kernel a trip; the reader finds four copies of the weight's size and the loop, and a
    float32 copy of the weight where the loop upcasts it."""
    import jax
    import jax.numpy as jnp

    from infire_jax.bench import gpu_target, program_stats

    device = gpu_target.devices(gpu_target.target("h100"))[0]

    def loop(x, w):
        return jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), x, w)[0]

    args = gpu_target.on_device((jax.ShapeDtypeStruct((8, 4096), jnp.bfloat16),
                                 jax.ShapeDtypeStruct((4, 4096, 4096), jnp.bfloat16)), device)
    jax.jit(loop).lower(*args).compile(compiler_options={"xla_dump_to": str(tmp_path)})
    st = program_stats.read_dump(str(tmp_path), [(4096, 4096)], 4)
    assert (st.weight_copies, st.weight_copy_bytes) == (4, 4 * 4096 * 4096 * 2)
    assert st.slice_copies == 4  # each read out of the stack
    assert st.custom_calls == {"__cublas$lt$matmul": 4}
    assert st.launches_per_layer >= 3 and st.launches >= 4 * st.launches_per_layer
    assert st.float32_weights == [] and st.loops_in_layer == 0

    def upcast(x, w):  # a float32 copy of each layer's weight, as a float32 head or matmul would make
        return jax.lax.scan(lambda h, wl: (jnp.tanh(h.astype(jnp.float32) @ wl.astype(jnp.float32)), None),
                            x.astype(jnp.float32), w)[0]

    jax.jit(upcast).lower(*args).compile(compiler_options={"xla_dump_to": str(tmp_path / "f32")})
    assert program_stats.read_dump(str(tmp_path / "f32"), [(4096, 4096)], 4).float32_weights


def test_stats_count_the_launches_of_an_unrolled_layer(tmp_path, monkeypatch):
    """The same loop as models run their layers on a GPU (models/layers.py's `layer_loop` unrolled,
    each layer under its name scope): a layer launches its GEMM and its tanh and nothing else, and the
    launches a run are the layers' together."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from infire_jax.bench import gpu_target, program_stats
    from infire_jax.models.layers import layer_loop

    monkeypatch.setenv("INFIRE_JAX_LAYER_LOOP", "unrolled")
    device = gpu_target.devices(gpu_target.target("h100"))[0]

    def loop(x, w):
        return layer_loop(lambda h, xs: (jnp.tanh(h @ w[xs]), None), x, np.arange(4), 4, tokens=8)

    args = gpu_target.on_device((jax.ShapeDtypeStruct((8, 4096), jnp.bfloat16),
                                 jax.ShapeDtypeStruct((4, 4096, 4096), jnp.bfloat16)), device)
    jax.jit(loop).lower(*args).compile(compiler_options={"xla_dump_to": str(tmp_path)})
    st = program_stats.read_dump(str(tmp_path), [(4096, 4096)], 4)
    assert st.custom_calls == {"__cublas$lt$matmul": 4} and st.loops_in_layer == 0
    assert st.launches_per_layer == 2 and st.launches >= 4 * 2


def test_decode_burst_reads_every_weight_in_place(compiled):
    """The 64-row decode burst copies no weight (the plain layer weights go to the Pallas matmul that
    reads the layer of the stack in place), holds no float32 copy of one, and launches at most 12
    kernels a layer: its layers unrolled (no loop counter, test or per-layer slice copies), the
    attention output's residual add and the MLP norm one kernel, silu(gate) * up formed inside the
    down projection's (docs/PERFORMANCE.md has the 12)."""
    program, st = compiled["burst-greedy 64 tokens"]
    assert st.weight_copies == 0 and st.weight_copy_bytes == 0, st.weight_copy_ops
    assert st.slice_copies == 0, st.slice_copy_ops
    assert st.float32_weights == []
    assert 0 < st.launches_per_layer <= 12, st.launches_per_layer
    # 4 matmuls, the KV write, the attention and the residual norm, in every layer of every step
    assert st.custom_calls.get("__gpu$xla.gpu.triton", 0) >= LAYERS * program.steps * 7


def test_xla_gemm_path_copies_each_layer_out(tmp_path, monkeypatch):
    """What the check above would catch: with XLA's GEMM on the layer's slice (jax 0.10.2's compiler),
    every layer's four weights are copied each decode step, the whole model a step."""
    monkeypatch.setenv("INFIRE_JAX_DENSE_MATMUL", "xla")
    program, st = _compile(tmp_path, ("burst-greedy",))["burst-greedy 64 tokens"]
    assert st.weight_copies == st.slice_copies == 4 * LAYERS * program.steps
    assert st.weight_copy_bytes == LAYER_WEIGHT_BYTES * LAYERS * program.steps


def test_forward_copies_only_past_a_row_tile_and_plans_once(compiled):
    """A 64-token step reads the weights in place; an 8192-token prompt chunk takes XLA's GEMM, whose
    copy of each layer (16 GB a step here) is small beside the chunk's 131 TFLOP. Neither redoes the
    step's attention planning in every layer."""
    _, small = compiled["forward 64 tokens"]
    _, large = compiled["forward 8192 tokens"]
    assert small.weight_copies == small.slice_copies == 0 and small.float32_weights == []
    # The prefill kernel's work items (a search over the rows) are built once, before the layer loop.
    assert small.loops_in_layer == 0 and large.loops_in_layer == 0
    assert large.weight_copy_bytes >= LAYER_WEIGHT_BYTES * LAYERS and large.float32_weights == []


def test_a_pool_filling_the_card_costs_the_prompt_chunk_nothing(tmp_path, compiled):
    """With the pool sized as the engine sizes it (58 GB on an H100), the 8192-token chunk compiles as
    beside the fixture's 8.6 GB pool: XLA's rematerialization, which misjudges memory beside the
    donated pool and copied weights for nothing (38 launches a layer, 34 GB a step), stays off
    (runner/xla_flags.py)."""
    from infire_jax.bench import gpu_compile, gpu_target

    h100 = gpu_target.target("h100")
    pool = gpu_compile.pool_bytes(h100.memory_bytes, 0.9, 16_060_522_496)  # the 8B's bf16 weights
    _, full = _compile(tmp_path, ("forward 8192",), num_kv_pages=None, kv_cache_memory=pool)["forward 8192 tokens"]
    _, small = compiled["forward 8192 tokens"]
    assert full.launches_per_layer == small.launches_per_layer
    assert full.weight_copy_bytes == small.weight_copy_bytes


@pytest.mark.parametrize("devices", [1, 2])
def test_gpt_oss_decode_reads_its_mxfp4_experts_and_attention_in_place(tmp_path, devices):
    """gpt-oss with its experts kept in MXFP4 (a dummy's drawn so), 2 of its layers, on one H100 and on
    two (tp 2: each card half of every expert's width, whole blocks): the decode burst copies no weight
    (the experts through the grouped Pallas kernel, q/k/v, o and the router through the dense one) and runs no loop
    inside a layer (the grouped kernel's tile schedule is one comparison, not a binary search's loop:
    4532 launches a step of the whole 120b before, 1472 after)."""
    from infire_jax.bench import gpu_target, program_stats
    from infire_jax.engine.setup import EngineConfig
    from sharding.mesh import CONFIG_DIR

    ec = EngineConfig(model="dummy:gpt-oss-20b,layers=2", dtype="bfloat16", weights_quantization="checkpoint",
                      mesh=os.path.join(CONFIG_DIR, f"{devices}.yaml"), token_buckets=(64,), max_num_seqs=64,
                      num_kv_pages=1024)
    target = gpu_target.TargetEngine(ec, gpu_target.target("h100"), devices)
    shapes, layers, _ = target.weights_per_device()
    (program,) = target.programs(str(tmp_path), ("burst-greedy",))
    st = program_stats.read_dump(program.dump_dir, shapes, layers)
    assert st.weight_copies == st.slice_copies == 0 and st.float32_weights == [], st.slice_copy_ops
    assert st.loops_in_layer == 0 and 0 < st.launches_per_layer <= 40, st.launches_per_layer
    assert st.custom_calls.get("__gpu$xla.gpu.triton", 0) >= 2 * program.steps * 5  # qkv, o, 2 experts, attention


@pytest.mark.parametrize("model,trip_layers", [("dummy:gemma-3-27b,layers=6", 1), ("dummy:gemma-4-31b,layers=12", 6)])
def test_gemma_decode_reads_its_weights_in_place_and_prefill_compiles(tmp_path, model, trip_layers):
    """Gemma 3 27b's shapes, 6 of its layers (five windowed, one global), and Gemma 4 31B's, 12 (two blocks
    of five windowed layers and a full one with 512-wide heads viewing the pool; a trip of its layer loop,
    what the stats call a layer, is a block), on one H100: the decode burst copies no weight (q/k/v, o,
    gate/up and down through the dense Pallas matmul, reading each layer of the stacks in place; Gemma 3's
    mlp_norm stays out of llama.py's fused residual norm, which adds before norming) and runs no loop
    inside a layer; the prompt-chunk program compiles too (Gemma 4: with attention tiles for its 512-wide
    heads that fit the card's shared memory)."""
    from infire_jax.bench import gpu_target, program_stats
    from infire_jax.engine.setup import EngineConfig

    ec = EngineConfig(model=model, dtype="bfloat16", token_buckets=(64, 2048), max_num_seqs=64, max_model_len=8192,
                      num_kv_pages=4096, num_decode_steps=2)
    target = gpu_target.TargetEngine(ec, gpu_target.target("h100"))
    shapes, layers, _ = target.weights_per_device()
    programs = {p.name: p for p in target.programs(str(tmp_path), ("burst-greedy", "forward 2048"))}
    st = program_stats.read_dump(programs["burst-greedy 64 tokens"].dump_dir, shapes, layers)
    assert st.weight_copies == st.slice_copies == 0 and st.float32_weights == [], st.slice_copy_ops
    assert st.loops_in_layer == 0 and 0 < st.launches_per_layer <= 40 * trip_layers, st.launches_per_layer
    assert program_stats.read_dump(programs["forward 2048 tokens"].dump_dir, shapes, layers).launches_per_layer > 0


def test_glm4_decode_compiles_and_reads_its_experts_in_place(tmp_path):
    """GLM-4.5-Air's shapes, 2 of its layers (the dense one and a MoE one), on one H100: the decode burst
    and the prompt-chunk program compile; the burst copies no weight, writes no float32 copy of one (the
    router's included) and runs no loop inside a layer."""
    from infire_jax.bench import gpu_target, program_stats
    from infire_jax.engine.setup import EngineConfig

    ec = EngineConfig(model="dummy:glm-4.5-air,layers=2", dtype="bfloat16", token_buckets=(64, 2048),
                      max_num_seqs=64, max_model_len=8192, num_kv_pages=4096)
    target = gpu_target.TargetEngine(ec, gpu_target.target("h100"))
    shapes, layers, _ = target.weights_per_device()
    programs = {p.name: p for p in target.programs(str(tmp_path), ("burst-greedy", "forward 2048"))}
    st = program_stats.read_dump(programs["burst-greedy 64 tokens"].dump_dir, shapes, layers)
    assert st.weight_copies == st.slice_copies == 0, st.slice_copy_ops
    # the router's logits are float32 as HF's (models/deepseek_moe.py): the kernel upcasts its tiles on chip, where
    # XLA wrote a float32 copy of the layer's router [4096, 128] first
    assert st.float32_weights == [], st.float32_weights
    assert st.loops_in_layer == 0, st.loops_in_layer
    assert sorted(programs) == ["burst-greedy 64 tokens", "forward 2048 tokens"]


def test_qwen3_moe_decode_reads_its_router_in_place(tmp_path):
    """Qwen3-30B-A3B's shapes, 2 layers, on one H100 (models/llama.py's MoE path): the decode burst reads
    every layer weight, the experts and the router in place; cuBLAS only for the LM head (each layer's
    router slice was copied out for a cuBLAS call of its own)."""
    from infire_jax.bench import gpu_target, program_stats
    from infire_jax.engine.setup import EngineConfig

    ec = EngineConfig(model="dummy:qwen3-30b-a3b,layers=2", dtype="bfloat16", token_buckets=(64,), max_num_seqs=64,
                      max_model_len=8192, num_kv_pages=1024, num_decode_steps=2)
    target = gpu_target.TargetEngine(ec, gpu_target.target("h100"))
    shapes, layers, _ = target.weights_per_device()
    (program,) = target.programs(str(tmp_path), ("burst-greedy",))
    st = program_stats.read_dump(program.dump_dir, shapes, layers)
    assert st.weight_copies == st.slice_copies == 0, st.slice_copy_ops
    assert st.custom_calls.get("__cublas$lt$matmul", 0) == program.steps, st.custom_calls


def test_minimax_m2_decode_reads_its_published_fp8_blocks_in_place(tmp_path):
    """MiniMax-M2 as published (fp8 in 128 x 128 blocks, kept: loaders/kept_8bit.py), 2 of its layers on one
    H100: the decode burst reads q/k/v, o, the router and every expert in place through the Triton kernels
    (attention, the quantized matmul and the grouped one: 7 a layer), copies no weight, and holds a layer's
    weights in about half the bytes of bfloat16 (the float32 block scales beside them)."""
    from infire_jax.bench import gpu_target, program_stats
    from infire_jax.engine.setup import EngineConfig

    sizes = {}
    for quantization in (None, "checkpoint"):
        ec = EngineConfig(model="dummy:minimax-m2,layers=2", dtype="bfloat16", weights_quantization=quantization,
                          token_buckets=(64,), max_num_seqs=64, max_model_len=8192, num_kv_pages=4096,
                          num_decode_steps=2)
        target = gpu_target.TargetEngine(ec, gpu_target.target("h100"))
        shapes, layers, sizes[quantization] = target.weights_per_device()
    (program,) = target.programs(str(tmp_path), ("burst-greedy",))
    st = program_stats.read_dump(program.dump_dir, shapes, layers)
    assert st.weight_copies == st.slice_copies == 0 and st.loops_in_layer == 0, st.slice_copy_ops
    assert st.custom_calls.get("__gpu$xla.gpu.triton", 0) == 2 * program.steps * 7, st.custom_calls
    embeddings = 2 * 200064 * 3072 * 2  # the embedding and the LM head, bfloat16 in both
    assert 0.5 < (sizes["checkpoint"] - embeddings) / (sizes[None] - embeddings) < 0.52, sizes


@pytest.mark.parametrize("devices", [1, 2])
def test_qwen3_5_decode_reads_its_weights_in_place_and_prefill_compiles(tmp_path, devices):
    """Qwen3.5-MoE's shapes, one group of its layers (three Gated DeltaNets and a gated attention layer), on
    one H100 and on two (tp): the decode burst reads every projection, expert and the shared expert (the
    dense models' MLP path) and the routers in place, cuBLAS only for the head, and writes nothing of a
    weight's size but each linear layer's new states (64 rows of [32, 128, 128] float32 over the devices, a
    fusion each): no step copies the whole linear state, as it did while each layer's rows were read in
    several fused places (the convolution's: only the one-card case catches that one; the delta rule's:
    only the mesh). The 64-token prompt program (the chunked delta rule) compiles without such a copy either."""
    from infire_jax.bench import gpu_target, program_stats
    from infire_jax.engine.setup import EngineConfig

    mesh = None if devices == 1 else os.path.join(os.path.dirname(__file__), "..", "sharding", "configs", "2.yaml")
    ec = EngineConfig(model="dummy:qwen3.5-35b-a3b,layers=4", dtype="bfloat16", token_buckets=(64,), max_num_seqs=64,
                      max_model_len=8192, num_kv_pages=4096, mesh=mesh, num_decode_steps=2)
    target = gpu_target.TargetEngine(ec, gpu_target.target("h100"), devices)
    shapes, layers, _ = target.weights_per_device()
    programs = {p.name: p for p in target.programs(str(tmp_path), ("burst-greedy", "forward"))}
    burst = programs["burst-greedy 64 tokens"]
    st = program_stats.read_dump(burst.dump_dir, shapes, layers)
    new_states = 64 * 32 // devices * 128 * 128 * 4  # bytes: each row's state of this device's heads
    assert "copy" not in [op.rstrip("0123456789.") for op in st.weight_copy_ops], st.weight_copy_ops
    assert st.weight_copies == 3 * burst.steps and st.weight_copy_bytes == st.weight_copies * new_states, st
    assert st.custom_calls.get("__cublas$lt$matmul", 0) == burst.steps, st.custom_calls  # the head
    assert st.slice_copies == 0, st.slice_copy_ops
    forward = program_stats.read_dump(programs["forward 64 tokens"].dump_dir, shapes, layers)
    assert forward.launches > 0 and "copy" not in [op.rstrip("0123456789.") for op in forward.weight_copy_ops], \
        forward.weight_copy_ops


def test_programs_fit_the_card(compiled):
    from infire_jax.bench import gpu_target

    card = gpu_target.target("h100").memory_bytes
    for name, (program, _) in compiled.items():
        peak = gpu_target.peak_bytes(program.compiled)
        assert 16e9 < peak < card, (name, peak)


def test_command_prints_a_row_per_program(tmp_path):
    """`bench gpu-compile` end to end on the 8B's samplers (seconds), with its JSON, its pool sized as
    the engine sizes it on the card (the 8B's 8192-token context is more than a 1 GiB pool holds)."""
    out = tmp_path / "gc.json"
    run = subprocess.run([sys.executable, "-m", "infire_jax.bench", "gpu-compile", "--target", "h200",
                          "--model", MODEL, "--programs", "sampler-greedy", "--max-num-seqs", "8", "--token-buckets", "8",
                          "--json", str(out), "--dump-dir", str(tmp_path / "new" / "dumps")],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "sampler-greedy 8 rows" in run.stdout and "NVIDIA H200" in run.stdout
    import json

    payload = json.loads(out.read_text())
    rows = payload["results"]
    assert [r["program"] for r in rows] == ["sampler-greedy 8 rows"] and rows[0]["weight_copies_per_step"] == 0
    (program,) = payload["programs"]
    assert program["name"] == "sampler-greedy 8 rows" and program["weight_copy_bytes"] == 0
    assert program["f32_weight_bytes"] == 0 and program["device_memory_bytes"] == 143_771 * (1 << 20)
    assert 0 < program["peak_bytes"] < payload["usable_bytes"] and payload["fits"] is True
    assert 100e9 < payload["kv_cache_bytes_per_device"] < payload["usable_bytes"] - 16e9  # the 8B's 16 GB
    assert list((tmp_path / "new" / "dumps").glob("sampler-greedy*/*thunk_sequence.txt"))  # made, and kept


def _scout_plan():
    from infire_jax.memplan.plan import memory_plan
    from infire_jax.memplan.source import plan_source
    from sharding.mesh import CONFIG_DIR, MeshConfig

    mc = MeshConfig.from_yaml(os.path.join(CONFIG_DIR, "2.yaml"))
    return memory_plan(plan_source("dummy:llama-4-scout", "bfloat16")(mc), mc, 141 * 10 ** 9)


def test_llama4_scout_fits_two_h200s_with_the_seeds_kv_pool(tmp_path):
    """The seed's workload as compiled proof: Llama 4 Scout in bfloat16 on 2 x H200 (the shipped 2-GPU
    mesh), its pool sized as the engine sizes it at --gpu-memory-utilization 0.95, holds more than
    56 GiB of KV in all (over 1.2M tokens of its 12 global layers at 48 KiB a token) beside the vision
    tower the engine serves images with (its weights and its largest call's temporaries on each card,
    as the engine leaves them room), and its decode burst and largest prompt chunk fit each card (the
    burst's peak from a cut of the model, as Kimi K2.5's below)."""
    import dataclasses

    from pallas_kernels import placement

    from infire_jax.bench import gpu_compile, gpu_target, program_stats
    from infire_jax.engine.setup import EngineConfig
    from infire_jax.vision.encoder import device_bytes

    h200 = gpu_target.target("h200")
    ec = EngineConfig(model="dummy:llama-4-scout", max_num_seqs=64, token_buckets=(64, 8192),
                      gpu_memory_utilization=0.95, kv_cache_memory=1 << 30)
    probe = gpu_target.TargetEngine(ec, h200, 2)
    with placement.compiling_for("gpu", probe.devices):
        tower, encoding = device_bytes(probe.settings.vision, probe.settings.dtype, probe.settings.plan.replicated)
    assert 1.6 * (1 << 30) < tower < 1.7 * (1 << 30)  # 872M parameters in bfloat16
    # infire-jax plan's estimate of the encoder's largest call holds what the H200's compiler allocates
    assert encoding <= _scout_plan().encoder <= 2 * encoding, encoding
    weights = probe.weights_per_device()[2]
    pool = gpu_compile.pool_bytes(h200.memory_bytes, 0.95, weights + tower) - encoding
    ec = dataclasses.replace(ec, kv_cache_memory=pool)
    engine = gpu_target.TargetEngine(ec, h200, 2)
    assert engine.settings.plan.mesh.devices.size == 2
    assert 2 * engine.kv_pool_bytes_per_device() > 56 * (1 << 30)
    assert 2 * engine.kv_pool_bytes_per_device() // (48 << 10) > 1_200_000
    forward = next(engine.programs(None, ("forward 8192",)))
    assert weights < gpu_target.peak_bytes(forward.compiled) < h200.memory_bytes
    # the burst's peak from a 4-layer cut's (three chunked layers and a global one), as Kimi's below
    cut = gpu_target.TargetEngine(dataclasses.replace(ec, model="dummy:llama-4-scout,layers=4"), h200, 2)
    shapes, cut_layers, cut_weights = cut.weights_per_device()
    burst = next(cut.programs(str(tmp_path), ("burst-greedy",)))
    st = program_stats.read_dump(burst.dump_dir, shapes, cut_layers)
    assert st.weight_copies == st.slice_copies == 0, st.slice_copy_ops  # the routers' too
    peak = gpu_target.peak_bytes(burst.compiled) - cut_weights - cut.kv_pool_bytes_per_device() + \
        weights + engine.kv_pool_bytes_per_device()
    assert weights < peak < h200.memory_bytes, peak


def test_kimi_k2_5_fits_eight_h100s_with_over_30_gib_of_kv(tmp_path, monkeypatch):
    """The seed's other workload as compiled proof: Kimi K2.5 (61 layers, 384 routed experts kept in
    its int4, everything else bfloat16) on 8 x H100 80 GB over the Kimi mesh (tp 8, experts split over
    the same devices), the pool sized as the engine sizes it at 0.98 of the card (and the allocator
    let to 0.98): 76.2 GB of weights a card leave a 4.9 GB pool, over 30 GiB of KV in all, and the
    decode burst and a 2048-token prompt chunk each fit what the allocator hands out. (At 0.95 there
    is no such pool: infire-jax plan and docs/PERFORMANCE.md have the arithmetic.)

    The prompt chunk (its layers a loop) is compiled whole. The burst unrolls the 60 layers four times,
    minutes of compiling on CI's two cores, so its peak comes from a cut of the model, 4 layers (the
    dense one and three MoE ones) on the same mesh and pool: the cut's burst copies no weight (MLA's
    per-head W_uk and W_uv too, 1 MB a layer on each card: `head_matmul` reads them in place where XLA's
    batched GEMM copied each layer's out of the stack), so its temporaries do not grow with the layers,
    and the whole burst peaks at the cut's peak less the cut's weights and pool, plus the whole model's."""
    import dataclasses

    from infire_jax.bench import gpu_compile, gpu_target, program_stats
    from infire_jax.engine.setup import EngineConfig
    from sharding.mesh import CONFIG_DIR

    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.98")
    h100 = gpu_target.target("h100")
    ec = EngineConfig(model="dummy:kimi-k2.5", weights_quantization="int4",
                      mesh=os.path.join(CONFIG_DIR, "8-tp8-ep.yaml"), max_num_seqs=64, token_buckets=(64, 2048),
                      gpu_memory_utilization=0.98, kv_cache_memory=1 << 30)
    _, layers, weights = gpu_target.TargetEngine(ec, h100, 8).weights_per_device()
    assert layers == 60 and 76e9 < weights < 77e9  # the routed experts' stack, int4 parts and bf16 scales
    ec = dataclasses.replace(ec, kv_cache_memory=gpu_compile.pool_bytes(h100.memory_bytes, 0.98, weights))
    engine = gpu_target.TargetEngine(ec, h100, 8)
    assert engine.settings.plan.mesh.devices.size == 8
    assert 8 * engine.kv_pool_bytes_per_device() > 30 * (1 << 30)
    usable = gpu_compile.usable_bytes(h100.memory_bytes)
    forward = next(engine.programs(None, ("forward 2048",)))
    chunk_peak = gpu_target.peak_bytes(forward.compiled)
    assert weights < chunk_peak <= usable, (chunk_peak, usable)
    cut = gpu_target.TargetEngine(dataclasses.replace(ec, model="dummy:kimi-k2.5,layers=4"), h100, 8)
    shapes, cut_layers, cut_weights = cut.weights_per_device()
    assert cut_layers == 3
    burst = next(cut.programs(str(tmp_path), ("burst-greedy",)))
    st = program_stats.read_dump(burst.dump_dir, shapes, cut_layers)
    assert st.weight_copies == 0 and st.slice_copies == 0, (st.weight_copy_ops, st.slice_copy_ops)
    peak = gpu_target.peak_bytes(burst.compiled) - cut_weights - cut.kv_pool_bytes_per_device() + \
        weights + engine.kv_pool_bytes_per_device()
    assert weights < peak <= usable, (peak, usable)
