"""Published quantized checkpoints of the DeepSeek-V3 family (loaders/hf_quantized.py) against HF.

Tiny random DeepseekV3 and Kimi-K2.5 checkpoints are written as the published ones are laid out:
DeepSeek-V3 with every linear weight in float8_e4m3fn with block scales (the router, norms and
embeddings left as they are), Kimi K2.5 with its routed experts in compressed-tensors
pack-quantized int4. The reference is HF's model holding the weights those tensors define, from
the float64 definitions in tests/quant_reference.py: greedy tokens must be identical and logprobs
agree within 1e-3 (float32).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from deepseek_models import hf_greedy, hf_model, quantization_config, quantize_checkpoint, save
from infire_jax.errors import UnsupportedModelError
from infire_jax.loaders.hf_quantized import QuantScheme, dequantized, quant_scheme
from infire_jax.quant.formats import quantize_fp8_block, quantize_int4_group
from quant_reference import fp8_block, int4_pack_quantized

NUM_TOKENS = 64
PROMPTS = [[5, 77, 200, 13, 42], list(range(60, 100))]
BLOCK = 16  # DeepSeek-V3 ships 128; 16 gives these small weights several blocks each
FP8_CONFIG = quantization_config("fp8", BLOCK)
INT4_CONFIG = quantization_config("int4", 32)


@pytest.mark.parametrize("name,scheme", [("deepseek-v3", "fp8"), ("kimi-k2.5", "int4")])
def test_quantized_checkpoint_matches_hf_on_the_weights_it_defines(name, scheme, tmp_path):
    import torch

    from infire_jax import LLM, SamplingParams

    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3ForCausalLM

    hf = hf_model(name)
    path = save(name, hf, tmp_path / "quantized")
    floats = load_file(os.path.join(path, "model.safetensors"))
    defined = quantize_checkpoint(path, scheme, BLOCK if scheme == "fp8" else 32)
    assert len(defined) >= (20 if scheme == "fp8" else 2 * 3 * 12)  # every linear / 2 MoE layers x 3 x 12 experts
    # HF's reference: the same model holding the weights the quantized tensors define
    reference = tmp_path / "reference"
    hf.config.save_pretrained(reference)
    floats.update({k: torch.from_numpy(w.astype(np.float32)) for k, w in defined.items()})
    save_file({k.removeprefix("language_model."): v for k, v in floats.items()}, reference / "model.safetensors")
    hf = DeepseekV3ForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    llm = LLM(model=path, dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(4, 32),
              max_model_len=128, num_kv_pages=40)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=1))
    for prompt, out in zip(PROMPTS, outs):
        want, want_lp = hf_greedy(hf, prompt, NUM_TOKENS)
        assert out.token_ids == want
        np.testing.assert_allclose([lp[t].logprob for lp, t in zip(out.logprobs, want)], want_lp, atol=1e-3, rtol=0)
    llm.engine.close()


def test_parts_across_files_and_in_any_order():
    w = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
    q = quantize_int4_group(w)
    parts = [("m.weight_scale", np.asarray(q.weight_scale)), ("norm.weight", np.ones(4, np.float32)),
             ("m.weight_shape", np.array([16, 64])), ("m.weight_packed", np.asarray(q.weight_packed))]
    out = dict(dequantized(iter(parts), QuantScheme("int4", group=32)))
    assert set(out) == {"norm.weight", "m.weight"}
    want = int4_pack_quantized(np.asarray(q.weight_packed), np.asarray(q.weight_scale), (16, 64), 32)
    np.testing.assert_array_equal(out["m.weight"], want.astype(np.float32))


def test_fp8_leaves_unquantized_weights_alone():
    w = np.random.default_rng(1).standard_normal((32, 48)).astype(np.float32)
    q = quantize_fp8_block(w, 16)
    router = np.random.default_rng(2).standard_normal((8, 48)).astype(np.float32)
    parts = [("a.weight", np.asarray(q.weight)), ("gate.weight", router),
             ("a.weight_scale_inv", np.asarray(q.weight_scale_inv))]
    out = dict(dequantized(iter(parts), QuantScheme("fp8", block=16)))
    np.testing.assert_array_equal(out["gate.weight"], router)
    want = fp8_block(np.asarray(q.weight).view(np.uint8), np.asarray(q.weight_scale_inv), 16)
    np.testing.assert_array_equal(out["a.weight"], want.astype(np.float32))


def test_missing_part_names_the_module():
    w = quantize_int4_group(np.ones((8, 32), np.float32))
    with pytest.raises(UnsupportedModelError, match=r"layers\.0\.mlp\.experts\.3\.up_proj.*weight_shape"):
        list(dequantized(iter([("layers.0.mlp.experts.3.up_proj.weight_packed", np.asarray(w.weight_packed)),
                               ("layers.0.mlp.experts.3.up_proj.weight_scale", np.asarray(w.weight_scale))]),
                         QuantScheme("int4", group=32)))


def test_mismatched_parts_name_the_module():
    w = quantize_int4_group(np.ones((8, 32), np.float32))
    with pytest.raises(UnsupportedModelError, match=r"experts\.0\.down_proj: weight_packed has shape"):
        list(dequantized(iter([("experts.0.down_proj.weight_packed", np.asarray(w.weight_packed)),
                               ("experts.0.down_proj.weight_scale", np.asarray(w.weight_scale)),
                               ("experts.0.down_proj.weight_shape", np.array([8, 64]))]),
                         QuantScheme("int4", group=32)))


@pytest.mark.parametrize("config,field", [
    ({"quant_method": "bitsandbytes"}, "quant_method"),
    ({"quant_method": "fp8", "weight_block_size": [128, 64]}, "weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e5m2"}, "fmt"),
    (dict(INT4_CONFIG, format="naive-quantized", config_groups={"g": {"weights": {}}}), "format"),
    (dict(INT4_CONFIG, config_groups={"g": {"format": "pack-quantized", "weights": dict(
        INT4_CONFIG["config_groups"]["group_0"]["weights"], symmetric=False)}}), "symmetric"),
    (dict(INT4_CONFIG, config_groups={"g": {"format": "pack-quantized", "weights": dict(
        INT4_CONFIG["config_groups"]["group_0"]["weights"], num_bits=8)}}), "num_bits"),
])
def test_unsupported_schemes_name_the_field(config, field):
    with pytest.raises(UnsupportedModelError, match=field):
        quant_scheme({"quantization_config": config})


def test_schemes_read_from_the_config():
    assert quant_scheme({"model_type": "llama"}) is None
    assert quant_scheme({"quantization_config": FP8_CONFIG}) == QuantScheme("fp8", block=BLOCK)
    assert quant_scheme({"model_type": "kimi_k25", "text_config": {"quantization_config": INT4_CONFIG}}) == \
        QuantScheme("int4", group=32)
