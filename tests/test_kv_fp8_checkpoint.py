"""fp8 KV-cache scales from an HF checkpoint's own `k_scale` / `v_scale` tensors (issue 30), on a tiny
random Llama: the checkpoint loads, an fp8 engine takes its scales (broadcast over kv heads) instead
of calibrating, also when restored from its placed checkpoint, and generates as an engine whose
scales were set by hand; a bfloat16 cache ignores them; malformed scales name the tensor; vLLM's other
spellings and a compressed-tensors config with a KV-cache scheme alone read the same.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import NamedTuple

import numpy as np
import pytest

from gptq_awq_models import CONFIG, LINEARS
from deepseek_models import VOCAB, _save_tokenizer
from infire_jax import LLM, Engine, EngineConfig, SamplingParams
from infire_jax.errors import ConfigError, UnsupportedModelError
from infire_jax.loaders.hf import load_hf_dir, read_hf_config
from infire_jax.loaders.hf_quantized import quant_scheme
from infire_jax.loaders.kv_scales_hf import read_kv_scales

LAYERS, KV_HEADS = CONFIG["num_hidden_layers"], CONFIG["num_key_value_heads"]
# Layer 0: one k scale per kv head; layer 1: scalars (shape () and (1,)).
SCALES = {"model.layers.0.self_attn.k_scale": np.array([0.02, 0.03], np.float32),
          "model.layers.0.self_attn.v_scale": np.array(0.015, np.float32),
          "model.layers.1.self_attn.k_scale": np.array([0.025], np.float32),
          "model.layers.1.self_attn.v_scale": np.array(0.0125, np.float32)}
EXPECTED = np.array([[[0.02, 0.03], [0.015, 0.015]], [[0.025, 0.025], [0.0125, 0.0125]]], np.float32)
# One 32-token bucket (the prompts prefill in one step; no chunking here) and no decode bursts
# (test_decode_burst.py): the engines compile what these tests run, not the six default buckets.
ENGINE = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(32,), max_model_len=128,
              num_kv_pages=32, num_decode_steps=1)
PROMPTS = ["The capital of France is", "def f(x):\n    return", "1, 2, 3, 4,"]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    e = CONFIG["hidden_size"]
    w = {"model.embed_tokens.weight": rng.standard_normal((VOCAB, e)), "model.norm.weight": np.ones(e),
         "lm_head.weight": rng.standard_normal((VOCAB, e)) * 0.1}
    for layer in range(LAYERS):
        w.update({f"model.layers.{layer}.{norm}.weight": np.ones(e)
                  for norm in ("input_layernorm", "post_attention_layernorm")})
        w.update({f"model.layers.{layer}.{name}.weight": rng.standard_normal(shape) / np.sqrt(shape[1])
                  for name, shape in LINEARS.items()})
    return {k: v.astype(np.float16) for k, v in w.items()}


def write_checkpoint(path: pathlib.Path, scales: dict[str, np.ndarray]) -> str:
    """A float16 Llama checkpoint with `scales` beside its weights."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True)
    save_file({**_weights(), **scales}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(CONFIG))
    _save_tokenizer(path)
    return str(path)


def _loaded_keys(tmp_path: pathlib.Path) -> set[str]:
    return set(load_hf_dir(write_checkpoint(tmp_path / "plain", {})).weights)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return write_checkpoint(tmp_path_factory.mktemp("kv_scales") / "llama", SCALES)


class Engines(NamedTuple):
    bf16: Engine
    fp8: Engine  # the checkpoint's scales
    by_hand: Engine  # calibrated, then given the checkpoint's scales by hand
    calibrated: np.ndarray  # by_hand's scales before


@pytest.fixture(scope="module")
def engines(checkpoint) -> Engines:
    """bfloat16 first (it builds the placed checkpoint: the checkpoint's folder is new, so nothing is
    cached for it yet), then fp8 from the checkpoint's scales (restored), then fp8 calibrated and
    given the same scales by hand."""
    bf16 = Engine(EngineConfig(model=checkpoint, kv_cache_dtype="bfloat16", **ENGINE))
    fp8 = Engine(EngineConfig(model=checkpoint, kv_cache_dtype="fp8", **ENGINE))
    by_hand = Engine(EngineConfig(model=checkpoint, kv_cache_dtype="fp8", calibrate_kv_scales=True, **ENGINE))
    calibrated = by_hand.runner.kv_scales
    by_hand.runner.set_kv_scales(EXPECTED)
    return Engines(bf16, fp8, by_hand, calibrated)


def test_the_checkpoint_loads_with_its_scales_beside_the_weights(checkpoint, tmp_path):
    plain = write_checkpoint(tmp_path / "plain", {})
    with_scales, without = load_hf_dir(checkpoint).weights, load_hf_dir(plain).weights
    assert with_scales.keys() == without.keys()
    for name in with_scales:
        np.testing.assert_array_equal(with_scales[name], without[name])
    np.testing.assert_array_equal(read_kv_scales(checkpoint, read_hf_config(checkpoint)), EXPECTED)
    assert read_kv_scales(plain, read_hf_config(plain)) is None


def test_fp8_engine_takes_the_checkpoint_scales(engines):
    assert engines.fp8.boot.restored  # the placed checkpoint skips the HF loader; the scales still come
    np.testing.assert_array_equal(engines.fp8.runner.kv_scales, EXPECTED)
    np.testing.assert_array_equal(np.asarray(engines.fp8.runner.cache.kv_scales), EXPECTED)
    assert engines.calibrated.shape == EXPECTED.shape and not np.allclose(engines.calibrated, EXPECTED)


def test_fp8_engine_generates_as_one_given_the_scales_by_hand(engines):
    """The scales set by hand reach the device pool, and the two engines compute the same: the same
    tokens with the same log-probabilities, bit for bit (the calibrated scales give others)."""
    np.testing.assert_array_equal(np.asarray(engines.by_hand.runner.cache.kv_scales), EXPECTED)
    params = dataclasses.replace(GREEDY, logprobs=1)
    got, want = (LLM(engine=e).generate(PROMPTS, params) for e in (engines.fp8, engines.by_hand))
    for g, w in zip(got, want):
        assert len(g.outputs[0].token_ids) == GREEDY.max_tokens
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].logprobs == w.outputs[0].logprobs


def test_bfloat16_cache_ignores_the_scales(engines, tmp_path):
    """The same weights without the scales, in an engine of the same settings, generate the same
    tokens with the same logprobs, bit for bit."""
    assert engines.bf16.runner.kv_scales is None
    plain = Engine(EngineConfig(model=write_checkpoint(tmp_path / "plain", {}), kv_cache_dtype="bfloat16", **ENGINE))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    got, want = (LLM(engine=e).generate(PROMPTS, params) for e in (engines.bf16, plain))
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert len(g.outputs[0].logprobs) == params.max_tokens
        assert g.outputs[0].logprobs == w.outputs[0].logprobs


@pytest.mark.parametrize("scales, message", [
    ({**SCALES, "model.layers.1.self_attn.k_scale": np.ones(3, np.float32)},
     r"model\.layers\.1\.self_attn\.k_scale has shape \(3,\)"),
    ({k: v for k, v in SCALES.items() if not k.startswith("model.layers.1.")},
     r"model\.layers\.1\.self_attn\.k_scale is missing"),
    ({k: v for k, v in SCALES.items() if k != "model.layers.0.self_attn.v_scale"},
     r"model\.layers\.0\.self_attn\.v_scale is missing"),
    ({**SCALES, "model.layers.0.self_attn.kv_scale": np.array(0.1, np.float32)},
     r"model\.layers\.0\.self_attn\.kv_scale: layer 0's k scale is also given"),
    ({**SCALES, "model.layers.1.self_attn.v_scale": np.array(0.0, np.float32)},
     r"model\.layers\.1\.self_attn\.v_scale holds 0\.0"),
    ({**SCALES, "model.layers.2.self_attn.k_scale": np.array(0.1, np.float32)},
     r"model\.layers\.2\.self_attn\.k_scale: the model has 2 layers"),
])
def test_malformed_scales_name_the_tensor(scales, message, tmp_path):
    path = write_checkpoint(tmp_path / "bad", scales)
    with pytest.raises(ConfigError, match=message):
        read_kv_scales(path, read_hf_config(path))
    with pytest.raises(ConfigError, match=message):  # before any weight is read
        Engine(EngineConfig(model=path, kv_cache_dtype="fp8", **ENGINE))


@pytest.mark.parametrize("k, v", [("k_proj.output_scale", "v_proj.output_scale"),
                                  ("k_proj.k_scale", "v_proj.v_scale"), ("kv_scale", None)])
def test_vllm_spellings(k, v, tmp_path):
    scales = {f"model.layers.{layer}.self_attn.{name}": np.array(0.5 + layer, np.float32)
              for layer in range(LAYERS) for name in (k, v) if name}
    path = write_checkpoint(tmp_path / "spelled", scales)
    assert load_hf_dir(path).weights.keys() == _loaded_keys(tmp_path)
    want = np.broadcast_to(np.array([0.5, 1.5], np.float32)[:, None, None], (LAYERS, 2, KV_HEADS))
    np.testing.assert_array_equal(read_kv_scales(path, read_hf_config(path)), want)


def test_the_flag_forces_calibration():
    from infire_jax.cli import build_parser
    from infire_jax.engine.args import engine_config

    for flags, want in (([], False), (["--calibrate-kv-scales"], True)):
        args = build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8", *flags])
        assert engine_config(args).calibrate_kv_scales is want


def test_compressed_tensors_kv_cache_scheme_alone_is_a_float_checkpoint(tmp_path):
    """llm-compressor's KV-cache-only recipe: no weight groups, `k_proj.output_scale` / `v_proj.output_scale`."""
    kv = dict(num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True)
    qc = dict(quant_method="compressed-tensors", config_groups={}, kv_cache_scheme=kv)
    assert quant_scheme({"quantization_config": qc}) is None
    with pytest.raises(UnsupportedModelError, match="kv_cache_scheme"):
        quant_scheme({"quantization_config": dict(qc, kv_cache_scheme=dict(kv, type="int"))})
    scales = {f"model.layers.{layer}.self_attn.{name}": np.array(0.25, np.float32)
              for layer in range(LAYERS) for name in ("k_proj.output_scale", "v_proj.output_scale")}
    path = write_checkpoint(tmp_path / "ct", scales)
    config = json.loads(pathlib.Path(path, "config.json").read_text())
    pathlib.Path(path, "config.json").write_text(json.dumps(dict(config, quantization_config=qc)))
    assert load_hf_dir(path).weights.keys() == _loaded_keys(tmp_path)
    np.testing.assert_array_equal(read_kv_scales(path, read_hf_config(path)), np.full((LAYERS, 2, KV_HEADS), 0.25))
