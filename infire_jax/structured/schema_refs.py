"""A tool's parameter schema with its local `$ref`s made to hold where the grammar puts the schema.

Pydantic (and so most agent frameworks) writes a model-typed parameter as `{"$ref": "#/$defs/Loc"}`
with the definitions at the root of the parameters' schema. A forced call's grammar moves that
schema: the JSON formats nest it inside the call's object (`relocated`: each pointer is prefixed with
where it now sits, recursion included), and the raw-text formats (Qwen3-Coder, GLM-4.5, MiniMax-M2,
pythonic) take each parameter on its own (`inlined`: each reference replaced by its target, which a
recursive schema cannot be).
"""

from __future__ import annotations

from typing import Any

from infire_jax.errors import InvalidRequestError

# Keywords whose value maps names (not keywords) to schemas.
_NAMED_SCHEMAS = ("properties", "patternProperties", "dependentSchemas")
_DEFINITIONS = ("$defs", "definitions")


def _local(ref: Any) -> bool:
    return isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))


def _map(node: Any, schema_fn) -> Any:
    """`node` with `schema_fn` applied to each subschema (a dict's values, a names-to-schemas map's
    values, a list's items)."""
    if isinstance(node, list):
        return [schema_fn(x) for x in node]
    if not isinstance(node, dict):
        return node
    return {k: ({name: schema_fn(s) for name, s in v.items()} if k in _NAMED_SCHEMAS and isinstance(v, dict)
                else schema_fn(v)) for k, v in node.items()}


def relocated(schema: Any, pointer: str) -> Any:
    """`schema` as placed at JSON pointer `pointer` (e.g. "/properties/arguments") of a larger one: its
    local references rewritten to point where their targets now are."""
    def walk(node: Any) -> Any:
        node = _map(node, walk)
        if isinstance(node, dict) and _local(node.get("$ref")):
            node["$ref"] = "#" + pointer + node["$ref"][1:]
        return node

    return walk(schema)


def _target(root: dict[str, Any], ref: str) -> Any:
    node: Any = root
    for part in ref[2:].split("/") if ref != "#" else ():
        key = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        elif isinstance(node, dict) and key in node:
            node = node[key]
        else:
            raise InvalidRequestError(f"$ref {ref!r} points to nothing in the tool's parameters", "tools")
    return node


def inlined(root: Any, function: str) -> Any:
    """`root` (a function's parameters) with every local reference replaced by its target (keywords
    beside the `$ref` kept over the target's) and the definitions dropped; a recursive schema is refused
    naming the function."""
    def walk(node: Any, active: frozenset[str]) -> Any:
        if isinstance(node, dict) and _local(node.get("$ref")):
            ref = node["$ref"]
            if ref in active:
                raise InvalidRequestError(f"the parameters of function {function!r} refer to themselves ({ref}); "
                                          "a recursive schema cannot be forced in this tool-call format", "tools")
            target = _target(root, ref)
            rest = {k: v for k, v in node.items() if k != "$ref"}
            return walk(target | rest if isinstance(target, dict) else target, active | {ref})
        if isinstance(node, dict):
            node = {k: v for k, v in node.items() if k not in _DEFINITIONS}
        return _map(node, lambda x: walk(x, active))

    return walk(root, frozenset())
