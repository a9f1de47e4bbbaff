"""MXFP4 (gpt-oss's expert weights) kept quantized: the dequantizer bit for bit against transformers'
own (`convert_moe_packed_tensors`, pure torch), the kept parts in the engine's expert layout against
the same, the Pallas kernels (`packing="mxfp4"`, interpret mode) against float64, their lowering and
compilation for an H100, the MoE paths that take kept experts, and the memory plan's 4.25 bits."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from h100 import compiled_kernels, gpu_lowered, launches, lowers_triton_here
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from infire_jax.memplan.model import FORMAT_BYTES, formats_from_hf, from_model_config, placed_config
from infire_jax.memplan.plan import check_fits, memory_plan
from infire_jax.models.hf_config import config_from_hf
from infire_jax.models import moe, quant_kernels
from infire_jax.quant import grouped, mxfp4
from pallas_kernels.quant_blocks import Blocks
from pallas_kernels.quant_matmul import QuantStack, grouped_matmul, quant_matmul, quant_matmul_parts, sum_parts
from sharding.mesh import CONFIG_DIR, MeshConfig

RNG = np.random.default_rng(11)
TORCH = {jnp.bfloat16: torch.bfloat16, jnp.float32: torch.float32, jnp.float16: torch.float16}


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _transformers(blocks: np.ndarray, scales: np.ndarray, dtype) -> np.ndarray:
    """transformers' dequantized weights [X, in, out], as float bits."""
    w = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=TORCH[dtype])
    return w.contiguous().view(torch.int16 if w.element_size() == 2 else torch.int32).numpy().view(
        np.uint16 if w.element_size() == 2 else np.uint32)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float16])
def test_every_byte_and_scale_dequantizes_as_transformers_does(dtype):
    """All 256 bytes (both nibbles) under all 256 e8m0 scales, extremes included (subnormals, inf, nan)."""
    blocks = np.tile(np.arange(256, dtype=np.uint8).reshape(1, 1, 16, 16), (1, 256, 1, 1))
    scales = np.repeat(np.arange(256, dtype=np.uint8)[None, :, None], 16, axis=-1)
    got = mxfp4.dequantize_blocks(jnp.asarray(blocks), jnp.asarray(scales), dtype)
    np.testing.assert_array_equal(_bits(got).transpose(0, 2, 1), _transformers(blocks, scales, dtype))


def test_random_blocks_dequantize_as_transformers_does():
    blocks = RNG.integers(0, 256, (3, 40, 4, 16), dtype=np.uint8)
    scales = RNG.integers(0, 256, (3, 40, 4), dtype=np.uint8)
    got = mxfp4.dequantize_blocks(jnp.asarray(blocks), jnp.asarray(scales), jnp.bfloat16)
    np.testing.assert_array_equal(_bits(got).transpose(0, 2, 1), _transformers(blocks, scales, jnp.bfloat16))


def _checkpoint(x: int, out: int, inp: int, low: int = 0, high: int = 256) -> tuple[np.ndarray, np.ndarray]:
    return (RNG.integers(0, 256, (x, out, inp // 32, 16), dtype=np.uint8),
            RNG.integers(low, high, (x, out, inp // 32), dtype=np.uint8))


def test_kept_parts_in_the_expert_layout_dequantize_as_transformers_does():
    """gate_up_proj [X, 2F, E] (gate, up interleaved) -> w_gate_up [X, E, 2, F]; down_proj [X, E, F] ->
    w_down [X, F, E]; a kept weight's dequantization, whole and one expert at a time, is transformers'."""
    x, e, f = 3, 64, 96
    gu_b, gu_s = _checkpoint(x, 2 * f, e)
    d_b, d_s = _checkpoint(x, e, f)
    gate_up = mxfp4.kept_from_hf("gate_up_proj", gu_b, gu_s)
    down = mxfp4.kept_from_hf("down_proj", d_b, d_s)
    layout = grouped.GroupedLayout("mxfp4", 32, jnp.uint8)
    for name, parts, shape in (("w_gate_up", gate_up, (x, e, 2, f)), ("w_down", down, (x, f, e))):
        want = {p: s for p, (s, _) in layout.part_shapes(f"moe_layers.{name}", shape).items()}
        assert {p: a.shape for p, a in parts.items()} == want and grouped.is_kept(parts)
    ref_gu = _transformers(gu_b, gu_s, jnp.bfloat16)  # [X, E, 2F]
    ref_gu = np.stack([ref_gu[..., ::2], ref_gu[..., 1::2]], axis=2)
    ref_d = _transformers(d_b, d_s, jnp.bfloat16)
    gate_up, down = jax.tree.map(jnp.asarray, (gate_up, down))
    np.testing.assert_array_equal(_bits(grouped.dequantize(gate_up, "w_gate_up", jnp.bfloat16)), ref_gu)
    np.testing.assert_array_equal(_bits(grouped.dequantize(down, "w_down", jnp.bfloat16)), ref_d)
    np.testing.assert_array_equal(_bits(grouped.expert_weight(down, jnp.int32(2), "w_down", jnp.bfloat16)), ref_d[2])
    # a stack of layers [L, X, ...] dequantizes on the same input axis (counted from the end)
    layers = jax.tree.map(lambda a: jnp.stack([a, a]), gate_up)
    np.testing.assert_array_equal(_bits(grouped.dequantize(layers, "w_gate_up", jnp.bfloat16))[1], ref_gu)


def test_bad_input_is_named():
    b, s = _checkpoint(2, 8, 64)
    with pytest.raises(ValueError, match="do not match scales"):
        mxfp4.dequantize_blocks(jnp.asarray(b), jnp.asarray(s[..., :1]))
    with pytest.raises(ValueError, match="uint8"):
        mxfp4.dequantize_blocks(jnp.asarray(b.astype(np.int32)), jnp.asarray(s))
    with pytest.raises(ValueError, match="up_proj: not a gpt-oss expert weight"):
        mxfp4.kept_from_hf("up_proj", b, s)
    with pytest.raises(ValueError, match="down_proj: MXFP4 blocks"):
        mxfp4.kept_from_hf("down_proj", b[..., :8], s)
    with pytest.raises(ValueError, match="do not tile its input axis of 48"):
        grouped.GroupedLayout("mxfp4", 32, jnp.uint8).part_shapes("moe_layers.w_down", (2, 48, 64))
    with pytest.raises(ValueError, match="one uint8 scale per 32"):
        grouped.GroupedLayout("mxfp4", 32, jnp.bfloat16).part_shapes("moe_layers.w_down", (2, 64, 64))
    stack, _ = make_stack(1, 64, 32)
    with pytest.raises(ValueError, match="mxfp4 blocks hold 32 inputs a scale"):
        QuantStack(stack.values, stack.scale[:, :1], packing="mxfp4").check()
    with pytest.raises(ValueError, match="uint8 e8m0 scales alone"):
        QuantStack(stack.values, stack.scale.astype(jnp.float32), packing="mxfp4").check()


# ---- the Pallas kernels, interpret mode, against float64 ----

def make_stack(s: int, k: int, n: int) -> tuple[QuantStack, np.ndarray]:
    """A random MXFP4 stack [S, K, N] (scales 2^-12 .. 2^3, as checkpoints hold) and its float64 weights."""
    packed = RNG.integers(0, 256, (s, k // 2, n), dtype=np.uint8)
    scale = RNG.integers(115, 131, (s, k // 32, n), dtype=np.uint8)
    codes = np.stack([packed & 0xF, packed >> 4], axis=2).reshape(s, k, n)  # input 2j: low nibble of byte j
    w = mxfp4.FP4_VALUES[codes].astype(np.float64) * np.repeat(2.0 ** (scale.astype(np.float64) - 127), 32, axis=1)
    return QuantStack(jnp.asarray(packed), jnp.asarray(scale), packing="mxfp4"), w


def within_f32_bound(got, x: np.ndarray, w: np.ndarray) -> None:
    """float32 accumulation of K products: within K * 2^-23 of |x| @ |W|."""
    x, w = x.astype(np.float64), w.astype(np.float64)
    err = np.abs(np.asarray(got, np.float64) - x @ w)
    assert np.all(err <= x.shape[1] * 2.0 ** -23 * (np.abs(x) @ np.abs(w)) + 1e-30), err.max()


@pytest.mark.parametrize("blocks", [None, Blocks(32, 16, 1), Blocks(64, 32, 1, gemv=True)])
def test_kernel_dequantizes_exactly(blocks):
    """x = I: every output is one weight, the definition's value (exact in float32)."""
    stack, w = make_stack(2, 128, 64)
    got = quant_matmul(jnp.eye(128, dtype=jnp.float32), stack, 1, blocks=blocks, interpret=True)
    np.testing.assert_array_equal(np.asarray(got), w[1].astype(np.float32))


@pytest.mark.parametrize("rows,k,n", [(1, 256, 64), (3, 96, 48), (20, 512, 32)])
def test_quant_matmul_within_float32_bound(rows, k, n):
    stack, w = make_stack(3, k, n)
    x = RNG.standard_normal((rows, k)).astype(np.float32)
    within_f32_bound(quant_matmul(jnp.asarray(x), stack, jnp.int32(2), interpret=True), x, w[2])
    parts = quant_matmul_parts(jnp.asarray(x), stack, 0, blocks=Blocks(32, 16, 2), interpret=True)
    assert parts.shape[0] == 2  # K split in two, summed outside
    within_f32_bound(sum_parts(parts, rows), x, w[0])


def test_bfloat16_steps_and_fused_swiglu():
    """bfloat16 x (weights rounded once to bfloat16: exact, two significant bits); the down projection
    forming silu(gate) * up from the gate/up projection's partials."""
    gate_up, w_gu = make_stack(1, 64, 128)
    down, w_d = make_stack(1, 64, 64)
    x = RNG.standard_normal((2, 64)).astype(jnp.bfloat16)
    within_f32_bound(quant_matmul(jnp.asarray(x), gate_up, 0, interpret=True), np.asarray(x, np.float32), w_gu[0])
    parts = quant_matmul_parts(jnp.asarray(x), gate_up, 0, interpret=True)
    h = np.asarray(parts.sum(axis=0)[:2].astype(jnp.bfloat16), np.float64)
    act = h[:, :64] / (1 + np.exp(-h[:, :64])) * h[:, 64:]  # float64; the kernel's rounds once to bfloat16
    got = np.asarray(sum_parts(quant_matmul_parts(parts, down, 0, swiglu_dtype=jnp.bfloat16, interpret=True), 2))
    bound = 2.0 ** -8 * np.abs(act) @ np.abs(w_d[0]) * 1.01 + 64 * 2.0 ** -23 * np.abs(act) @ np.abs(w_d[0])
    assert np.all(np.abs(got - act @ w_d[0]) <= bound)


@pytest.mark.parametrize("sizes", [[0, 19, 3, 1], [1, 0, 0, 1]])
def test_grouped_matmul_rows_take_their_experts(sizes):
    """Ragged groups (empty ones, a tile-straddling one, batch 1) and rows past their sum (another
    device's experts) against each row's own expert; `first` offsets into a later layer's experts."""
    stack, w = make_stack(5, 128, 64)
    sizes = np.array(sizes, np.int32)
    m = int(sizes.sum()) + 3
    x = RNG.standard_normal((m, 128)).astype(np.float32)
    got = np.asarray(grouped_matmul(jnp.asarray(x), jnp.asarray(sizes), stack, 1, interpret=True))
    for r, g in enumerate(np.repeat(np.arange(len(sizes)), sizes)):
        within_f32_bound(got[r:r + 1], x[r:r + 1], w[1 + g])
    np.testing.assert_array_equal(got[int(sizes.sum()):], 0)


def test_moe_paths_take_kept_experts():
    """A layer's kept MXFP4 experts [L, X, ...]: the grouped kernel's stacks (what the GPU path hands
    `grouped_matmul`) and the tiled loop (the CPU path, one expert dequantized as its tile reaches it)
    both give the dequantized experts' product."""
    x_, e, f, rows = 4, 64, 32, 12
    kept = {"w_gate_up": mxfp4.kept_from_hf("gate_up_proj", *_checkpoint(x_, 2 * f, e, 118, 130)),
            "w_down": mxfp4.kept_from_hf("down_proj", *_checkpoint(x_, e, f, 118, 130))}
    layers = {k: {p: jnp.asarray(np.stack([a, a])) for p, a in v.items()} for k, v in kept.items()}
    stacks = quant_kernels.kernel_stacks(layers, rows, {}, quant_kernels.EXPERT_INPUTS)
    assert {k: (s.stack.packing, s.shape, s.experts) for k, s in stacks.items()} == \
        {"w_gate_up": ("mxfp4", (e, 2, f), x_), "w_down": ("mxfp4", (f, e), x_)}
    floats = {k: grouped.dequantize(jax.tree.map(jnp.asarray, v), k, jnp.float32) for k, v in kept.items()}
    xs = jnp.asarray(RNG.standard_normal((rows, e)).astype(np.float32))
    d = moe.dispatch(xs, jnp.asarray(RNG.integers(0, x_, (rows, 1)), jnp.int32), x_)
    gu = stacks["w_gate_up"].grouped(d.x, d.group_sizes, jnp.int32(1))
    order = np.repeat(np.arange(x_), np.asarray(d.group_sizes))
    w_gu = np.asarray(floats["w_gate_up"]).reshape(x_, e, 2 * f)
    for r, g in enumerate(order):
        within_f32_bound(np.asarray(gu)[r:r + 1], np.asarray(d.x)[r:r + 1], w_gu[g])
    tiled = moe.expert_mlp(d, {k: jax.tree.map(jnp.asarray, v) for k, v in kept.items()}, "tiled")
    np.testing.assert_array_equal(np.asarray(tiled), np.asarray(moe.expert_mlp(d, floats, "tiled")))


@lowers_triton_here
def test_kernels_compile_for_an_h100():
    """Both entry points lower through Pallas' Triton rules and compile to sm_90a (tests/h100.py), at
    gpt-oss-20b's gate/up expert shape (K 2880 = 90 blocks: K steps of at most 64; N 5760), for a decode
    row, a batch-1 MoE step (register form) and a prefill chunk (64-row tiles: dots on strided x)."""
    sd = jax.ShapeDtypeStruct
    stack = QuantStack(sd((32, 1440, 5760), jnp.uint8), sd((32, 90, 5760), jnp.uint8), packing="mxfp4")
    for fn, args in ((quant_matmul, (sd((1, 2880), jnp.bfloat16), stack, sd((), jnp.int32))),
                     (grouped_matmul, (sd((64, 2880), jnp.bfloat16), sd((32,), jnp.int32), stack,
                                       sd((), jnp.int32))),
                     (grouped_matmul, (sd((2048, 2880), jnp.bfloat16), sd((32,), jnp.int32), stack,
                                       sd((), jnp.int32)))):
        lowered = gpu_lowered(jax.jit(fn), *args)
        assert 'name = "quant_matmul"' in lowered.as_text(), fn.__name__
        assert launches(compiled_kernels(lowered), "quant_matmul"), fn.__name__


def test_plan_counts_mxfp4_experts_at_4_25_bits():
    """gpt-oss's quantization_config: the experts MXFP4, the rest (modules_to_not_convert) bfloat16."""
    assert FORMAT_BYTES["mxfp4"] * 8 == 4.25
    q = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                             "model.embed_tokens", "lm_head"]}
    formats = formats_from_hf({"quantization_config": q}, "bfloat16")
    assert formats == {"attention": "bfloat16", "experts": "mxfp4", "shared": "bfloat16", "embeddings": "bfloat16",
                       "vision": "bfloat16", "speculation": "bfloat16"}
    for skip in (["model.layers.*.mlp.experts"], ["experts"], ["model.layers.*.mlp"]):
        q = {"quant_method": "mxfp4", "modules_to_not_convert": skip}
        assert formats_from_hf({"quantization_config": q}, "bfloat16")["experts"] == "bfloat16", skip


def test_plan_holds_mxfp4_experts_in_whole_blocks():
    """A MoE model's routed experts planned as MXFP4 take 4.25 / 16 of their bfloat16 bytes on each
    device; a mesh that would cut an expert's input axis inside a block of 32 is refused by name."""
    moe_cfg = config_from_hf(dict(model_type="mixtral", vocab_size=256, hidden_size=64, num_attention_heads=8,
                                  num_key_value_heads=2, max_position_embeddings=512, intermediate_size=64,
                                  num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2))

    def plan(mesh: str, experts: str):
        mc = MeshConfig.from_yaml(f"{CONFIG_DIR}/{mesh}")
        formats = {k: "bfloat16" for k in ("attention", "shared", "embeddings", "vision")} | {"experts": experts}
        model = from_model_config(placed_config(moe_cfg, mc), "bfloat16", formats=formats)
        return model, mc

    for mesh in ("8-ep8.yaml", "8-tp2-ep4.yaml"):  # tp2 splits each expert's 64 intermediate inputs into 2 blocks
        (model, mc), (plain, _) = plan(mesh, "mxfp4"), plan(mesh, "bfloat16")
        assert check_fits(model, mc) is None
        got, want = memory_plan(model, mc, 2**30), memory_plan(plain, mc, 2**30)
        assert got.weights["experts"] == want.weights["experts"] * 4.25 / 16
        assert got.weights["attention"] == want.weights["attention"]
    assert check_fits(*plan("8-tp4-pp2.yaml", "mxfp4")) == \
        "MXFP4 weight w_down: its 64 inputs (blocks of 32) cannot be split 4 ways into whole blocks"
