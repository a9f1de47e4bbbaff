"""Published 8-bit checkpoints of GLM-4.5, MiniMax-M2, Llama 4, Gemma 3 / 4 and Qwen3.5 (loaders/kept_8bit.py):
read dequantized, or kept.

MiniMax-M2 is published in fp8 only: e4m3 values and a float32 `weight_scale_inv` per 128 x 128 block,
under a quantization_config whose `fmt` is "float8_e4m3fn"; Qwen3.5's FP8 releases use the same blocks.
GLM-4.5's and Llama 4 Maverick's FP8 releases, and Gemma 3's FP8-dynamic ones, are llm-compressor's
compressed-tensors FP8 (a scale a row); Maverick's leaves the attention bfloat16 (`ignore`). Maverick's
and Qwen3.5-MoE's hold each routed expert as its own linear modules. Tiny random checkpoints of each family
(their test files' models; GLM-4.5's with a dense first layer, a shared expert, q/k/v biases and an MTP
layer; Llama 4's multimodal one, dense and MoE layers interleaved) are written in those forms by
tests/quant_twins.py `write_8bit` (MiniMax's blocks of 32, so that a block of o_proj's inputs spans two
heads of 16; Qwen3.5's of 8, partial on the DeltaNets' 4-row in_proj_b / _a), beside a float twin holding
the values they decode to. Read dequantized, the weights equal the twin's exactly (and experts one module
each equal the fused checkpoint's). Kept (`weights_quantization="checkpoint"`), every kept projection is
held as its fp8 parts alone, the engine gives the twin engine's greedy tokens and logprobs (1e-5; through
the GPU kernels in interpret mode, 1e-4, for experts one module each), and the memory plan
counts the bytes the engine saves. On tp or tp x ep meshes the kept weights give the twin's tokens.
Gemma 4 (its windowed and full layers' heads of 16 and 32, the full layers' values from the k projection)
in blocks of 16.
"""

from __future__ import annotations

import os
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

# name: (family, scheme, block, modules left float)
CASES = {"minimax-fp8-block": ("minimax", "fp8-block", 32, None), "glm-fp8-channel": ("glm", "fp8-channel", 0, None),
         "llama4-fp8-channel": ("llama4", "fp8-channel", 0, r".*self_attn"),
         "gemma3-fp8-channel": ("gemma3", "fp8-channel", 0, None),
         "qwen3_5-moe-fp8-block": ("qwen3_5", "fp8-block", 8, None),
         "gemma4-fp8-block": ("gemma4", "fp8-block", 16, None)}
# Each case's kept stacked weights
KEPT = {"minimax-fp8-block": [f"moe_layers.{w}" for w in ("wqkv", "wo", "w_gate_up", "w_down")],
        "glm-fp8-channel": [f"{s}.{w}" for s in ("dense_layers", "moe_layers") for w in ("wqkv", "wo", "w_gate_up",
                                                                                         "w_down")]
        + ["moe_layers.w_shared_gate_up", "moe_layers.w_shared_down"],
        "llama4-fp8-channel": ["dense_layers.w_gate_up", "dense_layers.w_down", "moe_layers.w_gate_up",
                               "moe_layers.w_down", "moe_layers.w_shared_gate_up", "moe_layers.w_shared_down"],
        "gemma3-fp8-channel": ["layers.wqkv", "layers.wo", "layers.w_gate_up", "layers.w_down"],
        "qwen3_5-moe-fp8-block": [f"attention_layers.{w}" for w in ("wq", "wk", "wv", "wo")]
        + [f"linear_layers.{w}" for w in ("w_qkv", "w_z", "w_out")]
        + [f"{s}.{w}" for s in ("attention_layers", "linear_layers")
           for w in ("w_gate_up", "w_down", "w_shared_gate_up", "w_shared_down")],
        "gemma4-fp8-block": [f"{s}.{w}" for s in ("sliding_layers", "full_layers")
                             for w in ("wqkv", "wo", "w_gate_up", "w_down")]}
# The cases also run through the GPU's kernels (interpret mode): experts kept one module each (row-scaled
# projections take them as weights quantized at load do, test_glm4_moe and test_qwen3_5; blocks, the Llama family's,
# test_channel_quant)
KERNELS = ("llama4-fp8-channel",)
# The engines serve text (Llama 4's tower, which images through kept weights use, test_vision.py)
TEXT = dict(token_buckets=(32,), limit_mm_per_prompt={"image": 0})
PUBLISHED_FP8 = dict(activation_scheme="dynamic", fmt="float8_e4m3fn", quant_method="fp8",
                     weight_block_size=[128, 128], modules_to_not_convert=["gate", "e_score_correction_bias", "lm_head"])


def _hf_model(family: str):
    """The family's tiny random HF model (its test file's)."""
    if family == "llama4":
        from llama4_models import hf_model

        return hf_model("multimodal")
    if family == "qwen3_5":
        from test_qwen3_5 import hf_moe_model

        return hf_moe_model("qwen3_5_moe")
    if family == "gemma4":
        from test_gemma4 import _hf_model as gemma4_model

        return gemma4_model("dense")
    from test_gemma3 import hf_model as gemma3_model
    from test_minimax_m2 import hf_model as minimax_model

    return {"gemma3": gemma3_model, "minimax": minimax_model}[family]()


def _float_checkpoint(family: str, path: pathlib.Path) -> str:
    """The family's float checkpoint at `path`: GLM-4.5's with its MTP layer; Llama 4's and Qwen3.5-MoE's with
    their experts one module each, as their 8-bit releases hold them."""
    from deepseek_models import _save_tokenizer
    from quant_twins import unfuse_experts

    if family == "glm":
        from test_glm4_moe import _save, hf_model

        return _save(hf_model(use_qk_norm=True), path)
    unfused = family in ("llama4", "qwen3_5")
    saved = path.parent / "fused" if unfused else path
    _hf_model(family).save_pretrained(saved, safe_serialization=True)
    _save_tokenizer(saved)
    if unfused:
        unfuse_experts(str(saved), str(path))
    return str(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """Each case's quantized checkpoint and its float twin."""
    from quant_twins import write_8bit

    out = {}
    for name, (family, scheme, block, ignore) in CASES.items():
        base = tmp_path_factory.mktemp(name)
        src = _float_checkpoint(family, base / "float")
        write_8bit(src, str(base / "quantized"), str(base / "twin"), scheme, block, ignore)
        out[name] = (str(base / "quantized"), str(base / "twin"))
    return out


def test_the_published_minimax_m2_config_is_read():
    """The release's config.json, quantization_config and all, is a MiniMax-M2 in fp8 blocks of 128."""
    from infire_jax.loaders.dummy import CONFIGS
    from infire_jax.loaders.hf_quantized import quant_scheme
    from infire_jax.models.hf_config import config_from_hf

    hf = dict(CONFIGS["minimax-m2"], quantization_config=PUBLISHED_FP8, use_mtp=True, num_mtp_modules=3,
              mtp_transformer_layers=1)
    assert config_from_hf(hf).architecture == "minimax_m2"
    scheme = quant_scheme(hf)
    assert (scheme.kind, scheme.block) == ("fp8", 128)


@pytest.mark.parametrize("name", ["llama4-fp8-channel", "qwen3_5-moe-fp8-block"])
def test_experts_one_by_one_equal_the_fused_ones(name, checkpoints):
    from infire_jax.loaders.hf import load_hf_dir

    base = os.path.dirname(checkpoints[name][0])
    fused, ours = (load_hf_dir(os.path.join(base, p)).weights for p in ("fused", "float"))
    assert sorted(fused) == sorted(ours)
    for k, w in fused.items():
        np.testing.assert_array_equal(ours[k], w, err_msg=k)


@pytest.mark.parametrize("name", CASES)
def test_dequantized_weights_equal_the_twin(name, checkpoints):
    from infire_jax.loaders.hf import load_hf_dir

    quantized, twin = (load_hf_dir(p).weights for p in checkpoints[name])
    assert sorted(quantized) == sorted(twin)
    for k, w in twin.items():
        np.testing.assert_array_equal(np.asarray(quantized[k], np.float32), np.asarray(w, np.float32), err_msg=k)


def _greedy():
    from infire_jax import SamplingParams
    from test_glm4_moe import NUM_TOKENS

    return SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def twins(checkpoints) -> dict:
    """Each case's float engine on its twin: greedy outputs, computed on first use."""
    from quant_twins import twin_outputs
    from test_glm4_moe import ENGINE, PROMPTS

    class Outputs(dict):
        def __missing__(self, name):
            self[name] = twin_outputs(checkpoints[name][1], dict(ENGINE, **TEXT), PROMPTS, _greedy())
            return self[name]

    return Outputs()


@pytest.mark.parametrize("name", CASES)
def test_kept_equals_the_twin_and_the_plan_counts_it(name, checkpoints, twins, monkeypatch):
    from flax import nnx

    from infire_jax.loaders.hf import read_hf_config
    from infire_jax.memplan.plan import memory_plan
    from infire_jax.memplan.source import plan_source
    from infire_jax.models.registry import abstract_model
    from quant_twins import assert_kept_and_follows_twin
    from sharding.mesh import CONFIG_DIR, MeshConfig
    from test_glm4_moe import ENGINE, PROMPTS

    quantized, twin = checkpoints[name]
    params, want = _greedy(), twins[name]
    kept_engine = dict(ENGINE, **TEXT, weights_quantization="checkpoint")
    kept_bytes = assert_kept_and_follows_twin(quantized, kept_engine, KEPT[name], "fp8", PROMPTS, params, want, 1e-5)

    # the plan saves what the engine saves against the float model (the twin's weights: these shapes in float32)
    mc = MeshConfig.from_yaml(os.path.join(CONFIG_DIR, "1.yaml"))
    kept_plan, float_plan = (memory_plan(plan_source(p, "float32")(mc), mc, 1 << 30).weight_bytes
                             for p in (quantized, twin))
    state = nnx.state(abstract_model(read_hf_config(twin), jnp.float32), nnx.Param)
    float_bytes = sum(int(np.prod(v.shape)) * 4 for _, v in nnx.to_flat_state(state))
    assert float_plan - kept_plan == float_bytes - kept_bytes > 0

    if name in KERNELS:
        monkeypatch.setenv("INFIRE_JAX_QUANT_MATMUL", "pallas")
        monkeypatch.setenv("INFIRE_JAX_MOE_GROUPED", "pallas")
        assert_kept_and_follows_twin(quantized, kept_engine, KEPT[name], "fp8", PROMPTS, params, want, 1e-4)


def test_kept_on_meshes_equals_the_twin(checkpoints, twins, tmp_path):
    """GLM-4.5's row-scaled fp8 on tp 4 (its 2 kv heads repeated, parts and all; wo's scales split with its
    heads, the dense MLP's inputs 4 ways), MiniMax-M2's blocks on tp 2 x ep 4 (a block's scales with its
    inputs), Qwen3.5-MoE's blocks (the DeltaNets' too) and Gemma 4's (its full layers' one kv head repeated,
    parts and all) on tp 2: the float twin's greedy tokens on one device, logprobs within float32 rounding."""
    from test_glm4_moe import ENGINE, NUM_TOKENS, PROMPTS
    from test_sharding import ROOT, _assert_each_device_holds_its_shard, _results, _run_worker

    meshes = {"glm-fp8-channel": "4", "minimax-fp8-block": "8-tp2-ep4", "qwen3_5-moe-fp8-block": "2",
              "gemma4-fp8-block": "2"}
    runs = [{"model": checkpoints[name][0], "mesh": os.path.join(ROOT, "sharding", "configs", f"{mesh}.yaml"),
             "weights_quantization": "checkpoint", "tag": name} for name, mesh in meshes.items()]
    engine = {**{k: v for k, v in ENGINE.items() if k != "dtype"}, "token_buckets": [32], "num_decode_steps": 1}
    job = {"runs": runs, "prompts": PROMPTS, "max_tokens": NUM_TOKENS, "engine": engine}
    results = {r["tag"]: r for r in _results(_run_worker(job, 8, tmp_path, "kept-8bit"))}
    for name in meshes:
        r, want = results[name], twins[name]
        assert r["fits"] and r["tokens"] == [o.token_ids for o in want], (name, r.get("error"))
        np.testing.assert_allclose(r["logprobs"], [[lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)]
                                                   for o in want], atol=1e-4, rtol=0)
        _assert_each_device_holds_its_shard(r)
        specs = {k: str(v["spec"]) for k, v in r["params"].items()}
        kept = {"qwen3_5": "attention_layers.wo", "gemma4": "full_layers.wo"}.get(name.partition("-")[0],
                                                                                  "moe_layers.wo")
        assert kept not in specs and "tp" in specs[f"{kept}.fp8"] and "tp" in specs[f"{kept}.scale"], specs


def test_a_weight_quantized_in_some_layers_only_is_refused(checkpoints, tmp_path):
    import shutil

    from safetensors.numpy import load_file, save_file

    from infire_jax.errors import UnsupportedModelError
    from infire_jax.loaders.kept_8bit import load_kept
    from infire_jax.loaders.hf import checkpoint_tensors

    quantized, twin = checkpoints["minimax-fp8-block"]
    bad = tmp_path / "partly"
    shutil.copytree(quantized, bad)
    tensors = dict(checkpoint_tensors(quantized))  # (safetensors.numpy cannot read fp8)
    name = "model.layers.1.self_attn.k_proj.weight"
    tensors[name] = load_file(os.path.join(twin, "model.safetensors"))[name]
    del tensors[f"{name}_scale_inv"]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match=f"moe_layers.wqkv: {name} is not quantized"):
        load_kept(str(bad))


def test_a_dummy_draws_its_published_8bit_form(monkeypatch):
    """A `dummy:` model whose published config is fp8 (MiniMax-M2's; here test_minimax_m2.py's tiny shapes in
    blocks of 32) keeps every projection as drawn fp8 parts in the checkpoint's layouts (the plan's), and the
    engine serves them: finite logprobs, the same tokens twice (its draw is seeded). bench/gpu_target.py
    compiles the published model so (test_gpu_compile.py)."""
    from flax import nnx

    from infire_jax import LLM, SamplingParams
    from infire_jax.loaders import dummy
    from infire_jax.loaders.kept_8bit import dummy_layouts
    from test_glm4_moe import ENGINE, PROMPTS
    from test_minimax_m2 import TINY

    published = dict(dummy.CONFIGS["minimax-m2"]["quantization_config"], weight_block_size=[32, 32])
    monkeypatch.setitem(dummy.CONFIGS, "minimax-tiny", dict(TINY, model_type="minimax_m2",
                                                              quantization_config=published))
    layouts = dummy_layouts("dummy:minimax-tiny")
    assert layouts["wo"].group == 16 and layouts["w_gate_up"].group == 32  # wo's blocks cut at its 16-wide heads
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
    runs = []
    for _ in range(2):
        llm = LLM(model="dummy:minimax-tiny", weights_quantization="checkpoint", **dict(ENGINE, token_buckets=(32,)))
        try:
            placed = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(llm.engine.runner.state)}
            runs.append([o.outputs[0] for o in llm.generate(PROMPTS, params)])
        finally:
            llm.engine.close()
    for w in ("wqkv", "wo", "w_gate_up", "w_down"):
        values, scale = placed[f"moe_layers.{w}.fp8"], placed[f"moe_layers.{w}.scale"]
        assert f"moe_layers.{w}" not in placed and values.dtype == jnp.float8_e4m3fn and scale.dtype == jnp.float32
        assert 0 < float(jnp.min(scale)) and np.isfinite(np.asarray(values, np.float32)).all(), w
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
    assert all(np.isfinite(lp[t].logprob) for o in runs[0] for lp, t in zip(o.logprobs, o.token_ids))
