"""GPTQ and AWQ (GEMM) int4 checkpoints of the Llama family (loaders/hf_quantized.py, quant/gptq_awq.py,
loaders/llama_quant.py).

Tiny random Llama checkpoints are written in the exact published layouts by tests/gptq_awq_models.py,
whose packing and float64 dequantization are written element by element from the formats'
definitions. (a) The loader's dequantized weights equal that reference bit for bit in float32;
(b) the engine serving a quantized checkpoint equals the one serving a float checkpoint holding those
weights: same greedy tokens, logprobs within 1e-5; (c) kept quantized (`weights_quantization=
"checkpoint"`, act-order included) it equals the dequantized engine, holding only the packed parts on
the device, on one device and on tp meshes; (d) what is not supported is refused naming the field or
tensor. Llama and Qwen2 (q/k/v biases) take the same path. HF transformers is not a reference
here: it loads GPTQ / AWQ only through optimum with gptqmodel / autoawq, not installed (GPU kernels).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gptq_awq_models import (CONFIG, LINEARS, pack_awq, pack_gptq, quantization_config, quantize, reference_awq,
                             reference_gptq, write_checkpoint, write_float_twin)
from infire_jax.errors import ConfigError, UnsupportedModelError
from infire_jax.loaders.hf_quantized import dequantized, quant_scheme

NUM_TOKENS = 16
PROMPTS = [[5, 77, 200, 13, 42], [258, 3, 3, 190, 64, 99, 120, 7, 250, 11, 31]]
# One bucket (the two prompts prefill in one step; no chunking checked) and no decode bursts
# (test_decode_burst.py): each engine compiles one forward, not two and a burst.
ENGINE = dict(dtype="float32", max_num_seqs=2, max_num_batched_tokens=32, token_buckets=(32,), max_model_len=128,
              num_kv_pages=16, num_decode_steps=1)
# name: (method, group, sym, act_order, v1, family); every case is also kept quantized on the device
CASES = {"gptq-act-order-g32": ("gptq", 32, False, True, True, "llama"),
         "gptq-sym-g128": ("gptq", 128, True, False, True, "llama"),
         "awq-g32": ("awq", 32, False, False, True, "llama"),
         "gptq-v2-per-channel": ("gptq", -1, False, False, False, "llama"),
         "qwen2-gptq-v2-act-order-g64": ("gptq", 64, False, True, False, "qwen2")}
FUSED = {"wqkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "wo": ("self_attn.o_proj",),
         "w_gate_up": ("mlp.gate_proj", "mlp.up_proj"), "w_down": ("mlp.down_proj",)}
PARTS = ("q4", "zero", "scale", "g_idx")  # g_idx: act-order only


def _module(method: str, group: int, sym: bool, act_order: bool, v1: bool, shape=(64, 256), seed=0):
    rng = np.random.default_rng(seed)
    qt = quantize(rng.standard_normal(shape), group, sym, act_order, rng)
    parts = pack_awq(qt) if method == "awq" else pack_gptq(qt, v1)
    want = reference_awq(parts, group) if method == "awq" else reference_gptq(parts, v1)
    return parts, want


def _scheme(method: str, group: int, sym: bool = False, act_order: bool = False, v1: bool = True):
    return quant_scheme({"quantization_config": quantization_config(method, group, sym=sym, act_order=act_order,
                                                                    v1=v1)})


@pytest.mark.parametrize("group", [32, 128, -1])
@pytest.mark.parametrize("method,sym,act_order,v1", [("gptq", True, False, True), ("gptq", False, False, True),
                                                     ("gptq", False, False, False), ("gptq", False, True, True),
                                                     ("awq", False, False, True)])
def test_dequantized_weights_equal_the_reference_definition(method, group, sym, act_order, v1):
    parts, want = _module(method, group, sym, act_order, v1)
    tensors = [(f"m.{p}", a) for p, a in reversed(parts.items())] + [("norm.weight", np.ones(4, np.float32))]
    out = dict(dequantized(iter(tensors), _scheme(method, group, sym, act_order, v1)))
    assert set(out) == {"m.weight", "norm.weight"}
    assert out["m.weight"].dtype == np.float32
    np.testing.assert_array_equal(out["m.weight"], want.astype(np.float32))


def test_gptq_v1_zero_field_of_15_is_a_zero_of_16():
    """v1 stores zero - 1: the all-ones field decodes to 16 (q - 16 for every q <= 15)."""
    parts, _ = _module("gptq", 32, False, False, True)
    parts["qzeros"] = np.full_like(parts["qzeros"], -1)  # every field 15
    want = reference_gptq(parts, True)
    assert want.max() <= 0
    out = dict(dequantized(iter((f"m.{p}", a) for p, a in parts.items()), _scheme("gptq", 32)))
    np.testing.assert_array_equal(out["m.weight"], want.astype(np.float32))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """name -> (quantized checkpoint, float twin holding the weights it defines)."""
    base = tmp_path_factory.mktemp("gptq_awq")
    paths = {}
    for name, (method, group, sym, act_order, v1, family) in CASES.items():
        defined = write_checkpoint(base / name, method, group, sym=sym, act_order=act_order, v1=v1, family=family)
        write_float_twin(base / f"{name}-float", base / name, defined)
        paths[name] = (str(base / name), str(base / f"{name}-float"))
    return paths


@pytest.mark.parametrize("name", list(CASES))
def test_kept_parts_dequantize_to_the_load_time_weights(name, checkpoints):
    from infire_jax.loaders.hf import load_hf_dir
    from infire_jax.loaders.llama_quant import load_llama_kept
    from infire_jax.quant.resident import dequantize_layer

    kept, layouts = load_llama_kept(checkpoints[name][0])
    floats = load_hf_dir(checkpoints[name][0]).weights
    assert set(layouts) == set(FUSED)
    _, group, _, act_order, _, _ = CASES[name]
    size = None if group == -1 else group
    parts = PARTS if act_order else PARTS[:3]
    if act_order:  # whole tables of the checkpoint's groups, gathered by each input's index
        assert all(layout.group == size and layout.act_order for layout in layouts.values())
    else:  # wo's groups are cut at its 32-wide heads; one group per row spans the whole input axis
        assert layouts["wo"].group == (32 if size is None else min(size, 32))
        assert layouts["w_down"].group == (size or 256) and layouts["wqkv"].group == (size or 128)
    for t in FUSED:
        arrays = {p: jnp.asarray(kept.weights[f"layers.{t}.{p}"]) for p in parts}
        got = jax.jit(dequantize_layer, static_argnums=1)({t: arrays}, jnp.float32)[t]
        np.testing.assert_array_equal(np.asarray(got), floats[f"layers.{t}"], err_msg=t)
    assert set(kept.weights) - {f"layers.{t}.{p}" for t in FUSED for p in parts} == \
        set(floats) - {f"layers.{t}" for t in FUSED}


def _placed(llm) -> dict[str, jax.Array]:
    from flax import nnx

    return {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(llm.engine.runner.state)}


def _assert_same(outs, want) -> None:
    for q, f in zip(outs, want):
        assert q.token_ids == f.token_ids
        np.testing.assert_allclose([lp[t].logprob for lp, t in zip(q.logprobs, q.token_ids)],
                                   [lp[t].logprob for lp, t in zip(f.logprobs, f.token_ids)], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", list(CASES))
def test_engine_on_the_quantized_checkpoint_equals_its_float_twin(name, checkpoints):
    """(b) dequantized at load vs the float twin; (c) kept quantized vs dequantized at load."""
    from infire_jax import LLM, SamplingParams

    quantized, twin = checkpoints[name]
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
    engines = {"float": LLM(model=twin, **ENGINE), "dequantized": LLM(model=quantized, **ENGINE),
               "kept": LLM(model=quantized, weights_quantization="checkpoint", **ENGINE)}
    want = engines["float"].generate(PROMPTS, params)
    deq = engines["dequantized"].generate(PROMPTS, params)
    assert len(set(want[0].token_ids)) > 2  # not a degenerate repetition
    _assert_same(deq, want)
    placed = _placed(engines["kept"])
    for t, members in FUSED.items():  # only the packed parts: no full-precision copy of a kept weight
        assert not [k for k in placed if k.startswith(f"layers.{t}") and k.rpartition(".")[2] not in PARTS]
        q4, zero, scale = (placed[f"layers.{t}.{p}"] for p in PARTS[:3])
        assert (q4.dtype, zero.dtype, scale.dtype) == (jnp.int32, jnp.uint8, jnp.float16), t
        assert q4.nbytes * 2 == CONFIG["num_hidden_layers"] * sum(np.prod(LINEARS[m]) for m in members), t
        assert (f"layers.{t}.g_idx" in placed) == CASES[name][3], t
    ratio = engines["kept"].engine.runner.weight_bytes / engines["dequantized"].engine.runner.weight_bytes
    assert ratio < 0.75, ratio  # float32 embedding and LM head dominate this tiny model
    _assert_same(engines["kept"].generate(PROMPTS, params), deq)
    for llm in engines.values():
        llm.engine.close()


def test_kept_checkpoints_on_tp_meshes_equal_one_device_dequantized(checkpoints, tmp_path):
    """One subprocess with 8 CPU devices: kept act-order GPTQ on tp=4, AWQ and Qwen2's act-order GPTQ
    on tp=4 x pp=2, against each dequantized on one device. Same greedy tokens; logprobs within 1e-4,
    since tp sums wo's and down's per-device partial products across devices, in another order. The
    act-order index splits along the inputs as the weight (over tp for wo and down); its zero / scale
    tables stay whole on every device, since any input may be in any group."""
    import os

    from test_sharding import ROOT, _assert_each_device_holds_its_shard, _results, _run_worker

    mesh = {m: os.path.join(ROOT, "sharding", "configs", f"{m}.yaml") for m in ("1", "4", "8-tp4-pp2")}
    kept = {"gptq-act-order-g32": "4", "awq-g32": "8-tp4-pp2", "qwen2-gptq-v2-act-order-g64": "8-tp4-pp2"}
    runs = []
    for name, m in kept.items():
        runs += [{"model": checkpoints[name][0], "mesh": mesh["1"]},
                 {"model": checkpoints[name][0], "mesh": mesh[m], "weights_quantization": "checkpoint"}]
    # one decode step a launch (ENGINE's): a burst is the same layers again (on meshes: test_sharding's)
    job = {"runs": runs, "prompts": ["Hello, GPTQ", "x" * 30], "max_tokens": 12,
           "engine": {k: v for k, v in ENGINE.items() if k != "dtype"}}
    results = {(r["model"], os.path.basename(r["mesh"])): r for r in _results(_run_worker(job, 8, tmp_path, "q8"))}
    for name, m in kept.items():
        single, r = results[checkpoints[name][0], "1.yaml"], results[checkpoints[name][0], f"{m}.yaml"]
        assert r["fits"] and r["tokens"] == single["tokens"], (name, r.get("error"))
        np.testing.assert_allclose(r["logprobs"], single["logprobs"], atol=1e-4, rtol=0)
        _assert_each_device_holds_its_shard(r)
        specs = {k: str(v["spec"]) for k, v in r["params"].items()}
        assert "layers.w_down" not in specs and "tp" in specs["layers.w_down.q4"], name
        if CASES[name][3]:
            assert "tp" in specs["layers.w_down.g_idx"] and "tp" in specs["layers.wo.g_idx"], name
            assert "tp" not in specs["layers.w_down.zero"] + specs["layers.wo.scale"], name
        else:
            assert "tp" in specs["layers.w_down.zero"], name


# ---- (d) what is refused, by name ------------------------------------------------------------------------

@pytest.mark.parametrize("change,field", [
    (dict(bits=8), "quantization_config.bits = 8"),
    (dict(bits=3), "quantization_config.bits = 3"),
    (dict(checkpoint_format="marlin"), "quantization_config.checkpoint_format = 'marlin'"),
    (dict(is_marlin_format=True), "quantization_config.is_marlin_format"),
    (dict(group_size=0), "quantization_config.group_size = 0"),
    (dict(quant_method="exl2"), "quantization_config.quant_method = 'exl2'"),
])
def test_unsupported_gptq_configs_name_the_field(change, field):
    with pytest.raises(UnsupportedModelError, match=re.escape(field)):
        quant_scheme({"quantization_config": {**quantization_config("gptq", 128), **change}})


@pytest.mark.parametrize("change,field", [(dict(version="gemv"), "version = 'gemv'"),
                                          (dict(zero_point=False), "zero_point = False"),
                                          (dict(backend="llm-awq"), "backend = 'llm-awq'")])
def test_unsupported_awq_configs_name_the_field(change, field):
    with pytest.raises(UnsupportedModelError, match=field):
        quant_scheme({"quantization_config": {**quantization_config("awq", 128), **change}})


@pytest.mark.parametrize("method,part,bad,message", [
    ("gptq", "qzeros", lambda a: a[:, :-1], r"m: qzeros has shape \(2, 7\), expected \(2, 8\)"),
    ("gptq", "scales", lambda a: a.astype(np.int32), "m: scales has dtype int32"),
    ("gptq", "g_idx", lambda a: a + 5, "m: g_idx has groups 5..6, outside 0..1"),
    ("gptq", "qweight", lambda a: a.astype(np.int64), "m: qweight has dtype int64"),
    ("awq", "qzeros", lambda a: a[:1], r"m: qzeros has shape \(1, 8\), expected \(2, 8\)"),
    ("gptq", "g_idx", None, r"m has \['qweight', 'qzeros', 'scales'\] but no \['g_idx'\]"),
])
def test_malformed_tensors_name_the_module_and_tensor(method, part, bad, message):
    parts, _ = _module(method, 128, False, False, True)
    if bad is None:
        del parts[part]
    else:
        parts[part] = bad(parts[part])
    with pytest.raises(UnsupportedModelError, match=message):
        dict(dequantized(iter((f"m.{p}", a) for p, a in parts.items()), _scheme(method, 128)))


def test_group_size_must_tile_the_inputs():
    parts, _ = _module("gptq", 32, False, False, True, shape=(64, 96))
    with pytest.raises(UnsupportedModelError, match="m: group_size 64 does not tile the 96 inputs"):
        dict(dequantized(iter((f"m.{p}", a) for p, a in parts.items()), _scheme("gptq", 64)))


def _copy(src: str, dst, tensors: dict | None = None, **config) -> str:
    """The checkpoint at `src` written to `dst` with `tensors` in place of its own and `config`
    merged into its quantization_config."""
    import json
    import shutil

    from safetensors.numpy import save_file

    dst.mkdir()
    if tensors is None:
        shutil.copy(f"{src}/model.safetensors", dst / "model.safetensors")
    else:
        save_file(tensors, str(dst / "model.safetensors"))
    cfg = json.loads(open(f"{src}/config.json").read())
    cfg["quantization_config"].update(config)
    (dst / "config.json").write_text(json.dumps(cfg))
    shutil.copy(f"{src}/tokenizer.json", dst / "tokenizer.json")
    return str(dst)


def test_kept_refuses_undeclared_act_order_and_partly_quantized_weights(checkpoints, tmp_path):
    from safetensors.numpy import load_file

    from infire_jax.loaders.hf import load_hf_dir
    from infire_jax.loaders.llama_quant import load_llama_kept

    # a permuted g_idx where desc_act says the groups are consecutive: no kept layout fits it
    undeclared = _copy(checkpoints["gptq-act-order-g32"][0], tmp_path / "undeclared", desc_act=False)
    with pytest.raises(ConfigError, match=r"model\.layers\.\d\.[a-z_.]+\.g_idx: its groups are not runs"):
        load_llama_kept(undeclared)
    # v_proj of layer 1 left in float (as `modules_to_not_convert` would): q/k/v is kept whole or not at all
    src, twin = checkpoints["awq-g32"]
    tensors = load_file(f"{src}/model.safetensors")
    name = "model.layers.1.self_attn.v_proj"
    tensors = {k: v for k, v in tensors.items() if not k.startswith(f"{name}.")}
    tensors[f"{name}.weight"] = load_file(f"{twin}/model.safetensors")[f"{name}.weight"]
    partly = _copy(src, tmp_path / "partly", tensors)
    with pytest.raises(UnsupportedModelError, match=rf"{name}\.weight is not quantized but other parts of layers"):
        load_llama_kept(partly)
    for path in (undeclared, partly):  # dequantized at load both serve
        assert load_hf_dir(path).weights["layers.wqkv"].dtype == np.float32
