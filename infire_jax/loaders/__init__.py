"""Model loaders: GGUF, HF directories, the native cached form, and random `dummy:` weights.

`load_model` and `LoadedModel` load on first use: the tokenizer, which jax-free layers import from
here, must not bring the loaders' jax with it."""

import importlib

_EXPORTS = {"LoadedModel": "infire_jax.loaders.weights", "load_model": "infire_jax.loaders.load"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'infire_jax.loaders' has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(module), name)
    return value
