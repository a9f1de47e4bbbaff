"""What a request asks its output to match: a JSON schema, any JSON object, a regex, a choice, or a grammar.

vLLM's `structured_outputs` (json, regex, choice, grammar, json_object); exactly one is set. The
checks here are the ones that need no grammar engine (types, one kind at a time); whether the
schema, regex or grammar compiles is the backend's check (backend.py). `param` names the API field
the constraint came from, so an error that only compiling finds still names what the client sent.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from infire_jax.errors import InvalidRequestError

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclasses.dataclass(frozen=True, eq=False)
class StructuredOutputs:
    """One output constraint. `json` may be a schema object or its JSON text; `grammar` is Lark (llguidance's EBNF)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    param: str = "structured_outputs"  # the request field errors name (plus ".<kind>" below it)
    # What the output holds before the constraint applies: a Lark grammar whose `start` rule ends in
    # `@answer`, the constraint (a reasoning block, `reasoning_parsers.reasoning_grammar`). None: from the start.
    after: str | None = None
    # A JSON constraint's layout, over the backend's (llguidance's item_separator, key_separator,
    # whitespace_flexible, whitespace_pattern): vLLM's disable_any_whitespace and whitespace_pattern.
    json_layout: dict[str, Any] | None = None

    def __post_init__(self):
        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise InvalidRequestError(
                f"structured outputs need exactly one of {', '.join(KINDS)}; got {set_kinds or 'none'}", self.param)
        if not isinstance(self.json_object, bool):
            raise InvalidRequestError("'json_object' must be a boolean", self.field_param)
        if isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", json.loads(self.json))
            except ValueError as e:
                raise InvalidRequestError(f"the JSON schema is not valid JSON: {e}", self.field_param) from e
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise InvalidRequestError("a JSON schema must be an object", self.field_param)
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise InvalidRequestError(f"'{name}' must be a non-empty string", self.field_param)
        if self.choice is not None:
            if not (isinstance(self.choice, list) and self.choice
                    and all(isinstance(c, str) and c for c in self.choice)):
                raise InvalidRequestError("'choice' must be a non-empty array of non-empty strings", self.field_param)
            object.__setattr__(self, "choice", list(self.choice))

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def field_param(self) -> str:
        """The API field of the constraint itself, e.g. `structured_outputs.regex`."""
        return self.param if self.param != "structured_outputs" else f"structured_outputs.{self.kind}"

    def key(self) -> tuple[str, str]:
        """Equal constraints share one compiled grammar (backend cache), whatever field they came in."""
        value: Any = getattr(self, self.kind)
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        if self.json_layout is not None:
            text = f"{json.dumps(self.json_layout, sort_keys=True)}\0{text}"
        return self.kind, text if self.after is None else f"{self.after}\0{text}"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StructuredOutputs) and self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())
