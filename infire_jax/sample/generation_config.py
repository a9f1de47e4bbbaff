"""The model creator's sampling defaults (generation_config.json), applied as vLLM applies them.

vLLM's `--generation-config auto` (its default) reads the checkpoint's generation_config.json, and a
request that leaves temperature, top_p, top_k, min_p or repetition_penalty unset gets the file's
value instead of the OpenAI default; `max_new_tokens` caps every request's max_tokens. Qwen3 and
Llama 3, for instance, ship temperature 0.6 and top_p 0.95 / 0.9 there, so without this the same
request samples differently here than on vLLM. `vllm` ignores the file; a folder reads that folder's
file; `--override-generation-config` is laid over either.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Mapping

from infire_jax.errors import ConfigError, InvalidRequestError
from infire_jax.sample.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# generation_config.json's name -> SamplingParams' (vLLM's get_diff_sampling_param).
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
# transformers' GenerationConfig defaults: vLLM reads the file's difference from them, so these
# values are no default at all (top_k 50 in particular does not turn top-k on).
_HF_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}


def _read(folder: str, *, required: bool) -> dict[str, Any]:
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        if required:
            raise ConfigError(f"generation_config={folder!r}: no generation_config.json there")
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} cannot be read as JSON: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return {k: v for k, v in data.items() if _HF_DEFAULTS.get(k, object()) != v}


def sampling_defaults(model: str | None, source: str = "auto",
                      override: Mapping[str, Any] | str | None = None) -> dict[str, Any]:
    """SamplingParams field -> default, for the fields the generation config sets.

    `source`: "auto" (the model's own folder; a GGUF file or a dummy: model has none), "vllm" (no
    file), or a folder. `override`: vLLM's override_generation_config, a dict or its JSON."""
    if not isinstance(source, str) or not source:
        raise ConfigError(f"generation_config must be 'auto', 'vllm' or a folder, got {source!r}")
    if source == "vllm":
        config: dict[str, Any] = {}
    elif source == "auto":
        config = _read(model, required=False) if model and os.path.isdir(model) else {}
    else:
        config = _read(source, required=True)
    if isinstance(override, str):
        try:
            override = json.loads(override)
        except ValueError as e:
            raise ConfigError(f"override_generation_config is not JSON: {e}") from e
    if override is not None and not isinstance(override, Mapping):
        raise ConfigError(f"override_generation_config must be a JSON object, got {override!r:.80}")
    config.update(override or {})
    defaults = {FIELDS[k]: v for k, v in config.items() if k in FIELDS and v is not None}
    if isinstance(defaults.get("top_k"), float) and defaults["top_k"].is_integer():
        defaults["top_k"] = int(defaults["top_k"])
    if defaults.get("max_tokens") is not None and not (isinstance(defaults["max_tokens"], int)
                                                       and defaults["max_tokens"] >= 1):
        raise ConfigError(f"the generation config's max_new_tokens must be an integer >= 1, got "
                          f"{defaults['max_tokens']!r}")
    try:
        SamplingParams(**defaults)
    except (InvalidRequestError, TypeError) as e:
        raise ConfigError(f"the generation config's sampling defaults {defaults}: {e}") from e
    if defaults:
        log.info("sampling defaults from the generation config: %s (requests that set these fields keep theirs; "
                 "--generation-config vllm ignores the file)", defaults)
    return defaults
