"""The Lark grammar of forced MiniMax-M2 calls (tool_grammar.py), from each tool's parameter schema.

One `<minimax:tool_call>` block holds the calls, each `<invoke name="NAME">\\n` with one
`<parameter name="P">V</parameter>\\n` per parameter and `</invoke>`, as MiniMax-M2's chat template
writes them. The parameters come in the schema's order, the required ones always, the others
optionally; a value is what minimax_m2.py reads back as the parameter's type (qwen3_coder_grammar.py
`value_rules`). The block's markers are written as special tokens where the tokenizer has them so.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from infire_jax.errors import InvalidRequestError
from infire_jax.structured.tool_formats.minimax_m2 import CLOSE, OPEN
from infire_jax.structured.tool_formats.qwen3_coder_grammar import value_rules

MARKERS = (OPEN, CLOSE)


def _name(name: str, what: str) -> str:
    if not re.fullmatch(r'[^"\n]+', name) or name.strip() != name:
        raise InvalidRequestError(f"{what} {name!r} cannot be written in the minimax_m2 format (no '\"', newline or "
                                  "outer spaces)", "tools")
    return name


def minimax_m2_calls(functions: list[dict[str, Any]], parallel: bool, mark: Callable[[str], str]) -> str:
    """Lark rules: one block of one call (or, `parallel`, one or more) of the given functions."""
    lines, invokes = [], []
    for i, function in enumerate(functions):
        parameters = function.get("parameters") or {}
        required = set(parameters.get("required", []))
        params = []
        for j, (name, schema) in enumerate((parameters.get("properties") or {}).items()):
            rule = f"v{i}_{j}"
            lines += value_rules(schema if isinstance(schema, dict) else {}, rule, json.dumps("</parameter>\n"))
            head = json.dumps(f'<parameter name="{_name(name, "parameter name")}">', ensure_ascii=False)
            params.append(f"({head} {rule})" + ("" if name in required else "?"))
        head = json.dumps(f'<invoke name="{_name(function["name"], "function name")}">\n', ensure_ascii=False)
        invokes.append(f"invoke{i}")
        lines.append(f"invoke{i}: {head} {' '.join(params)} \"</invoke>\"")
    more = ' ("\\n" invoke)*' if parallel else ""
    return (f'start: {mark(OPEN)} "\\n" invoke{more} "\\n" {mark(CLOSE)}\n'
            f"invoke: {' | '.join(invokes)}\n" + "\n".join(lines) + "\n")
