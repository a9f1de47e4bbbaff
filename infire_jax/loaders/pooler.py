"""How a checkpoint says its embeddings are pooled, as vLLM reads it: an HF directory saved by
sentence-transformers (`modules.json`, its Pooling module's `config.json`, a Normalize module), and
config.json's matryoshka sizes. The engine's `pooler_config` fields override these (pooling/config.py)."""

from __future__ import annotations

import json
import os
from typing import Any

# sentence-transformers' Pooling flags, by the pooling type they mean (the first set one wins, as vLLM's).
_POOLING_MODES = (("pooling_mode_lasttoken", "LAST"), ("pooling_mode_mean_tokens", "MEAN"),
                  ("pooling_mode_cls_token", "CLS"))


def _json(path: str) -> Any:
    with open(path) as f:
        return json.load(f)


def declared_pooler(model: str | None) -> dict[str, Any]:
    """PoolerConfig fields a model directory declares; {} for anything else (a GGUF file, a dummy)."""
    if not model or not os.path.isdir(model):
        return {}
    out: dict[str, Any] = {}
    config = os.path.join(model, "config.json")
    if os.path.isfile(config):
        hf = _json(config)
        if hf.get("matryoshka_dimensions"):
            out["matryoshka_dimensions"] = tuple(hf["matryoshka_dimensions"])
        elif hf.get("is_matryoshka"):
            out["matryoshka_dimensions"] = True
    modules = os.path.join(model, "modules.json")
    if not os.path.isfile(modules):
        return out
    entries = _json(modules)
    out["use_activation"] = any(m.get("type", "").endswith("models.Normalize") for m in entries)
    for m in entries:
        pooling = os.path.join(model, m.get("path", ""), "config.json")
        if m.get("type", "").endswith("models.Pooling") and os.path.isfile(pooling):
            flags = _json(pooling)
            kind = next((kind for flag, kind in _POOLING_MODES if flags.get(flag)), None)
            if kind is not None:
                out["pooling_type"] = kind
    return out
