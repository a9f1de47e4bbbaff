"""Models whose quantized weights (and MoE experts) the GPU's quantized matmul kernels read in place
(models/quant_kernels.py), run here in Pallas interpret mode by choosing the kernels explicitly.

- Each real loader's kept form, viewed as the kernel reads it, gives the weights the layer-body
  dequantizer gives, bit for bit: the default GGUF's Q4_1, int8, fp8 and int4 at load, GPTQ / AWQ,
  8-bit and fp8-block checkpoints, and DeepSeek / Kimi int4 and fp8 dense weights and routed
  experts (act-order GPTQ stays in the layer body).
- Engines with the kernels chosen produce the tokens of engines without them, with logprobs within
  float32 rounding, and their forward runs the kernels (tests/test_step_program.py checks that the
  GPU forward with them holds nothing the host waits for).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from channel_models import write_checkpoints as channel_checkpoints
from deepseek_models import hf_model, quantize_checkpoint, save
from gptq_awq_models import write_checkpoint
from test_step_program import forward_jaxpr, kernel_names

from infire_jax.models import deepseek
from infire_jax.models.llama import in_place_weights
from infire_jax.models.panels import INPUT_AXES
from infire_jax.models.parallel import Reductions
from infire_jax.models.quant_kernels import KernelQuantWeight, layer_stacks
from infire_jax.quant.resident import dequantize_layer
from pallas_kernels.quant_matmul import quant_matmul

RNG = np.random.default_rng(3)
KERNELS = {"INFIRE_JAX_QUANT_MATMUL": "pallas", "INFIRE_JAX_MOE_GROUPED": "pallas"}
WITHOUT = {"INFIRE_JAX_QUANT_MATMUL": "xla", "INFIRE_JAX_MOE_GROUPED": "tiled"}


def _use(monkeypatch, env: dict[str, str]) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)


def _assert_reads_as(kw: KernelQuantWeight, index: int, want: np.ndarray, name: str) -> None:
    """Rows of W[index] picked by one-hot x, through the kernel, equal `want` [K, N] (the layer-body
    dequantization) bit for bit; 48 random inputs cover every packing position."""
    k = want.shape[0]
    rows = np.sort(RNG.choice(k, min(k, 48), replace=False))
    got = quant_matmul(jnp.eye(k, dtype=jnp.float32)[rows], kw.stack, index, interpret=True)
    np.testing.assert_array_equal(np.asarray(got), want[rows], err_msg=name)


def _dense_layers(weights: dict, prefix: str, names, layers: int = 2) -> dict:
    out = {}
    for name in names:
        parts = {k[len(f"{prefix}{name}."):]: jnp.asarray(v[:layers]) for k, v in weights.items()
                 if k.startswith(f"{prefix}{name}.")}
        out[name] = parts or jnp.asarray(weights[f"{prefix}{name}"][:layers])
    return out


@pytest.fixture(scope="module")
def gguf_kept(default_gguf):
    from infire_jax.loaders.gguf_quant import load_gguf_quantized

    return load_gguf_quantized(default_gguf)[0].weights


@pytest.fixture(scope="module")
def float_layers(default_gguf):
    """The default model's first two layers, dequantized at load."""
    from infire_jax.loaders.gguf import load_gguf

    return {k: v[:2] for k, v in load_gguf(default_gguf).weights.items() if k.startswith("layers.")}


@pytest.fixture(scope="module")
def channels_kept(float_layers):
    """int8 and fp8 at load, a scale per output channel (quant/resident.py)."""
    from infire_jax.quant.resident import quantize_channels

    return {kind: quantize_channels(float_layers, kind)[0] for kind in ("int8", "fp8")}


@pytest.fixture(scope="module")
def int4_kept(float_layers):
    """int4 at load (quant/int4_rtn.py) by group size: 128 (576 inputs end in a short group: kept in
    64s; down's 1536 in 128s) and 32."""
    from infire_jax.quant.int4_rtn import quantize_int4

    return {group: quantize_int4(float_layers, group)[0] for group in (128, 32)}


@pytest.fixture(scope="module")
def gptq_dirs(tmp_path_factory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("kernel_gptq")
    cases = {"awq-g32": ("awq", 32, False, False), "gptq-sym-per-channel": ("gptq", -1, True, False),
             "gptq-act-order": ("gptq", 32, False, True)}
    for name, (method, group, sym, act_order) in cases.items():
        write_checkpoint(base / name, method, group, sym=sym, act_order=act_order)
    paths = {name: str(base / name) for name in cases}
    for name in ("fp8-static", "w8a8-int8", "fp8-block"):  # 8-bit values, a scale per row (or tensor, or block)
        paths[name] = channel_checkpoints(base, name)[0]
    return paths


@pytest.fixture(scope="module")
def deepseek_dirs(tmp_path_factory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("kernel_deepseek")
    paths = {}
    for name, scheme, size in (("deepseek-v3", "fp8", 16), ("kimi-k2.5", "int4", 32)):
        paths[name] = save(name, hf_model(name), base / name)
        quantize_checkpoint(paths[name], scheme, size)
    return paths


@pytest.mark.parametrize("tokens", [1, 64, 65])
def test_plain_weights_of_a_gpu_decode_step_are_read_in_place(tokens, monkeypatch):
    """On a GPU a step of at most one row tile (64 tokens) multiplies plain layer weights with the kernel
    reading the layer of the stack in place (XLA's GPU GEMM would copy it out first: tests/test_gpu_compile.py):
    it reads the weights exactly and sums within float32 rounding of float64; wider steps keep XLA's GEMM.
    Chosen here (interpret mode) as a GPU's default is."""
    from infire_jax.models.config import ModelConfig

    _use(monkeypatch, {**KERNELS, "INFIRE_JAX_DENSE_MATMUL": "pallas"})
    e, f, hkv, heads, d, layers = 64, 128, 2, 4, 16, 3
    shapes = {"wqkv": (layers, e, hkv, heads // hkv + 2, d), "wo": (layers, heads, d, e),
              "w_gate_up": (layers, e, 2, f), "w_down": (layers, f, e)}
    stacks = {k: jnp.asarray(0.1 * RNG.standard_normal(s).astype(np.float32)) for k, s in shapes.items()}
    cfg = ModelConfig(architecture="llama", vocab_size=8, hidden_size=e, intermediate_size=f, num_layers=layers,
                      num_heads=heads, num_kv_heads=hkv, head_dim=d)
    def kernel_read() -> dict:  # (a CPU's own kernel may take plain float32 stacks in small steps: cpu_matmul)
        found = in_place_weights(cfg, stacks, tokens=tokens, red=Reductions())
        return {k: v for k, v in found.items() if isinstance(v[0], KernelQuantWeight)}

    in_place = kernel_read()
    if tokens > 64:
        assert in_place == {}
        return
    assert set(in_place) == set(INPUT_AXES)
    for name, (kw, shape) in in_place.items():
        assert shape == shapes[name][1:]
        w = np.asarray(stacks[name][2]).reshape(int(np.prod(shape[:INPUT_AXES[name]])), -1)
        _assert_reads_as(kw, 2, w, name)
        x = RNG.standard_normal((tokens, w.shape[0])).astype(np.float32)
        got = np.asarray(kw.matmul(jnp.asarray(x), jnp.int32(2)))
        scale = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64)
        assert np.all(np.abs(got - x.astype(np.float64) @ w.astype(np.float64)) <= 1e-6 * scale + 1e-30), name
    monkeypatch.setenv("INFIRE_JAX_DENSE_MATMUL", "xla")
    assert kernel_read() == {}


@pytest.mark.parametrize("source", ["gguf", "int8", "fp8", "int4-g128", "int4-g32", "awq-g32",
                                    "gptq-sym-per-channel", "fp8-static", "w8a8-int8", "fp8-block"])
def test_llama_kept_weights_read_in_place_equal_the_layer_body_dequantization(source, request, monkeypatch):
    _use(monkeypatch, KERNELS)
    if source.startswith("int4-g"):
        weights = request.getfixturevalue("int4_kept")[int(source[6:])]
    elif source in ("int8", "fp8"):
        weights = request.getfixturevalue("channels_kept")[source]
    elif source == "gguf":
        weights = request.getfixturevalue("gguf_kept")
    else:
        from infire_jax.loaders.llama_quant import load_llama_kept

        weights = load_llama_kept(request.getfixturevalue("gptq_dirs")[source])[0].weights
    stacks = _dense_layers(weights, "layers.", INPUT_AXES)
    from infire_jax.models.config import ModelConfig

    cfg = ModelConfig(architecture="llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=2,
                      num_heads=1, num_kv_heads=1, head_dim=8)  # only is_moe is read
    in_place = in_place_weights(cfg, stacks, tokens=4, red=Reductions())
    assert set(in_place) == set(INPUT_AXES)
    for name, (kw, shape) in in_place.items():
        plain = np.asarray(dequantize_layer({name: jax.tree.map(lambda a: a[1], stacks[name])}, jnp.float32)[name])
        assert plain.shape == shape, name
        k = int(np.prod(shape[:INPUT_AXES[name]]))
        _assert_reads_as(kw, 1, plain.reshape(k, -1), name)
    # steps of more than MAX_DENSE_ROWS tokens dequantize in the layer body; so does every step with xla
    assert not in_place_weights(cfg, stacks, tokens=512, red=Reductions())
    monkeypatch.setenv("INFIRE_JAX_QUANT_MATMUL", "xla")
    assert not in_place_weights(cfg, stacks, tokens=4, red=Reductions())


def test_act_order_gptq_stays_in_the_layer_body(gptq_dirs, monkeypatch):
    """Act-order's per-input group index is a gather the kernel does not do."""
    from infire_jax.loaders.llama_quant import load_llama_kept
    from infire_jax.models.quant_kernels import kernel_stacks

    _use(monkeypatch, KERNELS)
    weights = load_llama_kept(gptq_dirs["gptq-act-order"])[0].weights
    assert kernel_stacks(_dense_layers(weights, "layers.", INPUT_AXES), 4, INPUT_AXES) == {}


@pytest.mark.parametrize("name", ["deepseek-v3", "kimi-k2.5"])
def test_deepseek_kept_weights_and_experts_read_in_place_equal_the_dequantization(name, deepseek_dirs, monkeypatch):
    from infire_jax.loaders.deepseek_quant import load_kept
    from infire_jax.quant.grouped import dequantize

    _use(monkeypatch, KERNELS)
    loaded, layouts = load_kept(deepseek_dirs[name])
    for stack, moe in (("dense_layers", False), ("moe_layers", True)):
        names = {n.split(".")[1] for n in loaded.weights if n.startswith(f"{stack}.")}
        weights = _dense_layers(loaded.weights, f"{stack}.", names, layers=1)
        in_place = layer_stacks(weights, 4, deepseek.DENSE_INPUTS, moe, one_device=True)
        kept = {n.split(".")[1] for n in layouts if n.startswith(f"{stack}.")}
        # kept dense weights the kernel can tile (DeepSeek's 40-wide wkv_a cannot: N needs a factor of 16), and
        # a MoE stack's experts, kept quantized or plain
        experts = {"w_gate_up", "w_down"} if moe else set()
        assert set(in_place) == {n for n in kept - experts if n in deepseek.DENSE_INPUTS and n != "wkv_a"} | experts
        for short, (kw, shape) in in_place.items():
            value = weights[short]
            full = dequantize(value, short, jnp.float32)[0] if isinstance(value, dict) else value[0]
            full = np.asarray(full)
            if kw.experts:
                for e in (0, kw.experts - 1):
                    _assert_reads_as(kw, e, full[e].reshape(full.shape[1], -1), f"{stack}.{short}[{e}]")
            else:
                k = int(np.prod(shape[:deepseek.DENSE_INPUTS[short]]))
                _assert_reads_as(kw, 0, full.reshape(k, -1), f"{stack}.{short}")


def _generate(llm, prompts, tokens: int = 12):
    from infire_jax import SamplingParams

    return llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, logprobs=1))


def _assert_same(ours, want, atol: float = 1e-5) -> None:
    for q, f in zip(ours, want):
        assert q.token_ids == f.token_ids
        np.testing.assert_allclose([lp[t].logprob for lp, t in zip(q.logprobs, q.token_ids)],
                                   [lp[t].logprob for lp, t in zip(f.logprobs, f.token_ids)], atol=atol, rtol=0)


def _engines(monkeypatch, kernels: dict[str, str] = KERNELS, **kwargs):
    """(an engine without the kernels, one with them) on the same model."""
    from infire_jax import LLM

    engines = []
    for env in (WITHOUT, kernels):
        _use(monkeypatch, env)
        engines.append(LLM(**kwargs))
    return engines


# A decode-sized bucket and a prefill-sized one (the 40-token prompt is chunked).
# No decode bursts (num_decode_steps=1): a burst is the engine's largest program, compiled once per
# engine, and runs the same model (bursts are tested in test_decode_burst.py).
ENGINE = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(4, 32), max_model_len=128,
              num_kv_pages=40, num_decode_steps=1)
PROMPTS = [[5, 77, 200, 13, 42], [258, 3, 3, 190, 64, 99, 120, 7, 250, 11, 31], list(range(60, 100))]


def test_engine_with_kept_awq_in_the_kernel_equals_the_layer_body_engine(gptq_dirs, monkeypatch):
    plain, kernel = _engines(monkeypatch, model=gptq_dirs["awq-g32"], weights_quantization="checkpoint", **ENGINE)
    for tokens in (4, 32):
        names = kernel_names(forward_jaxpr(kernel.engine.runner, tokens))
        assert names.count("quant_matmul") == 4, names  # q/k/v, o, gate/up, down; each read in place
        # o's partials added to the residual and normed in one kernel; silu(gate) * up inside down's
        assert names.count("residual_rms_norm") == 1, names
    _use(monkeypatch, WITHOUT)  # a program is traced under the environment's choice
    assert "quant_matmul" not in kernel_names(forward_jaxpr(plain.engine.runner, 4))
    _assert_same(_generate(kernel, PROMPTS), _generate(plain, PROMPTS))
    for llm in (plain, kernel):
        llm.engine.close()


def test_engine_with_kept_deepseek_in_the_kernels_equals_the_engine_without(deepseek_dirs, monkeypatch):
    """DeepSeek-V3's fp8 dense weights and routed experts through the kernels (Kimi's int4 experts run
    through them on ep8 in test_deepseek_quant.py)."""
    plain, kernel = _engines(monkeypatch, model=deepseek_dirs["deepseek-v3"], weights_quantization="checkpoint",
                             **ENGINE)
    jaxpr = forward_jaxpr(kernel.engine.runner, 4)
    # wq_a, wq_b, wo of both stacks, the dense MLP's two, the shared MLP's two, and the experts' two
    assert kernel_names(jaxpr).count("quant_matmul") == 12, kernel_names(jaxpr)
    _assert_same(_generate(kernel, PROMPTS), _generate(plain, PROMPTS))
    for llm in (plain, kernel):
        llm.engine.close()


def test_engine_reading_mla_heads_in_place_equals_the_engine_without(deepseek_dirs, monkeypatch):
    """Kimi K2.5 (int4 experts kept, the rest plain) with a decode-sized step's plain layer weights read in
    place as on a GPU: MLA's per-head W_uk and W_uv through `head_matmul` (XLA's batched GEMM would copy each
    layer's out of the stack: tests/test_gpu_compile.py), the dense ones through the quantized matmul."""
    plain, kernel = _engines(monkeypatch, {**KERNELS, "INFIRE_JAX_DENSE_MATMUL": "pallas"},
                             model=deepseek_dirs["kimi-k2.5"], weights_quantization="checkpoint", **ENGINE)
    names = kernel_names(forward_jaxpr(kernel.engine.runner, 4))
    assert names.count("head_matmul") == 4, names  # W_uk and W_uv in the dense stack's body and the MoE one's
    _use(monkeypatch, {**WITHOUT, "INFIRE_JAX_DENSE_MATMUL": "xla"})
    assert "head_matmul" not in kernel_names(forward_jaxpr(plain.engine.runner, 4))
    _assert_same(_generate(kernel, PROMPTS), _generate(plain, PROMPTS))
    for llm in (plain, kernel):
        llm.engine.close()


def test_int4_dummy_reads_in_place_as_the_layer_body_dequantizes(monkeypatch):
    """`--weights-quantization int4` on a dummy: model (the int4 kernel measured without a checkpoint):
    AWQ / GPTQ-form parts drawn on the device with the float dummy's spread, which the kernel reads
    as the layer body dequantizes them, bit for bit."""
    from flax import nnx

    from infire_jax.loaders.load import load_quantized_placed

    _use(monkeypatch, KERNELS)
    placed = load_quantized_placed("dummy:smollm2-135m", jnp.float32, None, "int4")
    flat = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(placed.state)}
    stacks = {short: {part: flat[f"layers.{short}.{part}"][:2] for part in ("q4", "scale", "zero")}
              for short in INPUT_AXES}
    nibbles = np.asarray(stacks["w_down"]["q4"]).view(np.uint32)[..., None] >> np.arange(0, 32, 4, dtype=np.uint32)
    assert set(np.unique(nibbles & 15)) == set(range(16))
    in_place = in_place_weights(placed.loaded.config, stacks, tokens=1, red=Reductions())
    assert set(in_place) == set(INPUT_AXES)
    for name, (kw, shape) in in_place.items():
        plain = np.asarray(dequantize_layer({name: jax.tree.map(lambda a: a[1], stacks[name])}, jnp.float32)[name])
        assert np.std(plain) == pytest.approx(0.02, rel=0.05), name
        _assert_reads_as(kw, 1, plain.reshape(int(np.prod(shape[:INPUT_AXES[name]])), -1), name)


def test_a_few_layers_of_a_kimi_dummy_draw_int4_experts_the_grouped_kernel_reads(monkeypatch):
    """`dummy:kimi-k2.5,layers=2 --weights-quantization int4` (one dense and one MoE layer of Kimi
    K2.5 on one GPU), here at narrow widths: its routed experts are drawn in Kimi's int4 (groups of 32,
    bfloat16 scales) and the grouped kernel reads each expert as the layer body dequantizes it."""
    from flax import nnx

    from infire_jax.loaders import dummy
    from infire_jax.loaders.load import load_quantized_placed
    from infire_jax.quant.grouped import dequantize

    kimi = dummy.CONFIGS["kimi-k2.5"]
    narrow = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4,
                  num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16,
                  v_head_dim=16, qk_nope_head_dim=16, vocab_size=512, num_experts_per_tok=2)
    monkeypatch.setitem(dummy.CONFIGS, "kimi-narrow", {**kimi, "text_config": {**kimi["text_config"], **narrow}})
    _use(monkeypatch, KERNELS)
    placed = load_quantized_placed("dummy:kimi-narrow,layers=2", jnp.float32, None, "int4")
    assert placed.loaded.config.num_layers == 2 and placed.loaded.name == "dummy:kimi-narrow,layers=2"
    flat = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(placed.state)}
    weights = {short: {part: flat[f"moe_layers.{short}.{part}"] for part in ("packed", "scale")}
               for short in ("w_gate_up", "w_down")}
    assert weights["w_down"]["scale"].dtype == jnp.bfloat16
    in_place = layer_stacks(weights, 4, {}, moe=True, one_device=True)
    assert set(in_place) == {"w_gate_up", "w_down"}
    for short, (kw, _) in in_place.items():
        full = np.asarray(dequantize(weights[short], short, jnp.float32)[0])
        assert kw.experts == 4 and np.std(full) == pytest.approx(0.02, rel=0.1), short
        _assert_reads_as(kw, 3, full[3].reshape(full.shape[1], -1), f"{short}[3]")  # the layer's last expert
    with pytest.raises(Exception, match="layers=N"):
        dummy.load_dummy("kimi-k2.5,layer=1")
