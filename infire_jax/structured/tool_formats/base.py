"""What every tool-call format shares: the call itself, how a format describes its syntax to the
stream (`Format`, `Block`), and the JSON helpers several formats use.

A format is a set of markers where a call block may begin, plus a function that reads one block.
The stream (tool_parsers.ToolCallStream) does the rest the same way for every format, which is what
makes streamed and whole parses agree: a format only ever answers "this block ends here and holds
these calls", "this block is not a call", or "not decided yet, send more text".
"""

from __future__ import annotations

import dataclasses
import json
import math
import uuid
from collections.abc import Callable
from typing import Any


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call as OpenAI returns it; `id` is generated unless the format writes its own (Kimi)."""
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str = dataclasses.field(default_factory=new_call_id)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass(frozen=True)
class Block:
    """A call block read from the output: it ends at `end` (exclusive). `calls` is None when the
    text looked like a call but is not one; that text is then content, as vLLM returns it."""
    end: int
    calls: list[ToolCall] | None


class Format:
    """One model family's call syntax. Subclasses set the markers and read blocks.

    `markers`: a block begins at each occurrence of one of them, anywhere in the output.
    `noise`: section markers around the calls (Kimi, DeepSeek); they are never content.
    """
    markers: tuple[str, ...] = ()
    noise: tuple[str, ...] = ()

    def __init__(self, tools: list[dict[str, Any]] | None = None):
        self.tools = tools or []  # the request's tools; only formats that type raw values read them

    def head(self, text: str, final: bool) -> bool | None:
        """Whether a block begins at the very start of the output (formats whose calls are the whole
        output rather than marked): None while the text so far cannot tell."""
        return False

    def block(self, text: str, start: int, final: bool) -> Block | None:
        """The block beginning at `start` (at a marker, or 0 for a head block). None while it is not
        decided yet; when `final` (the output is complete) it must decide. A decision may depend only
        on text already present, so that it is the same however the output was split into deltas."""
        raise NotImplementedError


def closed_block(text: str, start: int, opener: str, closer: str, final: bool,
                 parse: Callable[[str], list[ToolCall] | None],
                 closed: Callable[[str], list[ToolCall] | None] | None = None) -> Block | None:
    """A block from `opener` to the first `closer` whose body reads as calls (`closed`, default `parse`):
    an argument's string may hold the closer's text (a forced call's grammar lets it), so a body that
    does not read may end at a later one. Once the output is final, a block that never reads ends at
    its first closer (`parse`), or with none, at the end of the output."""
    body = start + len(opener)
    first = at = text.find(closer, body)
    while at >= 0:
        calls = (closed or parse)(text[body:at])
        if calls is not None:
            return Block(at + len(closer), calls)
        at = text.find(closer, at + len(closer))
    if not final:
        return None  # a later closer may still end it
    if first >= 0:
        return Block(first + len(closer), parse(text[body:first]))
    return Block(len(text), parse(text[body:]))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"{text} overflows a double")
    return value


# Python's decoder takes NaN and Infinity, and reads 1e400 as inf, which would make `arguments` that are
# not JSON.
JSON_DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite)


def json_object(text: str) -> dict[str, Any] | None:
    """`text` as one JSON object, or None (broken JSON, or not an object)."""
    try:
        obj = JSON_DECODER.decode(text)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def dumps(args: dict[str, Any]) -> str:
    return json.dumps(args, ensure_ascii=False)


def call_from_json(obj: object, args_key: str) -> ToolCall | None:
    """A call from one decoded `{"name", args_key: {...}}` object, or None when not shaped like one.
    The arguments may also be JSON text of an object (some models double-encode them), and may come
    under the other of `arguments` and `parameters`."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    other = "parameters" if args_key == "arguments" else "arguments"  # models write either
    args = obj.get(args_key, obj.get(other, {}))
    if isinstance(args, str):
        args = json_object(args)
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], dumps(args))


def held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that could begin `marker` (not the whole marker)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
