"""Embeddings' settings: how an engine pools (vLLM's `PoolerConfig`) and what one request asks for
(vLLM's `PoolingParams`), validated when made. Host side, no jax.

A causal LM serves embeddings as vLLM's pooling runner does (`--runner pooling`): the prompt runs
through the model, its final hidden states (after the final norm) are pooled, by default at the last
token (LAST, as Qwen3-Embedding and e5-mistral are trained), then normalised to unit length unless
`use_activation` is false (vLLM 0.32's name for what it called `normalize` before, which it now
refuses, as this does). MEAN averages every prompt token's state; CLS takes the first token's.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from infire_jax.errors import ConfigError, InvalidRequestError

POOLING_TYPES = ("LAST", "MEAN", "CLS")
REMOVED_NORMALIZE = "Parameter `normalize` was removed; use `use_activation` instead."  # vLLM 0.32's words


@dataclasses.dataclass(frozen=True)
class PoolerConfig:
    """How the engine pools. `matryoshka_dimensions`: the model was trained so that a prefix of its
    embedding is one too (HF config's `matryoshka_dimensions`, or True for any size, as its
    `is_matryoshka`); only then may a request ask for fewer `dimensions` (vLLM refuses it otherwise)."""

    pooling_type: str = "LAST"
    use_activation: bool = True  # for embeddings: normalise to unit length
    matryoshka_dimensions: tuple[int, ...] | bool = False

    def __post_init__(self):
        kind = self.pooling_type.upper() if isinstance(self.pooling_type, str) else self.pooling_type
        if kind not in POOLING_TYPES:
            raise ConfigError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
        object.__setattr__(self, "pooling_type", kind)
        if not isinstance(self.use_activation, bool):
            raise ConfigError(f"use_activation must be true or false, got {self.use_activation!r}")
        dims = self.matryoshka_dimensions
        if isinstance(dims, (list, tuple)):
            if not dims or any(not isinstance(d, int) or isinstance(d, bool) or d < 1 for d in dims):
                raise ConfigError(f"matryoshka_dimensions must be positive integers, got {dims!r}")
            object.__setattr__(self, "matryoshka_dimensions", tuple(dims))
        elif not isinstance(dims, bool):
            raise ConfigError(f"matryoshka_dimensions must be a list of sizes or a boolean, got {dims!r}")

    @classmethod
    def parse(cls, value: PoolerConfig | dict | str | None, declared: dict[str, Any] | None = None) -> PoolerConfig:
        """`--pooler-config` (a dict or its JSON) over what the checkpoint declares (loaders/pooler.py)."""
        if isinstance(value, PoolerConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ConfigError(f"pooler_config is not valid JSON: {e}") from e
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"pooler_config must be a JSON object, got {value!r}")
        fields = {f.name for f in dataclasses.fields(cls)}
        if "normalize" in (value or {}):
            raise ConfigError(REMOVED_NORMALIZE)
        unknown = sorted(set(value or {}) - fields)
        if unknown:
            raise ConfigError(f"pooler_config takes {', '.join(sorted(fields))}; not {', '.join(unknown)}")
        return cls(**{**(declared or {}), **(value or {})})


@dataclasses.dataclass
class PoolingParams:
    """What one embedding request asks for: `dimensions` (the embedding's first d values, for a
    matryoshka model) and `use_activation` (normalise; None: the engine's PoolerConfig decides)."""

    dimensions: int | None = None
    use_activation: bool | None = None

    n = 1  # one embedding a prompt (the engine's streams count sequences by `n`)

    def __post_init__(self):
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or isinstance(self.dimensions, bool)
                                            or self.dimensions < 1):
            raise InvalidRequestError(f"dimensions must be a positive integer, got {self.dimensions!r}",
                                      param="dimensions")
        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise InvalidRequestError(f"use_activation must be true or false, got {self.use_activation!r}",
                                      param="use_activation")

    def check(self, pooler: PoolerConfig, hidden_size: int) -> None:
        """Refuses `dimensions` the model was not trained for (vLLM's rule)."""
        d = self.dimensions
        if d is None or d == hidden_size:
            return
        allowed = pooler.matryoshka_dimensions
        if allowed is False:
            raise InvalidRequestError("this model does not support matryoshka representation: changing the "
                                      "output dimensions would give poor embeddings", param="dimensions")
        if d > hidden_size or (allowed is not True and d not in allowed):
            sizes = f"1 to {hidden_size}" if allowed is True else ", ".join(map(str, allowed))
            raise InvalidRequestError(f"dimensions must be one of the model's sizes ({sizes}), got {d}",
                                      param="dimensions")
