"""Moving a prompt's KV between engines of the same model and layout (prefill/decode disaggregation).

`blocks.py` is the payload and its layout check; `pages.py` which pool pages a payload carries (with
a hybrid KV cache, each group's pages that a prefix hit of its blocks reads). The engine exports the full pages of a prompt
that its prefix cache holds (`Engine.export_prompt_kv`) and imports them into its own prefix cache
(`Engine.import_prompt_kv`), under the hash chain it computes itself from the tokens and the
tenant, so the decode path needs no special case: the request finds its prompt cached.
"""

from infire_jax.kv_transfer.blocks import KVBlocks, KVLayout

__all__ = ["KVBlocks", "KVLayout"]
