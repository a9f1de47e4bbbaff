"""Qwen3-Coder's XML-like calls (`qwen3_coder`):

    <tool_call>
    <function=NAME>
    <parameter=P>
    value
    </parameter>
    ...
    </function>
    </tool_call>

A parameter's value is raw text, not JSON: `42` may be the number or the string "42". The tool's JSON
schema decides, which is why this format needs the request's `tools`. Without a schema for the
parameter the text is tried as JSON, and kept as a string when it is not.
"""

from __future__ import annotations

import re
from typing import Any

import jsonschema

from infire_jax.errors import InvalidRequestError
from infire_jax.structured.schema_refs import inlined
from infire_jax.structured.tool_formats.base import JSON_DECODER, Block, Format, ToolCall, closed_block, dumps
from infire_jax.structured.tool_formats.json_calls import HERMES_CLOSE, HERMES_OPEN

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)
_NOT_JSON = object()


def _json(text: str) -> Any:
    """`text` as JSON, or _NOT_JSON."""
    try:
        return JSON_DECODER.decode(text)
    except ValueError:
        return _NOT_JSON


def _as_type(text: str, kind: str) -> Any:
    """`text` as a value of JSON-schema type `kind`, or _NOT_JSON when it is not one."""
    s = text.strip()
    if kind == "string":
        return text
    if kind == "boolean":
        return {"true": True, "false": False}.get(s.lower(), _NOT_JSON)
    if kind == "null":
        return None if s.lower() in ("null", "none") else _NOT_JSON
    value = _json(s)
    if kind == "integer" and isinstance(value, float) and value.is_integer():
        return int(value)
    ok = {"integer": (int,), "number": (int, float), "object": (dict,), "array": (list,)}.get(kind, ())
    return value if isinstance(value, ok) and not isinstance(value, bool) else _NOT_JSON


def schema_types(schema: dict[str, Any]) -> list[str]:
    """The JSON types a parameter schema allows, in the order written (`type`, or `anyOf`/`oneOf`)."""
    return [kind for kind, _ in _branches(schema)]


def non_string_schema(schema: dict[str, Any]) -> dict[str, Any] | None:
    """What a parameter schema that allows strings allows besides them (None: nothing): its `type`
    without "string", or its union's branches without their strings (a branch with no type kept)."""
    kind = schema.get("type")
    if isinstance(kind, (str, list)):
        rest = [k for k in ([kind] if isinstance(kind, str) else kind) if k != "string"]
        return {**schema, "type": rest} if rest else None
    union = "anyOf" if "anyOf" in schema else "oneOf" if "oneOf" in schema else None
    if union is None or not isinstance(schema[union], list):
        return None
    rest = [r for sub in schema[union] if isinstance(sub, dict)
            for r in [non_string_schema(sub) if schema_types(sub) else sub] if r is not None]
    return {**schema, union: rest} if rest else None


def _branches(schema: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Each JSON type a parameter schema allows, in the order written, with the (sub)schema that
    allows it."""
    kind = schema.get("type")
    if isinstance(kind, str):
        return [(kind, schema)]
    if isinstance(kind, list):
        return [(k, schema) for k in kind if isinstance(k, str)]
    return [b for sub in schema.get("anyOf", schema.get("oneOf", [])) if isinstance(sub, dict)
            for b in _branches(sub)]


def _valid(value: Any, schema: dict[str, Any]) -> bool:
    """Whether `value` satisfies `schema`. A schema the validator cannot apply (an unresolvable `$ref`, a
    bound of the wrong type: an unforced call's tools are not compiled first) counts as satisfied."""
    try:
        return jsonschema.Draft202012Validator(schema).is_valid(value)
    except Exception:  # noqa: BLE001 - the validator raises many kinds for malformed schemas
        return True


def typed_value(text: str, schema: dict[str, Any] | None) -> Any:
    """A parameter's raw text as the value its schema asks for. Non-string types are tried first, each
    kept only where the value satisfies its branch of the schema, so `["string", "null"]` reads `null`
    as null while an `anyOf` of an integer of at least 10 and a string reads `5` as "5". Text that fits
    no branch stays a string where strings are allowed, else becomes the first type it converts to;
    a schema with no type at all reads it as JSON where it is JSON."""
    branches = _branches(schema or {})
    converted = [(value, sub) for kind, sub in branches if kind != "string"
                 for value in [_as_type(text, kind)] if value is not _NOT_JSON]
    for value, sub in converted:
        if _valid(value, sub):
            return value
    if any(kind == "string" for kind, _ in branches) or (branches and not converted):
        return text
    if converted:
        return converted[0][0]
    value = _json(text.strip())
    return text if value is _NOT_JSON else value


def tool_properties(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """The parameter schemas of tool `name` (OpenAI's `{"type": "function", "function": {...}}`)."""
    for tool in tools:
        function = tool.get("function", tool)
        if function.get("name") == name:
            parameters = function.get("parameters") or {}
            try:  # as the forced grammar wrote them (tool_grammar.py)
                parameters = inlined(parameters, name)
            except InvalidRequestError:
                pass  # recursive: such a parameter is read as JSON where it is JSON
            return parameters.get("properties") or {}
    return {}


class Qwen3Coder(Format):
    markers = (HERMES_OPEN,)

    def block(self, text: str, start: int, final: bool) -> Block | None:
        return closed_block(text, start, HERMES_OPEN, HERMES_CLOSE, final, self.parse, self._closed)

    def _closed(self, body: str) -> list[ToolCall] | None:
        """A body a `</tool_call>` ended: whole only with its `</function>` (else the marker is part of a
        parameter's raw text, and the call ends at a later one)."""
        return self.parse(body) if body.rstrip().endswith("</function>") else None

    def parse(self, body: str) -> list[ToolCall] | None:
        """One `<function=…>` with its `<parameter=…>` elements; any other text in it means no call."""
        function = _FUNCTION.fullmatch(body.rstrip())
        if function is None or not function.group(1).strip():
            return None
        name, inner = function.group(1).strip(), function.group(2)
        properties = tool_properties(self.tools, name)
        args, at = {}, 0
        for p in _PARAMETER.finditer(inner):
            if inner[at:p.start()].strip():
                return None
            raw = p.group(2).removeprefix("\n").removesuffix("\n")  # the newlines the format puts around it
            args[p.group(1).strip()] = typed_value(raw, properties.get(p.group(1).strip()))
            at = p.end()
        if inner[at:].strip():
            return None
        return [ToolCall(name, dumps(args))]
