"""The Lark grammar of forced GLM-4.5 calls (tool_grammar.py), from each tool's parameter schema.

A call is `<tool_call>NAME\\n`, one `<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n` per
parameter, then `</tool_call>`, as GLM's chat template writes them. The parameters come in the
schema's order, the required ones always, the others optionally; a value is what glm45.py reads back
as the parameter's type (qwen3_coder_grammar.py `value_rules`). Markers that are special tokens of the
tokenizer are written as those tokens (`mark`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from infire_jax.errors import InvalidRequestError
from infire_jax.structured.tool_formats.glm45 import ARG_KEY, ARG_KEY_END, ARG_VALUE, ARG_VALUE_END
from infire_jax.structured.tool_formats.json_calls import HERMES_CLOSE, HERMES_OPEN
from infire_jax.structured.tool_formats.qwen3_coder_grammar import value_rules

MARKERS = (HERMES_OPEN, HERMES_CLOSE, ARG_KEY, ARG_KEY_END, ARG_VALUE, ARG_VALUE_END)


def glm45_call(function: dict[str, Any], index: int, mark: Callable[[str], str],
               special: Callable[[str], bool]) -> list[str]:
    """Lark lines defining `call{index}`: one call of `function`. `mark(marker)` is the marker as a Lark
    expression; `special(marker)`: whether it is one special token."""
    parameters = function.get("parameters") or {}
    required = set(parameters.get("required", []))
    close = f'{mark(ARG_VALUE_END)} "\\n"'
    lines, params = [], []
    for j, (name, schema) in enumerate((parameters.get("properties") or {}).items()):
        if not re.fullmatch(r"[^<\n]+", name) or name.strip() != name:
            raise InvalidRequestError(f"parameter name {name!r} of function {function['name']!r} cannot be "
                                      "written in the glm45 format (no '<', newline or outer spaces)", "tools")
        rule = f"v{index}_{j}"
        lines += value_rules(schema if isinstance(schema, dict) else {}, rule, close,
                             text_close=not special(ARG_VALUE_END))
        key = f'{mark(ARG_KEY)} {json.dumps(name, ensure_ascii=False)} {mark(ARG_KEY_END)} "\\n" {mark(ARG_VALUE)}'
        params.append(f"({key} {rule})" + ("" if name in required else "?"))
    if not re.fullmatch(r"[^<\n]+", function["name"]):
        raise InvalidRequestError(f"function name {function['name']!r} cannot be written in the glm45 format",
                                  "tools")
    head = f'{mark(HERMES_OPEN)} {json.dumps(function["name"] + chr(10), ensure_ascii=False)}'
    return [f"call{index}: {head} {' '.join(params)} {mark(HERMES_CLOSE)}", *lines]
