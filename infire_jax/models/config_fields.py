"""An HF config's fields as a family's parser reads them: each value checked, and a bad one, or a field
the parser does not know, refused naming it, so an unusual checkpoint fails at load rather than giving
wrong tokens. The parsers of models/*_config.py that check every field share it."""

from __future__ import annotations

from typing import Any, Mapping

from infire_jax.errors import UnsupportedModelError


class Fields:
    """The fields of `c`, one family's (`family` names it in every refusal)."""

    def __init__(self, family: str, c: Mapping[str, Any]):
        self.family, self.c = family, c

    def bad(self, field: str, value: Any, why: str) -> UnsupportedModelError:
        return UnsupportedModelError(f"{self.family} config field {field}={value!r}: {why}")

    def only_known(self, known: set[str], what: str) -> None:
        """Refuses the first field that is not in `known`."""
        unknown = sorted(set(self.c) - known)
        if unknown:
            raise self.bad(unknown[0], self.c[unknown[0]], f"not a field of {what}")

    def int(self, field: str, default: Any, lo: int = 1) -> int:
        value = self.c.get(field, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            raise self.bad(field, value, f"must be an integer >= {lo}")
        return value

    def number(self, field: str, default: float) -> float:
        value = self.c.get(field, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise self.bad(field, value, "must be a positive number")
        return float(value)

    def language_model(self, known: set[str], text_type: str) -> dict[str, Any]:
        """A multimodal config's language model: its `text_config` (typed `text_type`), with the wrapper's
        eos / bos ids (generation reads those; published files may keep them there only) and tying
        (transformers 5 ties by it) where the wrapper has them; a wrapper field not in `known` is refused."""
        self.only_known(known, f"a {self.family} config")
        text = self.c.get("text_config")
        if not isinstance(text, Mapping):
            raise self.bad("text_config", text, f"a {self.c.get('model_type')} config needs its language model's config")
        outer = {k: self.c[k] for k in ("eos_token_id", "bos_token_id", "tie_word_embeddings") if k in self.c}
        return {**text, **outer, "model_type": text_type}

    def of(self, c: Mapping[str, Any]) -> "Fields":
        """The same family's reader of another mapping (a nested `rope_parameters`)."""
        return Fields(self.family, c)
