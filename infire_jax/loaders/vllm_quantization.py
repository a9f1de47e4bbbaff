"""vLLM's `quantization` (`--quantization` / `-q`, `LLM(quantization=...)`) as our `weights_quantization`.

vLLM users name a checkpoint's own method (awq, gptq, fp8, compressed-tensors, ...) or ask for fp8
at load on a float checkpoint; both keep the weights quantized on the device. Here a name that
matches the model's `quantization_config` keeps its weights as published ("checkpoint"), "fp8" on a
float model quantizes it at load ("fp8"), and "gguf" keeps a GGUF file's blocks. A name the model
does not match is refused naming both, as vLLM refuses it, before any weight is read.
"""

from __future__ import annotations

from infire_jax.errors import ConfigError
from infire_jax.loaders.dummy import spec_hf_config
from infire_jax.loaders.hf_quantized import quantization_config

# vLLM's method names for the checkpoint formats kept here, by the quant_method a config.json carries
# (vLLM's marlin / machete kernels are its own choice of kernel, not another format).
CHECKPOINT_METHODS = {"awq": "awq", "awq_marlin": "awq", "gptq": "gptq", "gptq_marlin": "gptq",
                      "compressed-tensors": "compressed-tensors", "fbgemm_fp8": "fbgemm_fp8", "fp8": "fp8",
                      "mxfp4": "mxfp4"}
NAMES = (*CHECKPOINT_METHODS, "gguf")


def _quant_method(spec: str | None) -> str | None:
    """The model's `quantization_config.quant_method` (Kimi K2.5's may sit in `text_config`); None for a
    float model, a GGUF file or the default model."""
    hf = spec_hf_config(spec)
    return None if hf is None else quantization_config(hf).get("quant_method")


def weights_quantization_of(spec: str | None, quantization: str) -> str:
    """The `weights_quantization` mode that serves `spec` as vLLM's `quantization` asks; ConfigError
    naming the mismatch for a name this model is not in, or a name not served here."""
    if quantization not in NAMES:
        raise ConfigError(f"quantization {quantization!r} is not served here; choose from {list(NAMES)} "
                          "(or weights_quantization int8 / int4 to quantize at load)")
    gguf = spec is None or spec.endswith(".gguf")
    if quantization == "gguf":
        if not gguf:
            raise ConfigError(f"quantization 'gguf' keeps a GGUF file's blocks; model {spec!r} is not a .gguf file")
        return "gguf"
    method = None if gguf else _quant_method(spec)
    if method is None:
        if quantization == "fp8":  # vLLM's dynamic fp8: a float model quantized at load
            return "fp8"
        raise ConfigError(f"quantization {quantization!r}: model {spec or 'default'!r} is not a {quantization} "
                          "checkpoint (it has no quantization_config); 'fp8' quantizes a float model at load")
    if CHECKPOINT_METHODS[quantization] != method:
        raise ConfigError(f"quantization {quantization!r} does not match the model's quantization_config."
                          f"quant_method {method!r}; pass quantization={method!r}, or leave it unset to "
                          "dequantize the checkpoint at load")
    return "checkpoint"
