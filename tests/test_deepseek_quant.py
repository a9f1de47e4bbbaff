"""A published quantized DeepSeek-V3-family checkpoint served with its quantized weights kept on the
device (`weights_quantization="checkpoint"`: loaders/deepseek_quant.py, quant/grouped.py).

Tiny random DeepseekV3 (fp8, every linear weight, 16 x 16 blocks) and Kimi-K2.5-text (int4 routed
experts, groups of 32) checkpoints in the published layouts (deepseek_models.quantize_checkpoint).
The reference is the same checkpoint dequantized at load: a kept weight dequantizes to it bit for
bit, and the engine decodes the same greedy tokens with the same logprobs, holding only the packed
parts on the device; on 8 virtual devices ep and tp meshes equal one device.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepseek_models import hf_model, quantize_checkpoint, save
from infire_jax.errors import ConfigError, UnsupportedModelError
from infire_jax.quant.grouped import INPUT_AXIS, ROUTED_EXPERTS, VALUE_PART

NUM_TOKENS = 32
PROMPTS = [[5, 77, 200, 13, 42], [258, 3, 3, 190, 64, 99, 120, 7, 250, 11, 31], list(range(60, 100))]
ENGINE = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(4, 32), max_model_len=128,
              num_kv_pages=40)
CASES = {"deepseek-v3": ("fp8", 16), "kimi-k2.5": ("int4", 32)}
STACKS = {"dense_layers": 1, "moe_layers": 2}  # layers per stack in these configs


def _kept_names(name: str) -> set[str]:
    """What each checkpoint quantizes: DeepSeek-V3 every linear layer weight, Kimi the routed experts."""
    if CASES[name][0] == "int4":
        return {"moe_layers.w_gate_up", "moe_layers.w_down"}
    dense = {s for s in INPUT_AXIS if not s.startswith("w_shared")}
    return {f"dense_layers.{s}" for s in dense} | {f"moe_layers.{s}" for s in INPUT_AXIS}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("kept")
    paths = {}
    for name, (scheme, size) in CASES.items():
        paths[name] = save(name, hf_model(name), base / name)
        quantize_checkpoint(paths[name], scheme, size)
    return paths


def _placed(llm) -> dict[str, jax.Array]:
    from flax import nnx

    return {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(llm.engine.runner.state)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_kept_parts_dequantize_to_the_load_time_weights(name, checkpoints):
    """Every kept weight, in the model's layout (head reshapes, rope de-interleave, gate/up fusion,
    kv_b split, expert stacking), dequantizes to exactly the float32 weight the float loader gives."""
    from infire_jax.loaders.deepseek_quant import load_kept
    from infire_jax.loaders.hf import load_hf_dir
    from infire_jax.quant.grouped import dequantize

    kept, layouts = load_kept(checkpoints[name])
    floats = load_hf_dir(checkpoints[name]).weights
    kind = CASES[name][0]
    assert set(layouts) == _kept_names(name)
    for t, layout in layouts.items():
        assert (layout.kind, layout.group) == (kind, CASES[name][1])
        parts = {p: jnp.asarray(kept.weights[f"{t}.{p}"]) for p in (VALUE_PART[kind], "scale")}
        got = jax.jit(dequantize, static_argnums=(1, 2))(parts, t.rpartition(".")[2], jnp.float32)
        np.testing.assert_array_equal(np.asarray(got), floats[t], err_msg=t)
    for k, w in floats.items():
        if k not in layouts:
            np.testing.assert_array_equal(kept.weights[k], w, err_msg=k)


@pytest.mark.parametrize("name", sorted(CASES))
def test_engine_keeps_the_checkpoint_quantized_and_equals_the_dequantized_engine(name, checkpoints):
    from infire_jax import LLM, SamplingParams

    path = checkpoints[name]
    kept, floats = LLM(model=path, weights_quantization="checkpoint", **ENGINE), LLM(model=path, **ENGINE)
    placed, plain = _placed(kept), _placed(floats)
    kind, group = CASES[name]
    values = {"int4": jnp.int32, "fp8": jnp.float8_e4m3fn}[kind]
    scale = {"int4": jnp.bfloat16, "fp8": jnp.float32}[kind]
    # only the packed parts are on the device: no full-precision copy of a kept weight
    for t in _kept_names(name):
        assert t not in placed
        v, s = placed[f"{t}.{VALUE_PART[kind]}"], placed[f"{t}.scale"]
        assert (v.dtype, s.dtype) == (values, scale), t
        n = plain[t].size
        assert v.nbytes == (n // 2 if kind == "int4" else n) and s.nbytes == n // group * s.dtype.itemsize, t
    assert set(placed) - {f"{t}.{p}" for t in _kept_names(name) for p in (VALUE_PART[kind], "scale")} == \
        set(plain) - _kept_names(name)
    ratio = kept.engine.runner.weight_bytes / floats.engine.runner.weight_bytes
    assert ratio < (0.45 if kind == "fp8" else 0.65), ratio
    # the largest step's temporaries grow by at most one layer's kept dense weights dequantized and a
    # few experts (fp8: +211 kB), never by a layer's routed experts (the int4 engine's shrink: -235 kB)
    routed = {f"moe_layers.{w}" for w in ROUTED_EXPERTS}
    dense = max(sum(plain[t].nbytes for t in _kept_names(name) - routed if t.startswith(stack)) / n
                for stack, n in STACKS.items())
    experts = sum(plain[t].nbytes for t in routed) / STACKS["moe_layers"]
    extra = kept.engine.runner.peak_activation_bytes() - floats.engine.runner.peak_activation_bytes()
    assert extra < dense + experts / 2, (extra, dense, experts)

    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
    ours, want = kept.generate(PROMPTS, params), floats.generate(PROMPTS, params)
    for q, f in zip(ours, want):
        assert q.token_ids == f.token_ids
        np.testing.assert_allclose([lp[t].logprob for lp, t in zip(q.logprobs, q.token_ids)],
                                   [lp[t].logprob for lp, t in zip(f.logprobs, f.token_ids)], atol=1e-5, rtol=0)
    kept.engine.close()
    floats.engine.close()


# ---- 8 virtual devices: ep and tp meshes equal one device ----------------------------------------------

def test_ep_and_tp_meshes_match_one_device(tmp_path):
    """Kept fp8 (8 x 8 blocks) and int4 (groups of 8) checkpoints whose widths split whole groups over
    tp=8 (intermediate 128, expert width 64): tp8 and ep8 equal one device, each device holding its
    shard of the packed parts; a checkpoint whose groups tp would split is refused naming the weight."""
    import json

    from test_sharding import ROOT, _results, _run_worker

    wide = dict(intermediate_size=128, moe_intermediate_size=64)
    models = {}
    for scheme in ("fp8", "int4"):
        models[scheme] = save("deepseek-v3", hf_model("deepseek-v3", **wide), tmp_path / scheme)
        quantize_checkpoint(models[scheme], scheme, 8)
    narrow = save("deepseek-v3", hf_model("deepseek-v3"), tmp_path / "narrow")
    quantize_checkpoint(narrow, "fp8", 16)  # the dense w_down's 96 inputs: 12 a device, not whole blocks of 16
    meshes = {m: os.path.join(ROOT, "sharding", "configs", f"{m}.yaml") for m in ("1", "8", "8-ep8")}
    runs = [{"model": models[s], "mesh": meshes[m], "weights_quantization": "checkpoint", "tag": s}
            for s in models for m in meshes]
    # the GPU's quantized matmul kernels (interpret mode), each device's on its shard: fp8 dense weights on tp8,
    # int4 experts on ep8
    kernels = {"INFIRE_JAX_QUANT_MATMUL": "pallas", "INFIRE_JAX_MOE_GROUPED": "pallas"}
    runs += [{"model": models[s], "mesh": meshes[m], "weights_quantization": "checkpoint", "tag": f"{s}-kernels",
              "env": kernels} for s, m in (("fp8", "8"), ("int4", "8-ep8"))]
    runs.append({"model": narrow, "mesh": meshes["8"], "weights_quantization": "checkpoint", "tag": "narrow"})
    # one bucket, one decode step a launch: a burst is the same layers again, and the small bucket another forward
    # (on meshes: test_sharding's), each another compile; the scheduler's steps are the same (chunked by the budget)
    engine = {**{k: v for k, v in ENGINE.items() if k != "dtype"}, "token_buckets": [32], "num_decode_steps": 1}
    job = {"runs": runs, "prompts": ["Hello, MLA", "x" * 40, "abc"], "max_tokens": 6, "engine": engine}
    results = {(r["tag"], os.path.basename(r["mesh"])): r for r in _results(_run_worker(job, 8, tmp_path, "dsq8"))}
    assert "dense_layers.w_down" in results.pop(("narrow", "8.yaml"))["error"]
    # tp8 shards the kernel tiles (widths with a power-of-two factor of 16): both stacks' wq_a and wo, the dense
    # MLP's two and the shared gate/up (16 wide); not wq_b (24), wkv_a (40), nor the 8 inputs of a shared or
    # routed expert's down projection, so the routed experts stay with the loop. ep8: one whole expert a device.
    for scheme, mesh, count in (("fp8", "8.yaml", 7), ("int4", "8-ep8.yaml", 2)):
        r = results.pop((f"{scheme}-kernels", mesh))
        assert r["kernels"].count("quant_matmul") == count, (scheme, r["kernels"])
        assert r["tokens"] == results[scheme, "1.yaml"]["tokens"], scheme
        np.testing.assert_allclose(r["logprobs"], results[scheme, "1.yaml"]["logprobs"], atol=1e-4)
    for scheme in models:
        single = results[scheme, "1.yaml"]
        for mesh in ("8.yaml", "8-ep8.yaml"):
            r = results[scheme, mesh]
            assert r["fits"] and r["tokens"] == single["tokens"], (scheme, mesh, json.dumps(r)[:500])
            np.testing.assert_allclose(r["logprobs"], single["logprobs"], atol=1e-4)
            specs = {k: v["spec"] for k, v in r["params"].items()}
            part = f"moe_layers.w_down.{VALUE_PART[scheme]}"
            assert "moe_layers.w_down" not in specs
            assert ("tp" if mesh == "8.yaml" else "ep") in str(specs[part]) and \
                specs[part] == specs["moe_layers.w_down.scale"], (mesh, specs[part])
            p = r["params"][part]
            assert all(b * 8 == p["global"] for b in p["per_device"]), (mesh, p)


# ---- bad input: a clear error naming the weight ------------------------------------------------------------

def test_groups_that_do_not_tile_an_input_axis_are_refused(tmp_path):
    """fp8 blocks of 32: o_proj's blocks would span two heads' 16 values each (and the q rank of 48
    is not whole blocks: the format allows a partial last block, a kept weight does not)."""
    from infire_jax.loaders.deepseek_quant import load_kept

    path = save("deepseek-v3", hf_model("deepseek-v3"), tmp_path / "m")
    quantize_checkpoint(path, "fp8", 32)
    with pytest.raises(UnsupportedModelError, match=r"dense_layers\.wo: fp8 groups of 32 inputs do not tile "
                                                    r"its input axis of 16"):
        load_kept(path)


def test_a_partly_quantized_weight_is_refused(checkpoints, tmp_path):
    """One expert's up_proj left in float32 while the rest of moe_layers.w_gate_up is int4."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from infire_jax.loaders.deepseek_quant import load_kept

    path = shutil.copytree(checkpoints["kimi-k2.5"], tmp_path / "partly")
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    module = "language_model.model.layers.2.mlp.experts.5.up_proj"
    for part in ("weight_packed", "weight_scale", "weight_shape"):
        del tensors[f"{module}.{part}"]
    tensors[f"{module}.weight"] = torch.zeros((32, 64))
    save_file(tensors, file)
    with pytest.raises(UnsupportedModelError, match=rf"moe_layers\.w_gate_up: {module}\.weight is not quantized"):
        load_kept(path)


def test_checkpoint_mode_needs_a_quantized_deepseek_checkpoint(checkpoints, tmp_path):
    from infire_jax import LLM

    float_path = save("deepseek-v3", hf_model("deepseek-v3"), tmp_path / "float")
    with pytest.raises(ConfigError, match="has no quantization_config"):
        LLM(model=float_path, weights_quantization="checkpoint", **ENGINE)
    with pytest.raises(ConfigError, match="is not an HF model directory"):
        LLM(model="dummy:smollm2-135m", weights_quantization="checkpoint", **ENGINE)
    with pytest.raises(ConfigError, match="'int8' covers Llama-architecture models"):
        LLM(model=checkpoints["deepseek-v3"], weights_quantization="int8", **ENGINE)
