"""A grammar that forces tool calls: `tool_choice` "required" or a named function, in the model's format.

Each call is one JSON object whose `name` is a constant and whose arguments follow that tool's
parameter schema, so a forced call is well formed and its arguments validate, whatever the model.
"""

from __future__ import annotations

import json
from typing import Any

from infire_jax.structured.spec import StructuredOutputs
from infire_jax.structured.tool_parsers import HERMES, HERMES_CLOSE, HERMES_OPEN, LLAMA3_JSON, MISTRAL, MISTRAL_MARKER

# The same JSON layout as response_format's (backend._JSON_OPTIONS), given inside each schema.
_X_GUIDANCE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
NEWLINE = "\n"
# The formats a forced call is written in (the others' grammars are not written yet).
FORCEABLE_FORMATS = (HERMES, LLAMA3_JSON, MISTRAL)


def _call_schema(fmt: str, function: dict[str, Any]) -> dict[str, Any]:
    args_key = "parameters" if fmt == LLAMA3_JSON else "arguments"
    return {"type": "object", "properties": {"name": {"const": function["name"]},
                                             args_key: function.get("parameters") or EMPTY_PARAMETERS},
            "required": ["name", args_key], "additionalProperties": False}


def _json(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps(schema | {"x-guidance": _X_GUIDANCE})


def _more(separator: str) -> str:
    """Lark: further calls, each after `separator`."""
    return f" ({json.dumps(separator)} call)*"


def tool_call_constraint(fmt: str, functions: list[dict[str, Any]], *, parallel: bool,
                         special_token_id: int | None = None) -> StructuredOutputs:
    """Calls to the given functions only (one, or one or more when `parallel`), in format `fmt`.

    `special_token_id`: Mistral's `[TOOL_CALLS]` when the tokenizer has it as one token."""
    if fmt not in FORCEABLE_FORMATS:
        raise ValueError(f"no forced-call grammar for the {fmt} format; forced calls exist for {FORCEABLE_FORMATS}")
    one = {"anyOf": [_call_schema(fmt, f) for f in functions]} if len(functions) > 1 else _call_schema(fmt, functions[0])
    if fmt == HERMES:
        call = f"{json.dumps(HERMES_OPEN + NEWLINE)} {_json(one)} {json.dumps(NEWLINE + HERMES_CLOSE)}"
        rules = f"start: call{_more(NEWLINE) if parallel else ''}\ncall: {call}\n"
    elif fmt == LLAMA3_JSON:
        rules = f"start: call{_more('; ') if parallel else ''}\ncall: {_json(one)}\n"
    else:  # MISTRAL
        marker = f"<[{special_token_id}]>" if special_token_id is not None else json.dumps(MISTRAL_MARKER)
        array = {"type": "array", "items": one, "minItems": 1} | ({} if parallel else {"maxItems": 1})
        rules = f"start: {marker} {_json(array)}\n"
    return StructuredOutputs(grammar=rules, param="tool_choice")
