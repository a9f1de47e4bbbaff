"""Validation of the structured-output and tool fields of a request: `response_format`, vLLM's
`structured_outputs` (and its older `guided_*` fields), `tools`, `tool_choice`, and the tool parts of messages.

Only shapes and types are checked here, each error naming its field; whether a schema, regex or
grammar compiles is the grammar backend's check (infire_jax/structured/backend.py), run by the
handler before the request is queued.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from infire_jax.errors import InvalidRequestError
from infire_jax.structured import StructuredOutputs
from server.errors import APIError

_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule for function and schema names
NONE, AUTO, REQUIRED = "none", "auto", "required"


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param)


def _object(v: Any, param: str, allowed: set[str], required: tuple[str, ...] = ()) -> dict:
    if not isinstance(v, dict):
        raise _bad(f"'{param}' must be an object", param)
    for k in sorted(v):
        if k not in allowed:
            raise _bad(f"Unrecognized field: {param}.{k}", f"{param}.{k}")
    for k in required:
        if v.get(k) is None:
            raise _bad(f"Missing required field: {param}.{k}", f"{param}.{k}")
    return v


def _spec(param: str, **kwargs) -> StructuredOutputs:
    try:
        return StructuredOutputs(param=param, **kwargs)
    except InvalidRequestError as e:
        raise _bad(str(e), e.param) from e


def response_format(raw: Any) -> StructuredOutputs | None:
    """OpenAI's `response_format`: text (no constraint), json_object, or json_schema."""
    if raw is None:
        return None
    v = _object(raw, "response_format", {"type", "json_schema"}, ("type",))
    kind = v["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return _spec("response_format", json_object=True)
    if kind != "json_schema":
        raise _bad(f"Invalid value for 'response_format.type': expected one of text, json_object, json_schema; "
                   f"got {kind!r}", "response_format.type")
    js = _object(v.get("json_schema"), "response_format.json_schema", {"name", "description", "schema", "strict"},
                 ("name", "schema"))
    if not isinstance(js["name"], str) or not _NAME.match(js["name"]):
        raise _bad("'response_format.json_schema.name' must be 1 to 64 letters, digits, '_', '.' or '-'",
                   "response_format.json_schema.name")
    if js.get("strict") is not None and not isinstance(js["strict"], bool):
        raise _bad("'response_format.json_schema.strict' must be a boolean", "response_format.json_schema.strict")
    if not isinstance(js["schema"], dict):
        raise _bad("'response_format.json_schema.schema' must be a JSON schema object",
                   "response_format.json_schema.schema")
    return _spec("response_format.json_schema.schema", json=js["schema"])


def structured_outputs(raw: Any) -> StructuredOutputs | None:
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar (Lark), json_object; and
    its options for a JSON one (`_json_options`)."""
    if raw is None:
        return None
    v = _object(raw, "structured_outputs", {*_STRUCTURED_KEYS, *_OPTIONS})
    if v.get("structural_tag") is not None:
        raise _bad("'structured_outputs.structural_tag' is not supported", "structured_outputs.structural_tag")
    kinds = {k: v[k] for k in _STRUCTURED_KEYS if v.get(k) is not None}
    layout, closed = _json_options(v)
    if closed and kinds.get("json") is not None:
        schema = _spec("structured_outputs", json=kinds["json"]).json  # a schema's JSON text parsed
        kinds["json"] = _closed(schema) if isinstance(schema, dict) else schema
    return _spec("structured_outputs", json_layout=layout, **kinds)


# vLLM's StructuredOutputsParams options: its fallback from one grammar engine to another has no
# counterpart here (one engine, llguidance), so disable_fallback changes nothing.
_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "disable_fallback", "whitespace_pattern",
            "structural_tag")


def _json_options(v: dict) -> tuple[dict[str, Any] | None, bool]:
    """(the JSON layout over the default one, whether objects are closed): disable_any_whitespace, no
    whitespace at all (',' and ':'); whitespace_pattern, the whitespace allowed between JSON tokens;
    disable_additional_properties, no property an object's schema does not name."""
    for name in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
        if v.get(name) is not None and not isinstance(v[name], bool):
            raise _bad(f"'structured_outputs.{name}' must be a boolean", f"structured_outputs.{name}")
    pattern = v.get("whitespace_pattern")
    if pattern is not None and (not isinstance(pattern, str) or not pattern):
        raise _bad("'structured_outputs.whitespace_pattern' must be a non-empty regex",
                   "structured_outputs.whitespace_pattern")
    if pattern is not None and v.get("disable_any_whitespace"):
        raise _bad("give 'whitespace_pattern' or 'disable_any_whitespace', not both",
                   "structured_outputs.whitespace_pattern")
    layout = None
    if v.get("disable_any_whitespace"):
        layout = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
    elif pattern is not None:
        layout = {"whitespace_flexible": True, "whitespace_pattern": pattern, "item_separator": ",",
                  "key_separator": ":"}
    return layout, bool(v.get("disable_additional_properties"))


# Where a JSON schema holds schemas: by name, in a list, or one.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")


def _closed(schema: Any) -> Any:
    """The schema with additionalProperties false on every object schema that does not set it."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            out[key] = {name: _closed(s) for name, s in schema[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            out[key] = [_closed(s) for s in schema[key]]
    for key in _SCHEMA_ONE:
        if key in schema:
            out[key] = _closed(schema[key])
    if (schema.get("type") == "object" or "properties" in schema) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


# vLLM's older request fields for the same constraints (deprecated there, still sent by many clients),
# by the `structured_outputs` key each stands for.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# ... and the two that choose how: a backend (one constrains every output here, so any name is the
# same output) and a whitespace pattern (structured_outputs' whitespace_pattern).
GUIDED_FIELDS = (*_GUIDED, "guided_decoding_backend", "guided_whitespace_pattern")


def guided(data: dict[str, Any]) -> StructuredOutputs | None:
    """vLLM's `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`: at most one; None: none."""
    backend = data.get("guided_decoding_backend")
    if backend is not None and not isinstance(backend, str):
        raise _bad("'guided_decoding_backend' must be a string", "guided_decoding_backend")
    pattern = data.get("guided_whitespace_pattern")
    if pattern is not None and (not isinstance(pattern, str) or not pattern):
        raise _bad("'guided_whitespace_pattern' must be a non-empty regex", "guided_whitespace_pattern")
    given = sorted(k for k in _GUIDED if data.get(k) is not None)
    if len(given) > 1:
        raise _bad(f"give one of {', '.join(_GUIDED)}, not {' and '.join(given)}", given[1])
    if not given:
        return None
    layout = _json_options({"whitespace_pattern": pattern})[0]
    return _spec(given[0], json_layout=layout, **{_GUIDED[given[0]]: data[given[0]]})


@dataclasses.dataclass(frozen=True)
class ToolRequest:
    """The tools a chat request offers and which it must call (`choice`: none, auto, required or a name)."""

    tools: list[dict[str, Any]]
    choice: str
    parallel: bool

    @property
    def forced(self) -> bool:
        return self.choice not in (NONE, AUTO)

    @property
    def forced_many(self) -> bool:
        """Forced calls may be several: `required` with parallel_tool_calls; a named function is called once."""
        return self.parallel and self.choice == REQUIRED

    def forced_functions(self) -> list[dict[str, Any]]:
        fns = [t["function"] for t in self.tools]
        return fns if self.choice == REQUIRED else [f for f in fns if f["name"] == self.choice]


def tools(raw_tools: Any, raw_choice: Any, parallel: bool) -> ToolRequest | None:
    """`tools` and `tool_choice`; None when no tool may be called."""
    if raw_tools is not None and not isinstance(raw_tools, list):
        raise _bad("'tools' must be an array", "tools")
    checked = [_tool(t, f"tools[{i}]") for i, t in enumerate(raw_tools or [])]
    names = [t["function"]["name"] for t in checked]
    if len(set(names)) != len(names):
        raise _bad("tool function names must be unique", "tools")
    choice = _tool_choice(raw_choice, names)
    if not checked or choice == NONE:
        return None
    return ToolRequest(checked, choice, parallel)


def _tool(t: Any, p: str) -> dict[str, Any]:
    _object(t, p, {"type", "function"}, ("type", "function"))
    if t["type"] != "function":
        raise _bad(f"Invalid value for '{p}.type': only 'function' is supported", f"{p}.type")
    fn = _object(t["function"], f"{p}.function", {"name", "description", "parameters", "strict"})
    name = fn.get("name")
    if name is None:
        raise _bad(f"Missing required field: {p}.function.name", f"{p}.function.name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise _bad(f"'{p}.function.name' must be 1 to 64 letters, digits, '_', '.' or '-'", f"{p}.function.name")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise _bad(f"'{p}.function.description' must be a string", f"{p}.function.description")
    if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
        raise _bad(f"'{p}.function.parameters' must be a JSON schema object", f"{p}.function.parameters")
    return {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}


def _tool_choice(raw: Any, names: list[str]) -> str:
    if raw is None:
        return AUTO if names else NONE
    if raw in (NONE, AUTO, REQUIRED):
        if raw != NONE and not names:
            raise _bad(f"'tool_choice' is {raw!r} but no tools are given", "tool_choice")
        return raw
    if isinstance(raw, dict):
        _object(raw, "tool_choice", {"type", "function"}, ("type", "function"))
        fn = _object(raw["function"], "tool_choice.function", {"name"}, ("name",))
        if raw["type"] != "function" or fn["name"] not in names:
            raise _bad(f"'tool_choice' names a function that is not among the tools: {fn['name']!r}",
                       "tool_choice.function.name")
        return fn["name"]
    raise _bad("'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": "
               "{\"name\": ...}}", "tool_choice")


def tool_message(m: dict[str, Any], p: str) -> dict[str, Any]:
    """The tool parts of one message: a `tool` result's `tool_call_id`, an assistant's `tool_calls`."""
    out: dict[str, Any] = {}
    if m.get("role") == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise _bad(f"Missing required field: {p}.tool_call_id (a string)", f"{p}.tool_call_id")
        out["tool_call_id"] = m["tool_call_id"]
    elif m.get("tool_call_id") is not None:
        raise _bad(f"'{p}.tool_call_id' is only allowed in tool messages", f"{p}.tool_call_id")
    calls = m.get("tool_calls")
    if calls is not None:
        if m.get("role") != "assistant":
            raise _bad(f"'{p}.tool_calls' is only allowed in assistant messages", f"{p}.tool_calls")
        if not isinstance(calls, list):
            raise _bad(f"'{p}.tool_calls' must be an array", f"{p}.tool_calls")
        out["tool_calls"] = [_history_call(c, f"{p}.tool_calls[{i}]") for i, c in enumerate(calls)]
    return out


def _history_call(c: Any, p: str) -> dict[str, Any]:
    _object(c, p, {"id", "type", "function"}, ("id", "function"))
    fn = _object(c["function"], f"{p}.function", {"name", "arguments"}, ("name",))
    if not isinstance(fn["name"], str) or not isinstance(fn.get("arguments", ""), str):
        raise _bad(f"'{p}.function' needs a string name and string arguments (JSON text)", f"{p}.function")
    return {"id": c["id"], "type": "function", "function": {"name": fn["name"], "arguments": fn.get("arguments", "{}")}}
