"""Formats whose calls are JSON objects: Hermes, Llama 3 JSON, Mistral.

* `hermes` (Qwen2.5, Hermes, and SmolLM2 through our Hermes-style prompt): content, then
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks.
* `llama3_json` (Llama 3.1+): the whole output is `{"name": ..., "parameters": {...}}`, several
  separated by `;`, optionally after `<|python_tag|>`. Anything else in the output makes it content.
* `mistral`: content, then `[TOOL_CALLS]` and either a JSON array of `{"name", "arguments"}` (older
  tokenizers) or `name{json args}` (newer; `name[ARGS]{json args}` from the v11+ tokenizer), each call
  then after its own `[TOOL_CALLS]`. Mistral's templates require 9-character alphanumeric call ids.
"""

from __future__ import annotations

import re
import uuid

from infire_jax.structured.tool_formats.base import (JSON_DECODER, Block, Format, ToolCall, call_from_json,
                                                     closed_block, dumps)

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_MARKER = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"
# the newer Mistral call: a function name, optionally [ARGS], then the arguments object
_MISTRAL_NAMED = re.compile(r"([A-Za-z0-9_.\-]+)\s*(?:\[ARGS\]\s*)?(?=\{)")


def parse_hermes_block(body: str) -> ToolCall | None:
    """The call in one `<tool_call>` block's JSON, or None."""
    try:
        return call_from_json(JSON_DECODER.decode(body), "arguments")
    except ValueError:
        return None


def json_calls(text: str, args_key: str, sep: str = ";") -> list[ToolCall] | None:
    """Calls written as JSON objects (or arrays of them) one after another, `sep` between them; None
    unless all of `text` is such calls."""
    calls: list[ToolCall] = []
    i = 0
    while True:
        while i < len(text) and (text[i].isspace() or (calls and text[i] == sep)):
            i += 1
        if i == len(text):
            return calls or None
        try:
            obj, i = JSON_DECODER.raw_decode(text, i)
        except ValueError:
            return None
        found = [call_from_json(o, args_key) for o in (obj if isinstance(obj, list) else [obj])]
        if not found or None in found:
            return None
        calls.extend(found)


class Hermes(Format):
    markers = (HERMES_OPEN,)

    def block(self, text: str, start: int, final: bool) -> Block | None:
        def parse(body: str) -> list[ToolCall] | None:
            call = parse_hermes_block(body.strip())
            return [call] if call is not None else None
        return closed_block(text, start, HERMES_OPEN, HERMES_CLOSE, final, parse)


class Llama3Json(Format):
    """Not marked: the output's first characters decide, so the calls are a head block to the end."""

    def head(self, text: str, final: bool) -> bool | None:
        s = text.lstrip()
        if s.startswith("{") or s.startswith(PYTHON_TAG):
            return True
        if not final and PYTHON_TAG.startswith(s):  # blank, or a part of the tag
            return None
        return False

    def block(self, text: str, start: int, final: bool) -> Block | None:
        if not final:
            return None  # a later `;` may add calls, and anything else makes the whole output content
        return Block(len(text), json_calls(text.lstrip().removeprefix(PYTHON_TAG), "parameters"))


class Mistral(Format):
    markers = (MISTRAL_MARKER,)

    def block(self, text: str, start: int, final: bool) -> Block | None:
        """A block ends where its JSON does. It may not run past the next `[TOOL_CALLS]`, which bounds
        a broken one: then that block is content and the next one is read on its own."""
        i = start + len(MISTRAL_MARKER)
        nxt = text.find(MISTRAL_MARKER, i)
        bound = nxt if nxt >= 0 else len(text)
        settled = final or nxt >= 0  # no later text can change text[start:bound]
        while i < bound and text[i].isspace():
            i += 1
        named = None
        if i < bound and text[i] != "[":
            named = _MISTRAL_NAMED.match(text, i, bound)
            if named is None:
                return Block(bound, None) if settled else None
            i = named.end()
        elif i == bound:
            return Block(bound, None) if settled else None
        try:
            obj, end = JSON_DECODER.raw_decode(text if bound == len(text) else text[:bound], i)
        except ValueError:
            return Block(bound, None) if settled else None
        if named is not None:  # the lookahead made `obj` an object
            calls = [ToolCall(named.group(1), dumps(obj), mistral_call_id())]
        else:
            found = [call_from_json(o, "arguments") for o in obj] if isinstance(obj, list) else []
            whole = bool(found) and None not in found  # an array with anything else in it is no call
            calls = [ToolCall(c.name, c.arguments, mistral_call_id()) for c in found] if whole else None
        return Block(end, calls)


def mistral_call_id() -> str:
    """Mistral's chat templates refuse history whose call ids are not 9 alphanumeric characters."""
    return uuid.uuid4().hex[:9]

