"""8-bit checkpoints with a scale per output channel, per tensor or per block (loaders/hf_quantized.py,
loaders/llama_quant.py): llm-compressor's compressed-tensors FP8 and int8 (and its FP8_BLOCK), AutoFP8's
`fp8`, `fbgemm_fp8` and block-scaled `fp8` (Qwen3's FP8 releases), the forms vLLM users most often serve
Llama / Qwen checkpoints in.

Tiny random Llama / Qwen2 checkpoints are written here in each scheme's layout, quantized from
float weights, and each weight the scheme defines (`float64(q) * scale[o]`, the scale per row or
one a tensor) goes into a float twin. (a) The loader's dequantized weights equal the twin's bit
for bit; (b) the engine on the quantized checkpoint equals the engine on the twin; (c) kept on the
device (`weights_quantization="checkpoint"`) it holds the 8-bit values alone and equals the
dequantized engine, on one device, with the GPU's kernel (interpret mode) and on a tp mesh;
(d) what would decode differently is refused naming the field or tensor. HF transformers is not a
reference: it reads these formats only through the compressed-tensors and fbgemm-gpu packages
(GPU kernels); the twin's float path is checked against it in test_parity.py.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from channel_models import BLOCK, CASES, EXPERTS, FP8, write_checkpoints
from gptq_awq_models import CONFIG, LINEARS
from infire_jax.errors import UnsupportedModelError
from infire_jax.loaders.hf_quantized import quant_scheme

PROMPTS = [[5, 77, 200, 13, 42], [258, 3, 3, 190, 64, 99, 120, 7, 250, 11, 31]]
ENGINE = dict(dtype="float32", max_num_seqs=2, max_num_batched_tokens=32, token_buckets=(32,), max_model_len=128,
              num_kv_pages=16, num_decode_steps=1)
FUSED = {"wqkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "wo": ("self_attn.o_proj",),
         "w_gate_up": ("mlp.gate_proj", "mlp.up_proj"), "w_down": ("mlp.down_proj",)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[str, str]]:
    base = tmp_path_factory.mktemp("channel")
    return {name: write_checkpoints(base, name) for name in CASES}


@pytest.mark.parametrize("name", list(CASES))
def test_dequantized_weights_equal_the_definition(name, checkpoints):
    from infire_jax.loaders.hf import load_hf_dir

    got, want = (load_hf_dir(p).weights for p in checkpoints[name])
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def _placed(llm) -> dict[str, jax.Array]:
    from flax import nnx

    return {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(llm.engine.runner.state)}


def _assert_same(outs, want, atol=1e-5) -> None:
    for q, f in zip(outs, want):
        assert q.token_ids == f.token_ids
        np.testing.assert_allclose([lp[t].logprob for lp, t in zip(q.logprobs, q.token_ids)],
                                   [lp[t].logprob for lp, t in zip(f.logprobs, f.token_ids)], atol=atol, rtol=0)


@pytest.mark.parametrize("name", ["fp8-dynamic", "w8a8-int8", "fp8-block", "fp8-block-moe", "fp8-block-qwen3-moe",
                                  "fp8-block-compressed"])
def test_engine_on_the_checkpoint_equals_its_float_twin_kept_or_not(name, checkpoints, monkeypatch):
    """Dequantized at load against the twin; kept 8-bit against dequantized, through the layer scan's
    dequantization and through the GPU's quantized matmul kernels (interpret mode), which read the
    values and their row (and block) scales in place: dense weights in decode steps, a Mixtral's or
    Qwen3-MoE's experts (kept too) at every step."""
    from infire_jax import LLM, SamplingParams

    quantized, twin = checkpoints[name]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    engines = {"float": LLM(model=twin, **ENGINE), "dequantized": LLM(model=quantized, **ENGINE),
               "kept": LLM(model=quantized, weights_quantization="checkpoint", **ENGINE)}
    want = engines["float"].generate(PROMPTS, params)
    assert len(set(want[0].token_ids)) > 2  # not a degenerate repetition
    deq = engines["dequantized"].generate(PROMPTS, params)
    _assert_same(deq, want)
    kept = engines["kept"]
    placed = _placed(kept)
    values = "fp8" if CASES[name][1] is FP8 else "int8"
    for t, members in FUSED.items():  # the 8-bit values and a float32 scale a row; no full-precision copy
        assert sorted(k for k in placed if k.startswith(f"layers.{t}")) == [f"layers.{t}.{values}",
                                                                              f"layers.{t}.scale"], t
        v, scale = placed[f"layers.{t}.{values}"], placed[f"layers.{t}.scale"]
        assert v.dtype == (jnp.float8_e4m3fn if values == "fp8" else jnp.int8) and scale.dtype == jnp.float32
        experts = EXPERTS if name.endswith("moe") and t.startswith("w_") else 1
        assert v.size == CONFIG["num_hidden_layers"] * experts * sum(np.prod(LINEARS[m]) for m in members), t
    ratio = kept.engine.runner.weight_bytes / engines["float"].engine.runner.weight_bytes
    assert ratio < 0.65, ratio  # float32 embedding and LM head dominate this tiny model
    _assert_same(kept.generate(PROMPTS, params), deq)
    monkeypatch.setenv("INFIRE_JAX_QUANT_MATMUL", "pallas")  # read in place (test_quant_kernels.py checks it)
    monkeypatch.setenv("INFIRE_JAX_MOE_GROUPED", "pallas")
    engines["kernel"] = LLM(model=quantized, weights_quantization="checkpoint", **ENGINE)
    _assert_same(engines["kernel"].generate(PROMPTS, params), deq, atol=1e-4)
    for llm in engines.values():
        llm.engine.close()


@pytest.mark.parametrize("name", ["fp8-dynamic", "fp8-block", "fp8-block-moe"])
def test_kept_on_a_tp_mesh_equals_one_device(name, checkpoints, tmp_path):
    """fp8 kept on tp=4 (4 CPU devices, kv heads repeated): the values split as the weights (wo and down
    along their inputs), the row scales with the outputs (wo's, one a head, with its heads; a block's
    with its inputs); the same tokens as one device."""
    from test_sharding import ROOT, _assert_each_device_holds_its_shard, _results, _run_worker

    path = checkpoints[name][0]
    mesh = {m: os.path.join(ROOT, "sharding", "configs", f"{m}.yaml") for m in ("1", "4")}
    job = {"runs": [{"model": path, "mesh": mesh["1"]},
                    {"model": path, "mesh": mesh["4"], "weights_quantization": "checkpoint"}],
           "prompts": ["Hello, FP8", "x" * 30], "max_tokens": 10,
           "engine": {k: v for k, v in ENGINE.items() if k != "dtype"}}
    single, r = _results(_run_worker(job, 4, tmp_path, "fp8"))
    assert r["fits"] and r["tokens"] == single["tokens"], r.get("error")
    np.testing.assert_allclose(r["logprobs"], single["logprobs"], atol=1e-4, rtol=0)
    _assert_each_device_holds_its_shard(r)
    specs = {k: str(v["spec"]) for k, v in r["params"].items()}
    assert "layers.w_down" not in specs and "tp" in specs["layers.w_down.fp8"] and "tp" in specs["layers.wo.scale"]


@pytest.mark.parametrize("change,field", [
    ({"weights": {"symmetric": False}}, "weights.symmetric = False"),
    ({"weights": {"num_bits": 4}}, "weights.num_bits = 4"),
    ({"weights": {"strategy": "group", "group_size": 128}}, "weights.strategy = 'group'"),
    ({"weights": {"dynamic": True}}, "weights.dynamic = True"),
    ({"weights": {"type": "int"}}, "weights.type = 'int'"),
    ({"weights": {"strategy": "block", "block_structure": [128, 64]}}, r"weights.block_structure = \[128, 64\]"),
])
def test_unsupported_8bit_configs_name_the_field(change, field):
    config = json.loads(json.dumps(CASES["fp8-dynamic"][0]))
    config["config_groups"]["group_0"]["weights"].update(change["weights"])
    with pytest.raises(UnsupportedModelError, match=f"quantization_config.config_groups.group_0.{field}"):
        quant_scheme({"quantization_config": config})


def test_malformed_scales_name_the_tensor(checkpoints, tmp_path):
    import shutil

    from safetensors.numpy import save_file

    from infire_jax.loaders.hf import checkpoint_tensors, load_hf_dir

    src = checkpoints["fbgemm-fp8"][0]
    tensors = dict(checkpoint_tensors(src))
    name = "model.layers.1.mlp.down_proj.weight_scale"
    tensors[name] = tensors[name][:64]
    shutil.copytree(src, tmp_path / "bad")
    save_file(tensors, str(tmp_path / "bad" / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match=rf"{name} has shape \(64, 1\): expected one scale a tensor"):
        load_hf_dir(str(tmp_path / "bad"))


@pytest.mark.parametrize("name", ["fp8-static", "fp8-block", "fp8-block-moe"])
def test_the_memory_plan_counts_the_kept_8bit_weights(name, checkpoints):
    """`infire-jax plan` of an 8-bit checkpoint counts its layer weights as kept (one byte a weight, a
    float32 scale a row, or a row's block of inputs; wo's a row of each head, or of each head's piece of
    a block) where its float twin counts four in float32, and the engine's kept weights save exactly
    those bytes."""
    from infire_jax import LLM
    from infire_jax.memplan.plan import memory_plan
    from infire_jax.memplan.source import plan_source
    from sharding.mesh import CONFIG_DIR, MeshConfig

    mc = MeshConfig.from_yaml(os.path.join(CONFIG_DIR, "1.yaml"))
    quantized, twin = checkpoints[name]
    kept, plain = (memory_plan(plan_source(p, "float32")(mc), mc, 1 << 30).weight_bytes for p in (quantized, twin))
    layers, heads = CONFIG["num_hidden_layers"], CONFIG["num_attention_heads"]
    head_dim = CONFIG["hidden_size"] // heads
    copies = {m: EXPERTS if name.endswith("moe") and m.startswith("mlp.") else 1 for m in LINEARS}  # experts
    weights = layers * sum(np.prod(shape) * copies[m] for m, shape in LINEARS.items())
    if name.startswith("fp8-block"):  # o_proj's blocks span two heads: a scale a row for each head's piece
        scales = layers * sum(out * inp // (head_dim if m == "self_attn.o_proj" else BLOCK) * copies[m]
                              for m, (out, inp) in LINEARS.items())
    else:
        scales = layers * (sum(LINEARS[m][0] for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))
                           + heads * LINEARS["self_attn.o_proj"][0])
    assert plain - kept == weights * 4 - (weights + scales * 4)
    engine = {}
    for path, mode in ((quantized, "checkpoint"), (twin, None)):
        llm = LLM(model=path, weights_quantization=mode, **ENGINE)
        engine[path] = llm.engine.runner.weight_bytes
        llm.engine.close()
    assert engine[twin] - engine[quantized] == plain - kept
