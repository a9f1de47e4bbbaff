"""vLLM's `quantization` (`-q`, `LLM(quantization=...)`) mapped onto `weights_quantization`
(loaders/vllm_quantization.py): on tiny checkpoints written in each published layout
(tests/channel_models.py, tests/gptq_awq_models.py), the method a checkpoint carries keeps it
quantized, fp8 quantizes a float model at load, and a name the model does not match is refused
naming both before any weight is read."""

from __future__ import annotations

import numpy as np
import pytest

from channel_models import write_checkpoints
from gptq_awq_models import write_checkpoint
from infire_jax.errors import ConfigError
from infire_jax.loaders.vllm_quantization import weights_quantization_of


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("vllm_q")
    paths = {}
    for name in ("fp8-dynamic", "autofp8", "fbgemm-fp8", "fp8-block"):
        paths[name], paths["float"] = write_checkpoints(base, name)
    for method in ("awq", "gptq"):
        write_checkpoint(base / method, method, 32)
        paths[method] = str(base / method)
    return paths


@pytest.mark.parametrize("model, quantization, mode", [
    ("fp8-dynamic", "compressed-tensors", "checkpoint"),
    ("autofp8", "fp8", "checkpoint"),
    ("fp8-block", "fp8", "checkpoint"),
    ("fbgemm-fp8", "fbgemm_fp8", "checkpoint"),
    ("awq", "awq_marlin", "checkpoint"),
    ("gptq", "gptq", "checkpoint"),
    ("float", "fp8", "fp8"),
    (None, "gguf", "gguf"),
    ("dummy:gpt-oss-20b", "mxfp4", "checkpoint"),
    ("dummy:smollm2-135m", "fp8", "fp8"),
])
def test_each_name_keeps_what_vllm_keeps(models, model, quantization, mode):
    assert weights_quantization_of(models.get(model, model), quantization) == mode


@pytest.mark.parametrize("model, quantization, message", [
    ("fp8-dynamic", "fp8", "does not match the model's quantization_config.quant_method 'compressed-tensors'"),
    ("awq", "gptq", "quant_method 'awq'"),
    ("float", "awq", "is not a awq checkpoint"),
    ("float", "gguf", "is not a .gguf file"),
    ("float", "bitsandbytes", "quantization 'bitsandbytes' is not served here"),
])
def test_a_name_the_model_does_not_match_is_refused(models, model, quantization, message):
    with pytest.raises(ConfigError, match=message):
        weights_quantization_of(models[model], quantization)


def test_cli_and_llm_take_vllms_name(models):
    """`-q fp8` on a float checkpoint: an engine holding fp8 parts a scale a row, which generates; set
    beside a different weights_quantization, refused."""
    from flax import nnx

    from infire_jax import LLM, SamplingParams
    from infire_jax.cli import build_parser
    from infire_jax.engine.args import engine_config
    from infire_jax.engine.setup import EngineConfig

    args = build_parser().parse_args(["serve", "--model", models["awq"], "-q", "awq_marlin"])
    assert engine_config(args, models["awq"]).weights_quantization == "checkpoint"
    with pytest.raises(ConfigError, match="means weights_quantization='fp8' .* not 'int8'; set one"):
        EngineConfig(model=models["float"], quantization="fp8", weights_quantization="int8")
    llm = LLM(model=models["float"], quantization="fp8", dtype="float32", max_num_seqs=2, max_num_batched_tokens=32,
              token_buckets=(32,), max_model_len=128, num_kv_pages=16)
    placed = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(llm.engine.runner.state)}
    assert placed["layers.w_down.fp8"].dtype == np.dtype("float8_e4m3fn") and "layers.w_down" not in placed
    out = llm.generate([[5, 77, 200]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 4
    llm.engine.close()
