"""Model loaders: GGUF, HF directories, the native cached form, and random `dummy:` weights."""

from infire_jax.loaders.load import load_model
from infire_jax.loaders.weights import LoadedModel

__all__ = ["LoadedModel", "load_model"]
