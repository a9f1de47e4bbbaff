"""The Lark grammar of forced Qwen3-Coder calls (tool_grammar.py), from each tool's parameter schema.

A call is `<tool_call>\\n<function=NAME>\\n`, one `<parameter=P>\\nvalue\\n</parameter>\\n` per
parameter, then `</function>\\n</tool_call>`. The parameters come in the schema's order, the
required ones always, the others optionally. A value is what qwen3_coder.py reads back as the
parameter's type: a parameter that may be a string is raw text (its length and pattern bounds kept,
`</parameter>` never inside it), a string enum or const is one of its values, anything else is JSON
of its schema.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

from infire_jax.errors import InvalidRequestError
from infire_jax.structured.backend import inline_json
from infire_jax.structured.tool_formats.qwen3_coder import non_string_schema, schema_types

_CLOSE = "\n</parameter>\n"


def _string_terminal(schema: dict[str, Any]) -> str:
    """A raw string value: its lengths and its pattern (a search, as JSON Schema's)."""
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    parts = [f"/(?s:.{{{low},{'' if high is None else high}}})/"]
    if "pattern" in schema:
        parts.append(pattern_regex(schema["pattern"]))
    return " & ".join(parts)


def pattern_regex(pattern: str) -> str:
    """A JSON-schema `pattern` as a Lark regex matching whole strings: a search unless anchored
    (llguidance's regexes take no anchors)."""
    head = "" if pattern.startswith("^") else "(?s:.*)"
    tail = "" if pattern.endswith("$") and not pattern.endswith("\\$") else "(?s:.*)"
    body = pattern.removeprefix("^")[:len(pattern) - (not head) - (not tail)]
    return f"/{head}(?:{body}){tail}/"


def value_rules(schema: dict[str, Any], rule: str, close: str = json.dumps(_CLOSE), text_close: bool = True
                ) -> list[str]:
    """Lark lines defining `rule` as a parameter's value and the close marker after it (`close`, a Lark
    expression). A raw string is one lazy lexeme with a textual close marker (`text_close`), so it ends
    at the first marker and never holds one; a close marker that is a special token ends the string's
    lexeme by itself (no text is that token)."""
    choices = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if choices is not None and all(isinstance(c, str) for c in choices):
        return [f"{rule}: (" + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices) + f") {close}"]
    if "string" in schema_types(schema):
        # the bounds of the string branch of a union (`anyOf`/`oneOf`), else of the schema itself
        branches = [schema, *schema.get("anyOf", schema.get("oneOf", []))]
        string = next((s for s in branches if isinstance(s, dict) and "string" in schema_types(s)
                       and "anyOf" not in s and "oneOf" not in s), schema)
        text = f"{rule.upper()}_TEXT"
        others = non_string_schema(schema)  # a union's other branches: their JSON, beside the raw text
        json_alt = [] if others is None else [f"{rule}_json: {inline_json(others)} {close}"]
        raw = rule if others is None else f"{rule}_raw"
        alternatives = [] if others is None else [f"{rule}: {raw} | {rule}_json"]
        if not text_close:
            return [f"{text}: {_string_terminal(string)}", f"{raw}: {text} {close}", *json_alt, *alternatives]
        return [f"{text}: {_string_terminal(string)}", f"{raw.upper()}: {text} {close}",
                f"{raw}[lazy]: {raw.upper()}", *json_alt, *alternatives]
    return [f"{rule}: {inline_json(schema)} {close}"]


def qwen3_coder_call(function: dict[str, Any], index: int, mark: Callable[[str], str]) -> list[str]:
    """Lark lines defining `call{index}`: one call of `function`. `mark`: <tool_call> and </tool_call>
    in Lark, as their text or, where the tokenizer added them whole (Qwen3's), as those tokens."""
    parameters = function.get("parameters") or {}
    required = set(parameters.get("required", []))
    lines, params = [], []
    for j, (name, schema) in enumerate((parameters.get("properties") or {}).items()):
        if not re.fullmatch(r"[^>\n]+", name):
            raise InvalidRequestError(f"parameter name {name!r} of function {function['name']!r} cannot be "
                                      "written in the qwen3_coder format (no '>' or newline)", "tools")
        rule = f"v{index}_{j}"
        lines += value_rules(schema if isinstance(schema, dict) else {}, rule)
        head = json.dumps(f"<parameter={name}>\n", ensure_ascii=False)
        params.append(f"({head} {rule})" + ("" if name in required else "?"))
    head = json.dumps(f"\n<function={function['name']}>\n", ensure_ascii=False)
    return [f"call{index}: {mark('<tool_call>')} {head} {' '.join(params)} \"</function>\\n\" {mark('</tool_call>')}",
            *lines]
