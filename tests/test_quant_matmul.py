"""The GPU quantized matmul (pallas_kernels/quant_matmul.py) in Pallas interpret mode, against the
formats' definitions written out here in float64: its dequantized weights bit for bit (x = I), its
products within float32's accumulation bound, the grouped (MoE) form per row, and its lowering to
Triton for CUDA."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import quant_reference as ref
from h100 import compiled_kernels, gpu_lowered, jaxlib_version, launches, lowers_triton_here

from pallas_kernels import quant_blocks
from pallas_kernels.quant_blocks import Blocks
from pallas_kernels.quant_matmul import QuantStack, grouped_matmul, head_matmul, quant_matmul

RNG = np.random.default_rng(7)
S, K, N = 3, 256, 128  # three matrices of [K, N]
FORMATS = ("gptq32", "gptq128", "gptq_channel", "ct_int4", "q4_1", "q8_0", "int8", "fp8", "mxfp4", "plain_bf16")
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])  # OCP MX FP4 values


def _words(q: np.ndarray) -> np.ndarray:
    """[S, K, N] values 0..15 -> int32 words [S, K / 8, N], input 8j + i in bits 4i of word j."""
    s, k, n = q.shape
    q = q.astype(np.uint64).reshape(s, k // 8, 8, n)
    return sum(q[:, :, i] << np.uint64(4 * i) for i in range(8)).astype(np.uint32).view(np.int32)


def _per_input(part: np.ndarray, group: int) -> np.ndarray:
    return np.repeat(part.astype(np.float64), group, axis=1)


def make_stack(fmt: str, k: int = K, n: int = N) -> tuple[QuantStack, np.ndarray]:
    """A random stack in format `fmt` and its weights [S, k, n] by the format's definition, in float64."""
    if fmt.startswith("gptq") or fmt == "ct_int4":
        group = {"gptq32": 32, "gptq128": 128, "gptq_channel": k, "ct_int4": 32}[fmt]
        q = RNG.integers(0, 16, (S, k, n))
        scale = (RNG.standard_normal((S, k // group, n)) * 0.05).astype(
            ml_dtypes.bfloat16 if fmt == "ct_int4" else np.float16)
        if fmt == "ct_int4":  # compressed-tensors: stored q + 8, symmetric
            return (QuantStack(jnp.asarray(_words(q)), jnp.asarray(scale), packing="int4", zero_point=8),
                    (q - 8) * _per_input(scale, group))
        zero = RNG.integers(0, 16, (S, k // group, n)).astype(np.uint8)
        w = (q - _per_input(zero, group)) * _per_input(scale, group)
        return QuantStack(jnp.asarray(_words(q)), jnp.asarray(scale), jnp.asarray(zero), packing="int4"), w
    if fmt == "q4_1":  # GGUF: in a block of 32, byte e holds input e (low nibble) and e + 16 (high)
        q = RNG.integers(0, 16, (S, k, n))
        blocks = q.reshape(S, k // 32, 2, 16, n)
        packed = (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(S, k // 2, n).astype(np.uint8)
        d = (RNG.standard_normal((S, k // 32, n)) * 0.02).astype(np.float16)
        m = (RNG.standard_normal((S, k // 32, n)) * 0.1).astype(np.float16)
        return (QuantStack(jnp.asarray(packed), jnp.asarray(d), minimum=jnp.asarray(m), packing="q4_1"),
                _per_input(d, 32) * q + _per_input(m, 32))
    if fmt in ("q8_0", "int8"):
        q = RNG.integers(-127, 128, (S, k, n)).astype(np.int8)
        group = 32 if fmt == "q8_0" else k
        scale = (RNG.uniform(0.001, 0.01, (S, k // group, n))).astype(np.float16 if fmt == "q8_0" else np.float32)
        return QuantStack(jnp.asarray(q), jnp.asarray(scale)), ref.int8_channel(q, _per_input(scale, group))
    if fmt == "fp8":
        raw = RNG.integers(0, 256, (S, k, n), dtype=np.uint8)
        raw[(raw & 0x7F) == 0x7F] = 0x3F  # no NaN: it would poison the whole product
        scale = RNG.uniform(0.5, 2, (S, k // 128, n)).astype(np.float32)
        table = np.array([ref.e4m3fn_value(b) for b in range(256)])
        return (QuantStack(jnp.asarray(raw.view(ml_dtypes.float8_e4m3fn)), jnp.asarray(scale)),
                table[raw] * _per_input(scale, 128))
    if fmt == "mxfp4":  # gpt-oss: byte j holds inputs 2j (low nibble) and 2j + 1; an e8m0 scale per 32
        packed = RNG.integers(0, 256, (S, k // 2, n), dtype=np.uint8)
        scale = RNG.integers(118, 131, (S, k // 32, n), dtype=np.uint8)
        codes = np.stack([packed & 0xF, packed >> 4], axis=2).reshape(S, k, n)
        return (QuantStack(jnp.asarray(packed), jnp.asarray(scale), packing="mxfp4"),
                E2M1[codes] * _per_input(2.0 ** (scale.astype(np.float64) - 127), 32))
    if fmt == "plain_bf16":
        w = RNG.standard_normal((S, k, n)).astype(ml_dtypes.bfloat16)
        return QuantStack(jnp.asarray(w)), w.astype(np.float64)
    raise ValueError(fmt)


def within_f32_bound(got: np.ndarray, x: np.ndarray, w: np.ndarray) -> None:
    """float32 accumulation of K products: within K * 2^-23 of |x| @ |W| (a loose, rigorous bound)."""
    x, w = x.astype(np.float64), w.astype(np.float64)
    err = np.abs(got.astype(np.float64) - x @ w)
    assert np.all(err <= x.shape[1] * 2.0 ** -23 * (np.abs(x) @ np.abs(w)) + 1e-30), err.max()


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantizes_each_format_exactly(fmt):
    """x = I: every output is one weight, which must be the definition's value rounded once to float32."""
    stack, w = make_stack(fmt)
    got = quant_matmul(jnp.eye(K, dtype=jnp.float32), stack, jnp.int32(1), interpret=True)
    np.testing.assert_array_equal(np.asarray(got), w[1].astype(np.float32))


@pytest.mark.parametrize("fmt", ["gptq32", "q4_1", "fp8", "int8"])
@pytest.mark.parametrize("rows", [1, 5, 70])
def test_products_within_float32_bound(fmt, rows):
    """Decode-sized steps (70 rows: two row tiles) of float32 x against float64 over the definition's W."""
    stack, w = make_stack(fmt)
    x = RNG.standard_normal((rows, K)).astype(np.float32)
    got = np.asarray(quant_matmul(jnp.asarray(x), stack, 2, interpret=True))
    within_f32_bound(got, x, w[2].astype(np.float32))


def test_bfloat16_activations_take_bfloat16_weights():
    """A bfloat16 step feeds the dot bfloat16 weights (the dequantized float32 value rounded once),
    with float32 accumulation."""
    stack, w = make_stack("gptq128")
    x = RNG.standard_normal((8, K)).astype(ml_dtypes.bfloat16)
    got = np.asarray(quant_matmul(jnp.asarray(x), stack, 0, interpret=True))
    within_f32_bound(got, x, w[0].astype(np.float32).astype(ml_dtypes.bfloat16))


@pytest.mark.parametrize("fmt", ["ct_int4", "fp8", "plain_bf16"])
def test_grouped_rows_take_their_groups_matrix(fmt):
    """Rows sorted by group (sizes with empty groups, one tile-straddling group, and rows past the
    groups' sum, as on an expert-parallel shard) against each row's own matrix; past rows are 0."""
    stack, w = make_stack(fmt)
    sizes = np.array([0, 19, 3], np.int32)  # groups 0..2 -> matrices first + g of a stack of 3: first = 0
    m = int(sizes.sum()) + 4
    x = RNG.standard_normal((m, K)).astype(np.float32)
    got = np.asarray(grouped_matmul(jnp.asarray(x), jnp.asarray(sizes), stack, jnp.int32(0), interpret=True))
    group = np.repeat(np.arange(3), sizes)
    for r, g in enumerate(group):
        within_f32_bound(got[r:r + 1], x[r:r + 1], w[g].astype(np.float32))
    np.testing.assert_array_equal(got[len(group):], 0)
    # the same groups as experts 1..2 of the stack (a later layer's): `first` offsets the index
    got = np.asarray(grouped_matmul(jnp.asarray(x[:22]), jnp.asarray(sizes[1:]), stack, 1, interpret=True))
    for r, g in enumerate(group):
        within_f32_bound(got[r:r + 1], x[r:r + 1], w[g].astype(np.float32))


@pytest.mark.parametrize("tokens", [1, 5, 64, 70])
def test_each_head_takes_its_layers_matrix(tokens):
    """`head_matmul` (MLA's W_uk, W_uv read in place): head h's rows times W[first + h] of a stack of
    layers x heads [L * H, K, N], plain bfloat16 as served; a step of one row, a ragged tile, one whole
    tile and two tiles a head (64-row tiles)."""
    layers, heads, k, n = 3, 4, 128, 64
    w = RNG.standard_normal((layers * heads, k, n)).astype(ml_dtypes.bfloat16)
    x = RNG.standard_normal((tokens, heads, k)).astype(ml_dtypes.bfloat16)
    stack = QuantStack(jnp.asarray(w))
    got = jax.jit(lambda x, first: head_matmul(x, stack, first, interpret=True))(jnp.asarray(x), jnp.int32(heads))
    assert got.shape == (tokens, heads, n) and got.dtype == jnp.float32
    for h in range(heads):  # layer 1's matrices
        within_f32_bound(np.asarray(got[:, h]), x[:, h].astype(np.float32), w[heads + h].astype(np.float32))


@pytest.mark.parametrize("fmt", ["gptq32", "gptq128", "ct_int4", "q4_1", "q8_0", "int8", "fp8"])
def test_register_form_dequantizes_exactly_and_sums_within_bound(fmt):
    """Tiles of up to 4 rows multiplied in registers (`gemv`): one-hot rows give each weight bit for
    bit, and random rows stay within float32's bound, with K split over programs."""
    stack, w = make_stack(fmt)
    gemv = Blocks(block_k=128, tile_n=64, splits=2, gemv=True)
    for k0 in (0, 128):
        got = quant_matmul(jnp.eye(K, dtype=jnp.float32)[k0:k0 + 3], stack, 1, blocks=gemv, interpret=True)
        np.testing.assert_array_equal(np.asarray(got), w[1, k0:k0 + 3].astype(np.float32))
    x = RNG.standard_normal((1, K)).astype(np.float32)
    within_f32_bound(np.asarray(quant_matmul(jnp.asarray(x), stack, 2, blocks=gemv, interpret=True)), x,
                     w[2].astype(np.float32))


@pytest.mark.parametrize("gemv", [False, True])
def test_int4_steps_shorter_than_a_dot_per_nibble_read_a_word_per_input(gemv):
    """K = 64 (a tiny model's expert): under 128 inputs a step cannot give each nibble a 16-input
    dot, so each input reads its word; still bit for bit."""
    stack, w = make_stack("gptq32", k=64)
    x = jnp.eye(64, dtype=jnp.float32)[:3 if gemv else 64]
    got = quant_matmul(x, stack, 1, blocks=Blocks(64, 64, 1, gemv=gemv), interpret=True)
    np.testing.assert_array_equal(np.asarray(got), w[1, :x.shape[0]].astype(np.float32))


def test_every_tiling_computes_the_same_product(monkeypatch):
    """Other K steps, column tiles and splits (as a sweep or INFIRE_JAX_QUANT_BLOCKS sets them) change
    only the order of float32 sums; a tiling that does not divide the matrices is shrunk until it does."""
    stack, w = make_stack("gptq32")
    x = RNG.standard_normal((20, K)).astype(np.float32)
    for blocks in (Blocks(256, 128, 1), Blocks(128, 32, 2), Blocks(512, 256, 0, gemv=True)):
        within_f32_bound(np.asarray(quant_matmul(jnp.asarray(x), stack, 0, blocks=blocks, interpret=True)), x,
                         w[0].astype(np.float32))
    monkeypatch.setenv(quant_blocks.ENV, "block_k=256,tile_n=32,gemv=1")
    assert quant_blocks.choose(1, K, N, "int4") == Blocks(256, 32, 0, 4, 3, True)
    within_f32_bound(np.asarray(quant_matmul(jnp.asarray(x[:2]), stack, 0, interpret=True)), x[:2],
                     w[0].astype(np.float32))
    monkeypatch.setenv(quant_blocks.ENV, "block=256")
    with pytest.raises(ValueError, match="unknown field 'block'"):
        quant_blocks.choose(1, K, N, "int4")


def test_batch_one_expert_tiles_take_the_register_form():
    """A batch-1 MoE step (a row or two per expert) runs one-row tiles in registers, K split."""
    stack, w = make_stack("gptq32")
    sizes = np.array([1, 0, 2], np.int32)
    x = RNG.standard_normal((3, K)).astype(np.float32)
    assert quant_blocks.choose(1, K, N, "int4").gemv
    got = np.asarray(grouped_matmul(jnp.asarray(x), jnp.asarray(sizes), stack, 0,
                                    blocks=Blocks(128, 64, 2, gemv=True), interpret=True))
    for r, g in enumerate((0, 2, 2)):
        within_f32_bound(got[r:r + 1], x[r:r + 1], w[g].astype(np.float32))


def test_parts_that_do_not_fit_are_named():
    stack, _ = make_stack("gptq32")
    with pytest.raises(ValueError, match="part zero"):
        QuantStack(stack.values, stack.scale, stack.zero[:, :4], packing="int4").check()
    with pytest.raises(ValueError, match="x has 128 inputs"):
        quant_matmul(jnp.zeros((1, 128)), stack, 0, interpret=True)
    with pytest.raises(ValueError, match="cannot tile"):
        QuantStack(jnp.zeros((1, 24, 100), jnp.int8), jnp.zeros((1, 1, 100))).check()


@lowers_triton_here
@pytest.mark.parametrize("fmt", ["gptq32", "ct_int4", "q4_1", "q8_0", "fp8", "plain_bf16"])
def test_lowers_to_triton_for_cuda(fmt):
    """Both entry points lower through Pallas' Triton rules (jaxlib <= 0.10.2 emits the Triton IR
    without compiling it, so this runs on CPU; later jaxlibs compile while lowering, which needs a GPU),
    and compile for an H100 (tests/h100.py)."""
    stack, _ = make_stack(fmt)
    sd = jax.ShapeDtypeStruct
    abstract = jax.tree.map(lambda a: sd(a.shape, a.dtype), stack)
    x = sd((8, K), jnp.bfloat16)
    for fn, args in ((quant_matmul, (x, abstract, sd((), jnp.int32))),
                     (grouped_matmul, (sd((64, K), jnp.bfloat16), sd((S,), jnp.int32), abstract, sd((), jnp.int32)))):
        lowered = gpu_lowered(jax.jit(fn), *args)  # lowered once: its text, then compiled from it
        assert 'name = "quant_matmul"' in lowered.as_text(), fn.__name__
        assert launches(compiled_kernels(lowered), "quant_matmul"), fn.__name__  # sm_90a code


@lowers_triton_here
def test_a_kernel_shape_is_lowered_once_a_program():
    """Four layers' matmuls of one shape, unrolled as a decode step runs them, share one Triton lowering
    (`triton_backend.lowered_once`): the kernel is in the program once, called four times. Lowered one
    by one, each took ~40 ms of Python (docs/PERFORMANCE.md)."""
    stack, _ = make_stack("plain_bf16")
    sd = jax.ShapeDtypeStruct
    abstract = jax.tree.map(lambda a: sd(a.shape, a.dtype), stack)

    def layers(x, stack):
        return sum(quant_matmul(x, stack, layer) for layer in range(4))

    hlo = jax.jit(layers).trace(sd((8, K), jnp.bfloat16), abstract).lower(lowering_platforms=("cuda",)).as_text()
    assert hlo.count('name = "quant_matmul"') == 1
    assert hlo.count("call @_tiles_call") == 4


@lowers_triton_here
def test_chosen_and_swept_tilings_lower_to_triton_for_cuda():
    """Every benchmark case's chosen tiling, and every candidate a sweep tries for an int4 batch-1
    step, lowers through Pallas' Triton rules (so a GPU sweep meets no lowering error)."""
    from pallas_kernels import quant_bench

    sd = jax.ShapeDtypeStruct

    def lower(case, blocks=None):
        stack = jax.eval_shape(lambda: quant_bench.random_stack(case.fmt, 2, case.k, case.n, jax.random.key(0)))
        if case.kind == "dense":
            fn, args = quant_matmul, (sd((case.rows, case.k), jnp.bfloat16), stack, sd((), jnp.int32))
        else:
            fn, args = grouped_matmul, (sd((case.rows * case.top_k, case.k), jnp.bfloat16),
                                        sd((case.experts,), jnp.int32), stack, sd((), jnp.int32))
        jitted = jax.jit(lambda *a: fn(*a, blocks=blocks))
        if blocks is None:  # the chosen tilings also compile to sm_90a (shared memory within the card's)
            lowered = gpu_lowered(jitted, *args)  # lowered once: its text, then compiled from it
            assert 'name = "quant_matmul"' in lowered.as_text(), case.name
            assert launches(compiled_kernels(lowered), "quant_matmul"), case.name
        else:
            hlo = jitted.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            assert 'name = "quant_matmul"' in hlo, (case.name, blocks)

    cases, kernels = quant_bench.quant_cases(), {}
    for case in cases:  # one case per distinct kernel: form, format and tiling
        tiling = quant_blocks.choose(quant_bench.tile_rows(case), case.k, case.n, quant_bench.packing(case),
                                     group=quant_bench.group(case))
        kernels.setdefault((case.kind, case.fmt, tiling, case.rows <= 2), case)
    for case in kernels.values():
        lower(case)
    case = next(c for c in cases if c.name == "int4_o_m1")
    swept = quant_blocks.candidates(1, case.k, case.n, "int4") + [Blocks(64, 64, gemv=g) for g in (0, 1)]
    if jaxlib_version() <= (0, 10, 2):
        # This jaxlib's lowering emits the Triton IR uncompiled, the warps an attribute of the call beside
        # it: candidates that differ in warps alone lower to the same IR, so one of each is lowered (later
        # jaxlibs compile while lowering, warps included, and lower every candidate).
        firsts = {}
        for blocks in swept:
            firsts.setdefault(dataclasses.replace(blocks, num_warps=0), blocks)
        swept = list(firsts.values())
    for blocks in swept:
        lower(case, blocks)  # the last two read a word per input


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="runs the compiled Triton kernels, needs a GPU")
def test_compiled_kernels_on_gpu_match_the_definition():
    """The kernels compiled for the GPU, every format: bfloat16 steps of 1 (in registers) and 70 rows
    and grouped steps of both forms, against float64 over the definition's weights rounded to
    bfloat16 (what the dot is fed)."""
    for fmt in FORMATS:
        stack, w = make_stack(fmt)
        w16 = w.astype(np.float32).astype(ml_dtypes.bfloat16)
        for rows in (1, 70):
            x = RNG.standard_normal((rows, K)).astype(ml_dtypes.bfloat16)
            within_f32_bound(np.asarray(quant_matmul(jnp.asarray(x), stack, 1)), x, w16[1])
        for sizes in (np.array([5, 0, 40], np.int32), np.array([1, 0, 1], np.int32)):  # dot and register tiles
            x = RNG.standard_normal((int(sizes.sum()), K)).astype(ml_dtypes.bfloat16)
            got = np.asarray(grouped_matmul(jnp.asarray(x), jnp.asarray(sizes), stack, 0))
            for r, g in enumerate(np.repeat(np.arange(3), sizes)):
                within_f32_bound(got[r:r + 1], x[r:r + 1], w16[g])


def test_benchmark_rows_and_sweep_run_in_interpret_mode():
    """`python -m pallas_kernels.benchmark --quant [--sweep]`'s plumbing on tiny shapes: the grid it
    covers, a dense and a grouped row with their bfloat16 references, and a sweep's best tiling."""
    from pallas_kernels import benchmark, quant_bench

    names = {c.name for c in quant_bench.quant_cases()}
    assert {"int4_gate_up_m1", "int8_down_m64", "q4_1_qkv_m16", "fp8_o_m1", "kimi_k2_5_ct_int4_gate_up_b1",
            "qwen3_30b_a3b_bf16_down_b64", "gpt_oss_120b_mxfp4_down_b1"} <= names and \
        len(names) == 4 * 4 * 3 + 2 * 4 * 2
    dense = quant_bench.QuantCase("int8_tiny_m1", "dense", "int8", 128, 64, 1)
    grouped = quant_bench.QuantCase("moe_tiny_b1", "grouped", "bf16", 64, 32, 1, experts=4, top_k=2)
    for case, references in ((dense, ["bf16_dot"]), (grouped, ["bf16_ragged_dot"])):
        rows = quant_bench.run_quant_case(case, iters=1, repeats=1, hbm_bytes_per_s=1e9, interpret=True)
        assert [e["kernel"] for e in rows] == ["kernel"] + references
        for entry in rows:
            assert "error" not in entry, entry["error"]
            assert entry["hbm_fraction"] == pytest.approx(entry["bytes"] / entry["seconds"] / 1e9)
    sweep = quant_bench.sweep_case(dense, iters=1, repeats=1, interpret=True, limit=2)
    assert len(sweep["tried"]) == 2 and sweep["best"] in [label for label, _ in sweep["tried"]]
    assert benchmark.quant_report("^$", False, False, 1, 1e9, interpret=True) == {"results": []}
