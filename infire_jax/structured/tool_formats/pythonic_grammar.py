"""The Lark grammar of forced pythonic calls (tool_grammar.py): `[f(a=1, b='x')]`, from each tool's schema.

A call's keyword arguments come in the schema's order, the required ones always, the others
optionally; each value is a Python literal of its schema, as pythonic.py reads back with `ast`:
strings quoted (within their length and pattern bounds), integers and numbers as JSON writes them
(also Python's syntax), `True`/`False`/`None`, lists of the item schema, dicts of the declared
properties, a string enum or const as one of its values, a union as any of its branches, and any
literal where the schema says nothing.
"""

from __future__ import annotations

import json
import re
from typing import Any

from infire_jax.errors import InvalidRequestError
from infire_jax.structured.backend import inline_json
from infire_jax.structured.tool_formats.qwen3_coder import schema_types
from infire_jax.structured.tool_formats.qwen3_coder_grammar import pattern_regex

_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")
_SEP = '", "'
# A Python string literal in single quotes (what repr writes; \x, \u and \U escapes whole, no \N{...}, so
# that `ast` reads every one), and any literal at all.
_ANY = ["PY_STR: /'([^'\\\\\\n]|\\\\[^xuUN\\n]|\\\\x[0-9a-fA-F]{2}|\\\\u[0-9a-fA-F]{4}|\\\\U00(0[0-9a-fA-F]|10)[0-9a-fA-F]{4})*'/",
        "py_any: PY_STR | %json {\"type\": \"number\"} | \"True\" | \"False\" | \"None\" "
        f"| \"[\" (py_any ({_SEP} py_any)*)? \"]\" "
        f"| \"{{\" (PY_STR \": \" py_any ({_SEP} PY_STR \": \" py_any)*)? \"}}\""]


class _Rules:
    """Lark rules for the values of one set of tools, each schema its own rule. A format writing values
    in another syntax (gemma4_grammar.py) sets its separator and constants, and overrides `choice`,
    strings, objects and the any-value rule."""
    any_rule, any_lines = "py_any", _ANY
    sep = _SEP  # between an array's items and an object's members
    constants = {"boolean": '"True" | "False"', "null": '"None"'}  # the literals of these types

    def __init__(self):
        self.lines: list[str] = []
        self.uses_any = False

    def choice(self, value: Any) -> str:
        """A constant value (enum, const) as a Lark expression."""
        return json.dumps(_literal(value))

    def value(self, schema: Any) -> str:
        """The name of a rule for a value of `schema`."""
        at = len(self.lines)
        rule = f"v{at}"
        self.lines.append("")  # the rule's place (nested schemas add theirs after it)
        self.lines[at] = f"{rule}: {self._body(schema if isinstance(schema, dict) else {}, rule)}"
        return rule

    def _body(self, schema: dict[str, Any], rule: str) -> str:
        if "allOf" in schema:
            schema = _all_of(schema)
        choices = schema.get("enum", [schema["const"]] if "const" in schema else None)
        if choices is not None:
            return " | ".join(self.choice(c) for c in choices)
        branches = schema.get("anyOf", schema.get("oneOf"))
        if branches:
            return " | ".join(self.value(b) for b in branches)
        kinds = schema_types(schema)
        if not kinds:
            self.uses_any = True
            return self.any_rule
        return " | ".join(self._typed(kind, schema, rule) for kind in kinds)

    def _typed(self, kind: str, schema: dict[str, Any], rule: str) -> str:
        if kind == "string":
            return self._string(schema, rule)
        if kind in ("integer", "number"):  # JSON's numbers are Python's literals too
            bounds = {k: schema[k] for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                                             "multipleOf") if k in schema}
            return inline_json({"type": kind, **bounds})
        if kind in self.constants:
            return self.constants[kind]
        if kind == "array":
            item = self.value(schema.get("items", {}))
            low, high = schema.get("minItems", 0), schema.get("maxItems")
            if high == 0:
                return '"[" "]"'
            more = f"({self.sep} {item})"
            rest = f"{more}{{{max(low - 1, 0)},{high - 1}}}" if high is not None else \
                f"{more}{{{low - 1},{low - 1}}} {more}*" if low > 1 else f"{more}*"
            return f'"[" {item} {rest} "]"' if low else f'"[" ({item} {rest})? "]"'
        if kind == "object":
            members = [(name, json.dumps(repr(name) + ": "), self.value(sub))
                       for name, sub in (schema.get("properties") or {}).items()]
            return '"{" ' + sequence(members, set(schema.get("required", []))) + ' "}"'
        raise InvalidRequestError(f"JSON schema type {kind!r} cannot be forced in the pythonic format", "tools")

    def _string(self, schema: dict[str, Any], rule: str) -> str:
        """Single-quoted; bounded strings hold no escapes, so that their length is the text's."""
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        if high is None and "pattern" not in schema and not low:
            self.uses_any = True
            return "PY_STR"
        parts = [f"/[^'\\\\\\n]{{{low},{'' if high is None else high}}}/"]
        if "pattern" in schema:
            parts.append(pattern_regex(schema["pattern"]))
        self.lines.append(f"{rule.upper()}_TEXT: {' & '.join(parts)}")
        return f"\"'\" {rule.upper()}_TEXT \"'\""


def _all_of(schema: dict[str, Any]) -> dict[str, Any]:
    """A schema with its `allOf` merged in (Pydantic v1 wraps a described model reference in one): the
    properties and required names of every part together, any other keyword the last part's."""
    out = {k: v for k, v in schema.items() if k != "allOf"}
    for part in schema["allOf"]:
        part = _all_of(part) if isinstance(part, dict) and "allOf" in part else part
        if not isinstance(part, dict):
            continue
        merged = {**out.get("properties", {}), **part.get("properties", {})}
        required = list(dict.fromkeys([*out.get("required", []), *part.get("required", [])]))
        out |= part
        if merged:
            out["properties"] = merged
        if required:
            out["required"] = required
    return out


def _literal(value: Any) -> str:
    """A JSON value as the Python literal the parser reads back as it."""
    if isinstance(value, (bool, type(None), str)):
        return repr(value)
    if isinstance(value, (int, float)):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_literal(v) for v in value) + "]"
    return "{" + ", ".join(f"{k!r}: {_literal(v)}" for k, v in value.items()) + "}"


def sequence(items: list[tuple[str, str, str]], required: set[str], sep: str = _SEP) -> str:
    """Lark for `items` (name, head, value rule) in order, joined by `sep`: the required ones always,
    the others optionally (the separator goes before every item but the first one written)."""
    def rest(i: int) -> str:
        if i == len(items):
            return ""
        name, head, value = items[i]
        one = f"{sep} {head} {value}"
        return (f"{one} " if name in required else f"({one})? ") + rest(i + 1)

    def first(i: int) -> str:
        if i == len(items):
            return ""
        name, head, value = items[i]
        written = f"{head} {value} {rest(i + 1)}".strip()
        if name in required:
            return written
        later = first(i + 1)
        return f"({written} | {later})" if later else f"({written})?"

    return first(0)


def pythonic_calls(functions: list[dict[str, Any]], parallel: bool) -> str:
    """The Lark grammar of a list of calls to `functions` (one call unless `parallel`)."""
    rules, calls = _Rules(), []
    for i, f in enumerate(functions):
        if not _IDENTIFIER.fullmatch(f["name"]):
            raise InvalidRequestError(f"function name {f['name']!r} is not a Python identifier: it cannot be "
                                      "called in the pythonic format", "tools")
        parameters = f.get("parameters") or {}
        args = []
        for name, schema in (parameters.get("properties") or {}).items():
            if not _IDENTIFIER.fullmatch(name):
                raise InvalidRequestError(f"parameter {name!r} of function {f['name']!r} is not a Python "
                                          "identifier: it cannot be a keyword argument", "tools")
            args.append((name, json.dumps(name + "="), rules.value(schema)))
        calls.append(f"call{i}: {json.dumps(f['name'] + '(')} "
                     f"{sequence(args, set(parameters.get('required', [])))} \")\"")
    more = f" ({_SEP} call)*" if parallel else ""
    return "\n".join([f'start: "[" call{more} "]"', "call: " + " | ".join(f"call{i}" for i in range(len(functions))),
                      *calls, *rules.lines, *(_ANY if rules.uses_any else [])]) + "\n"
