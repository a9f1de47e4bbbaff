"""Which loader reads a model: the one place that resolves a model spec to its format.

Specs: a `.gguf` file, an HF directory, a native or compressed (`infire-jax compress`) directory,
`dummy:<name>`, or None for the embedded default (loaders/paths.py). GGUF files are dequantized once
and kept in native form under the cache directory, so later starts only read. On the devices a
model is restored from its placed checkpoint (loaders/checkpoint.py), kept palette-compressed, or
kept quantized (loaders/gguf_quant.py, llama_quant.py, deepseek_quant.py). The format modules
import none of this one: a placed checkpoint is handed its source's config and loader.
"""

from __future__ import annotations

import hashlib
import logging
import os

import jax.numpy as jnp

from infire_jax.compression.resident import parse_resident
from infire_jax.errors import ConfigError, ModelNotFoundError
from infire_jax.loaders import checkpoint, deepseek_quant, gguf_quant, gpt_oss_quant, kept_8bit, llama_quant
from infire_jax.loaders.compressed import is_compressed_dir, load_compressed, read_compressed_config
from infire_jax.loaders.dummy import load_dummy
from infire_jax.loaders.gguf import load_gguf, read_gguf_config
from infire_jax.loaders.hf import load_hf_dir, read_hf_config
from infire_jax.loaders.paths import DEFAULT_MODEL_NAME, cache_dir, default_model_path
from infire_jax.loaders.weights import (
    NATIVE_FORMAT_VERSION, LoadedModel, Placed, is_native_dir, load_native, read_native_config, save_native)
from infire_jax.models.config import ModelConfig
from infire_jax.models.registry import build_state
from infire_jax.quant.int4_rtn import DEFAULT_INT4_GROUP, INT4_GROUPS
from infire_jax.quant.resident import QUANTIZATION_MODES
from sharding.plan import ShardPlan

log = logging.getLogger(__name__)


# ---- on the host -----------------------------------------------------------------------------------

def _native_cache_path(gguf_path: str) -> str:
    st = os.stat(gguf_path)
    key = f"{os.path.abspath(gguf_path)}:{st.st_size}:{st.st_mtime_ns}:{NATIVE_FORMAT_VERSION}"
    return os.path.join(cache_dir(), "models", hashlib.sha256(key.encode()).hexdigest()[:24])


def _load_gguf_cached(path: str, name: str | None) -> LoadedModel:
    native = _native_cache_path(path)
    if is_native_dir(native):
        model = load_native(native)
    else:
        model = load_gguf(path)
        try:
            save_native(model, native)
        except OSError as e:  # a read-only cache only costs speed
            log.warning("could not cache the converted model at %s: %s", native, e)
    if name:
        model.name = name
    return model


def load_config(spec: str | None) -> ModelConfig:
    """The model's config without reading its weights, to validate a mesh before loading."""
    if not spec:
        spec = default_model_path()
    if spec.startswith("dummy:"):
        return load_dummy(spec[len("dummy:"):]).config
    if os.path.isfile(spec) and spec.endswith(".gguf"):
        native = _native_cache_path(spec)
        if is_native_dir(native):
            return read_native_config(native)
        return read_gguf_config(spec)
    if os.path.isdir(spec):
        if is_native_dir(spec):
            return read_native_config(spec)
        if is_compressed_dir(spec):
            return read_compressed_config(spec)
        return read_hf_config(spec)
    return load_model(spec).config  # raises the same clear error load_model would


def load_model(spec: str | None) -> LoadedModel:
    if not spec:
        return _load_gguf_cached(default_model_path(), DEFAULT_MODEL_NAME)
    if spec.startswith("dummy:"):
        return load_dummy(spec[len("dummy:"):])
    if os.path.isfile(spec):
        if not spec.endswith(".gguf"):
            raise ModelNotFoundError(f"{spec} is a file but not a .gguf model")
        return _load_gguf_cached(spec, None)
    if os.path.isdir(spec):
        if is_native_dir(spec):
            return load_native(spec)
        if is_compressed_dir(spec):
            return load_compressed(spec)
        return load_hf_dir(spec)
    raise ModelNotFoundError(
        f"model {spec!r} not found: expected a .gguf file, an HF model directory, or dummy:<name>")


# ---- on the devices --------------------------------------------------------------------------------

def load_placed(spec: str | None, dtype, plan: ShardPlan | None, *, loaded: LoadedModel | None = None,
                compress: tuple[str, ...] = ()) -> Placed:
    """The model placed on the devices: restored from its checkpoint when a valid one exists, else
    loaded from its source, placed, and checkpointed for the next start (loaders/checkpoint.py).
    `compress`: the kinds of weights kept palette-compressed (compression/resident.py),
    checkpointed coded, as placed.

    A given `loaded` model, `dummy:` specs (drawn on the devices, faster than read) and
    INFIRE_JAX_NO_CHECKPOINT=1 bypass checkpoints. A `dummy:` model kept compressed is
    checkpointed all the same: its drawing is fast, but coding it is not (minutes for an 8B model
    on a GPU machine's host), and its weights are the same at every start (a fixed seed).
    """
    if loaded is not None or (_is_dummy(spec) and not compress) or os.environ.get("INFIRE_JAX_NO_CHECKPOINT"):
        loaded = loaded or load_model(spec)
        return Placed(loaded, *build_state(loaded.config, loaded.weights, dtype, plan=plan, seed=loaded.random_seed,
                                           compress=compress), "checkpoints bypassed")
    placed = checkpoint.restore_or_build(spec, load_config(spec), dtype, plan, lambda: load_model(spec), compress)
    if not spec:  # the default model's checkpoint is its file's, perhaps written by a load by path (the GGUF's name)
        placed.loaded.name = DEFAULT_MODEL_NAME
    return placed


def checkpoint_path(spec: str | None, dtype, plan: ShardPlan | None, compress: tuple[str, ...] = ()) -> str:
    """Where the checkpoint of this source, dtype and placement lives (whether or not it exists)."""
    return checkpoint.checkpoint_path(spec, load_config(spec), dtype, plan, compress)


def _is_dummy(spec: str | None) -> bool:
    return (spec or "").startswith("dummy:")


def load_resident_placed(spec: str | None, dtype, plan: ShardPlan | None, weights_compression: str, *,
                         loaded: LoadedModel | None = None) -> Placed:
    """The model placed with the selected weights palette-compressed on the devices, restored coded
    from its placed checkpoint when one exists."""
    try:
        _, kinds = parse_resident(weights_compression)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if jnp.dtype(dtype) != jnp.bfloat16:
        raise ConfigError(f"weights_compression={weights_compression!r} keeps bfloat16 weights: "
                          f"use dtype bfloat16, not {jnp.dtype(dtype).name}")
    return load_placed(spec, dtype, plan, loaded=loaded, compress=kinds)


def load_quantized_placed(spec: str | None, dtype, plan: ShardPlan | None, mode: str,
                          int4_group_size: int | None = None) -> Placed:
    """The model placed with its layer weights kept quantized (`mode`: "gguf" keeps a GGUF file's
    blocks; "int8" and "fp8" quantize any model's float layer weights at load, per output channel, "int4" with
    zero points in groups of `int4_group_size` inputs (default 128; a `dummy:` model's are drawn);
    "checkpoint" keeps a quantized HF checkpoint's own format: GPTQ / AWQ int4, 8-bit fp8 or int8
    channels, fp8 blocks (Qwen3's, MiniMax-M2's and DeepSeek-V3's releases), Kimi's int4, gpt-oss's MXFP4
    experts). Checkpoints of the placed
    weights are bypassed."""
    if mode not in QUANTIZATION_MODES:
        raise ConfigError(f"unknown weights_quantization {mode!r}; choose from {list(QUANTIZATION_MODES)}")
    if int4_group_size is not None and mode != "int4":
        raise ConfigError(f"int4_group_size sets weights_quantization='int4''s groups, not {mode!r}'s")
    if int4_group_size is not None and int4_group_size not in INT4_GROUPS:
        raise ConfigError(f"int4_group_size {int4_group_size!r}: choose from {list(INT4_GROUPS)}")
    if mode == "checkpoint":
        if gpt_oss_quant.is_gpt_oss(spec):
            return gpt_oss_quant.load_kept_placed(spec, dtype, plan)
        if kept_8bit.keeps(spec):
            return kept_8bit.load_kept_placed(spec, dtype, plan)
        if llama_quant.keeps(spec):
            return llama_quant.load_kept_placed(spec, dtype, plan)
        return deepseek_quant.load_kept_placed(spec, dtype, plan)
    if mode == "gguf":
        return gguf_quant.load_gguf_placed(spec, dtype, plan)
    return gguf_quant.place_quantized_at_load(load_model(spec), mode, dtype, plan,
                                              int4_group_size or DEFAULT_INT4_GROUP)
