"""The Lark grammar of forced Gemma 4 calls (tool_grammar.py), from each tool's parameter schema.

A call is `<|tool_call>call:NAME{k:v,...}<tool_call|>`, as Gemma 4's chat template writes one: the
arguments in the template's order (its `dictsort`: by name, case aside), the required ones always,
the others optionally. A value is what gemma4.py reads back as its schema's type: a string between
`<|"|>` delimiters (within its length and pattern bounds), a number as JSON writes it, `true`/`false`,
`null`, an array `[v,...]` of the item schema, an object `{k:v,...}` of its declared properties, a
constant as the template would write it, a union as any branch, and any value where the schema says
nothing. Markers and the delimiter that are special tokens of the tokenizer are written as those
tokens (`mark`); a string then ends at the delimiter token, else at the delimiter's first text.
The value rules are pythonic_grammar's, in this syntax.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from infire_jax.errors import InvalidRequestError
from infire_jax.structured.tool_formats.gemma4 import STRING_DELIM, TOOL_CALL, TOOL_CALL_END
from infire_jax.structured.tool_formats.pythonic_grammar import _Rules, sequence
from infire_jax.structured.tool_formats.qwen3_coder_grammar import pattern_regex

MARKERS = (TOOL_CALL, TOOL_CALL_END, STRING_DELIM)
_SEP = '","'
_BARE_KEY = re.compile(r"[A-Za-z_]\w*")
_NAME = re.compile(r"[\w\-.]+")


def _ordered(names) -> list[str]:
    """The template's `dictsort` order: by name, case-insensitively."""
    return sorted(names, key=lambda n: (n.lower(), n))


class _GemmaRules(_Rules):
    """Value rules in Gemma 4's syntax; `mark(marker)` is a marker as a Lark expression, `special`
    whether the string delimiter is one token."""
    sep = _SEP
    constants = {"boolean": '"true" | "false"', "null": '"null"'}

    def __init__(self, mark: Callable[[str], str], special: bool):
        super().__init__()
        self.mark, self.special = mark, special
        self.delim = mark(STRING_DELIM)
        self.any_rule = "g_any"
        self.any_lines = self._any_lines()

    def _any_lines(self) -> list[str]:
        d = self.delim
        text = ["G_TEXT: /(?s:.*)/"] if self.special else \
            [f"G_STR: /(?s:.*)/ {json.dumps(STRING_DELIM)}", "g_str_rest[lazy]: G_STR"]
        string = f"{d} G_TEXT {d}" if self.special else f"{d} g_str_rest"
        return [*text, f"g_str: {string}",
                "G_KEY: /[A-Za-z_][A-Za-z0-9_]*/",
                f'g_any: g_str | %json {{"type": "number"}} | "true" | "false" | "null" '
                f'| "[" (g_any ({_SEP} g_any)*)? "]" | "{{" (G_KEY ":" g_any ({_SEP} G_KEY ":" g_any)*)? "}}"']

    def key(self, name: str) -> str:
        """`name:` as a Lark expression: bare where it is a word, else delimited."""
        if _BARE_KEY.fullmatch(name):
            return json.dumps(name + ":")
        if STRING_DELIM in name:
            raise InvalidRequestError(f"parameter name {name!r} cannot be written in the gemma4 format", "tools")
        return f'{self.delim} {json.dumps(name, ensure_ascii=False)} {self.delim} ":"'

    def choice(self, value: Any) -> str:
        if isinstance(value, str):
            if STRING_DELIM in value:
                raise InvalidRequestError(f"the value {value!r} cannot be written in the gemma4 format", "tools")
            return f"({self.delim} {json.dumps(value, ensure_ascii=False)} {self.delim})"
        if isinstance(value, bool) or value is None:
            return json.dumps(json.dumps(value))
        if isinstance(value, (int, float)):
            return json.dumps(json.dumps(value))
        if isinstance(value, list):
            return '("[" ' + f" {_SEP} ".join(self.choice(v) for v in value) + ' "]")' if value else '"[]"'
        parts = [f"{self.key(k)} {self.choice(value[k])}" for k in _ordered(value)]
        return '("{" ' + f" {_SEP} ".join(parts) + ' "}")' if parts else '"{}"'

    def _typed(self, kind: str, schema: dict[str, Any], rule: str) -> str:
        if kind == "string":
            return self._string(schema, rule)
        if kind == "object":
            properties = schema.get("properties") or {}
            members = [(n, self.key(n), self.value(properties[n])) for n in _ordered(properties)]
            return '"{" ' + sequence(members, set(schema.get("required", [])), _SEP) + ' "}"'
        return super()._typed(kind, schema, rule)  # numbers and arrays in JSON's syntax, which is Gemma's

    def _string(self, schema: dict[str, Any], rule: str) -> str:
        """Between delimiters, within its bounds; a textual delimiter ends it at its first occurrence."""
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        parts = [f"/(?s:.{{{low},{'' if high is None else high}}})/"]
        if "pattern" in schema:
            parts.append(pattern_regex(schema["pattern"]))
        text = f"{rule.upper()}_TEXT"
        self.lines.append(f"{text}: {' & '.join(parts)}")
        if self.special:
            return f"{self.delim} {text} {self.delim}"
        lexeme = f"{rule.upper()}_STR"
        self.lines += [f"{lexeme}: {text} {json.dumps(STRING_DELIM)}", f"{rule}_str[lazy]: {lexeme}"]
        return f"{self.delim} {rule}_str"


def gemma4_calls(functions: list[dict[str, Any]], parallel: bool, mark: Callable[[str], str],
                 special: Callable[[str], bool]) -> str:
    """The Lark grammar of one call to one of `functions` (or, `parallel`, several one after another).
    `mark(marker)`: the marker in Lark; `special(marker)`: whether it is one special token."""
    rules, calls = _GemmaRules(mark, special(STRING_DELIM)), []
    for i, f in enumerate(functions):
        if not _NAME.fullmatch(f["name"]):
            raise InvalidRequestError(f"function name {f['name']!r} cannot be written in the gemma4 format "
                                      "(letters, digits, '_', '-' and '.')", "tools")
        parameters = f.get("parameters") or {}
        properties = parameters.get("properties") or {}
        args = [(n, rules.key(n), rules.value(properties[n])) for n in _ordered(properties)]
        body = sequence(args, set(parameters.get("required", [])), _SEP)
        calls.append(f"call{i}: {mark(TOOL_CALL)} {json.dumps('call:' + f['name'] + '{')} {body} "
                     f'"}}" {mark(TOOL_CALL_END)}')
    more = " call*" if parallel else ""
    return "\n".join([f"start: call{more}", "call: " + " | ".join(f"call{i}" for i in range(len(functions))),
                      *calls, *rules.lines, *(rules.any_lines if rules.uses_any else [])]) + "\n"
