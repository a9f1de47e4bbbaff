"""`speculative_config`, with vLLM's names: which proposer, how many tokens, and when to stop."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from infire_jax.errors import ConfigError

METHODS = ("ngram", "draft_model", "eagle3", "mtp")
# vLLM's older names of mtp, per family.
ALIASES = {"deepseek_mtp": "mtp", "glm4_moe_mtp": "mtp", "qwen3_next_mtp": "mtp", "qwen3_5_mtp": "mtp"}


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine speculates. Every request of the engine may speculate (as in vLLM)."""

    method: str
    num_speculative_tokens: int
    # draft_model: a model this engine can load; eagle3: the head's directory; mtp: none (the target's checkpoint)
    model: str | None = None
    prompt_lookup_min: int = 2  # ngram: shortest suffix matched against the request's earlier tokens
    prompt_lookup_max: int = 5  # ngram: longest
    # Speculation is turned off while more sequences than this run (decode is then compute-bound,
    # and verifying k extra tokens per row costs more than it saves). None: the engine's default.
    disable_by_batch_size: int | None = None
    # A sequence whose accepted fraction of proposed tokens falls below this backs off for a while.
    acceptance_threshold: float = 0.25

    def __post_init__(self):
        def bad(field: str, msg: str):
            raise ConfigError(f"speculative_config.{field}: {msg}")

        if isinstance(self.method, str):
            object.__setattr__(self, "method", ALIASES.get(self.method, self.method))
        if self.method not in METHODS:
            bad("method", f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            bad("num_speculative_tokens", f"must be an integer in [1, 16], got {k!r}")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
                bad("prompt_lookup_min", f"needs 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo!r}, {hi!r}")
        elif self.method != "mtp" and not self.model:
            bad("model", f"method {self.method!r} needs a model")
        if self.disable_by_batch_size is not None and (
                not isinstance(self.disable_by_batch_size, int) or self.disable_by_batch_size < 1):
            bad("disable_by_batch_size", f"must be a positive integer, got {self.disable_by_batch_size!r}")
        if not 0.0 <= self.acceptance_threshold < 1.0:
            bad("acceptance_threshold", f"must be in [0, 1), got {self.acceptance_threshold!r}")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """From a config, a dict, or a JSON object string (`--speculative-config`)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"speculative_config is not valid JSON: {e}") from e
        if not isinstance(value, dict):
            raise ConfigError("speculative_config must be a JSON object")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ConfigError(f"speculative_config: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        if isinstance(value.get("model"), str):  # a speculators head names its own method and draft count
            value = {**(speculators_defaults(value["model"]) or {}), **value}
        for field in ("method", "num_speculative_tokens"):
            if field not in value:
                raise ConfigError(f"speculative_config.{field} is required")
        return cls(**value)


def speculators_defaults(path: str) -> dict[str, Any] | None:
    """vLLM's defaults from a speculators head directory: its method and, from its default proposal method,
    num_speculative_tokens (None: not a speculators head)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or "speculators_model_type" not in raw:
        return None
    sc = raw.get("speculators_config") if isinstance(raw.get("speculators_config"), dict) else {}
    methods = {m.get("proposal_type"): m for m in sc.get("proposal_methods") or [] if isinstance(m, dict)}
    chosen = methods.get(sc.get("default_proposal_method")) or next(iter(methods.values()), {})
    out = {"method": sc.get("algorithm") or raw["speculators_model_type"]}
    if isinstance(chosen.get("speculative_tokens"), int):
        out["num_speculative_tokens"] = chosen["speculative_tokens"]
    return out
