"""Model loaders: GGUF, HF directories, the native cached form, and random `dummy:` weights.

`load.py` dispatches a model spec to its loader (`load_model`); `weights.py` holds what loaders return
(`LoadedModel`). Nothing is imported here: the tokenizer, which jax-free layers import, must not bring
the loaders' jax with it."""
