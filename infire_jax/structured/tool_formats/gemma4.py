"""Gemma 4's calls (`gemma4`), as its chat template writes them and vLLM's `gemma4` parser reads them:

    <|tool_call>call:NAME{key:<|"|>text<|"|>,n:42,flag:true,opts:{k:<|"|>v<|"|>},xs:[1,2]}<tool_call|>

Not JSON: keys are bare (or, as the template writes nested ones elsewhere, between `<|"|>`), strings sit
between `<|"|>` delimiters with no escaping, and numbers, `true`/`false`/`null` are bare. Several calls
follow each other with nothing between them. The markers and the delimiter are special tokens of
Gemma 4's tokenizer; the server keeps them in the decoded text for this parser. A value's syntax gives
its type (a delimited string stays a string, `42` is a number), as vLLM's and transformers' readers do;
a bare word that is none of those is read as a string, as vLLM reads it.
"""

from __future__ import annotations

import re
from typing import Any

from infire_jax.structured.tool_formats.base import JSON_DECODER, Block, Format, ToolCall, closed_block, dumps

TOOL_CALL, TOOL_CALL_END, STRING_DELIM = "<|tool_call>", "<tool_call|>", '<|"|>'
_HEAD = re.compile(r"\s*call:([\w\-.]+)(?=\{)")
_BARE_END = re.compile(r"[,}\]]")
_CONSTANTS = {"true": True, "false": False, "null": None, "none": None}


class _Bad(ValueError):
    """The text is not Gemma 4's argument syntax."""


class Gemma4(Format):
    markers = (TOOL_CALL,)

    def block(self, text: str, start: int, final: bool) -> Block | None:
        return closed_block(text, start, TOOL_CALL, TOOL_CALL_END, final, parse_call)


def parse_call(body: str) -> list[ToolCall] | None:
    """`call:NAME{...}` (what lies between the markers) as one call; None when it is anything else."""
    head = _HEAD.match(body)
    if head is None:
        return None
    try:
        args, at = _Reader(body).object(head.end())
    except _Bad:
        return None
    if body[at:].strip():
        return None
    return [ToolCall(head.group(1), dumps(args))]


class _Reader:
    """A recursive reader of one argument object; each method returns (value, index after it)."""

    def __init__(self, text: str):
        self.text = text

    def _skip(self, at: int) -> int:
        while at < len(self.text) and self.text[at] in " \t\r\n":
            at += 1
        return at

    def _expect(self, at: int, char: str) -> int:
        at = self._skip(at)
        if not self.text.startswith(char, at):
            raise _Bad(f"expected {char!r} at {at}")
        return at + 1

    def _string(self, at: int) -> tuple[str, int]:
        """A delimited string from `at` (at its opening delimiter): the text up to the next delimiter."""
        body = at + len(STRING_DELIM)
        end = self.text.find(STRING_DELIM, body)
        if end < 0:
            raise _Bad("unterminated string")
        return self.text[body:end], end + len(STRING_DELIM)

    def _items(self, at: int, close: str, item) -> tuple[list, int]:
        """Comma-separated items up to `close`, from just after the opening bracket."""
        out = []
        at = self._skip(at)
        if self.text.startswith(close, at):
            return out, at + 1
        while True:
            value, at = item(at)
            out.append(value)
            at = self._skip(at)
            if self.text.startswith(close, at):
                return out, at + 1
            at = self._expect(at, ",")

    def object(self, at: int) -> tuple[dict[str, Any], int]:
        pairs, at = self._items(self._expect(at, "{"), "}", self._member)
        return dict(pairs), at

    def _member(self, at: int) -> tuple[tuple[str, Any], int]:
        at = self._skip(at)
        if self.text.startswith(STRING_DELIM, at):
            key, at = self._string(at)
        else:
            colon = self.text.find(":", at)
            key = self.text[at:colon].strip() if colon >= 0 else ""
            if not key or any(c in key for c in "{}[],<"):
                raise _Bad("no key")
            at = colon
        value, at = self.value(self._expect(at, ":"))
        return (key, value), at

    def value(self, at: int) -> tuple[Any, int]:
        at = self._skip(at)
        if self.text.startswith(STRING_DELIM, at):
            return self._string(at)
        if self.text.startswith("{", at):
            return self.object(at)
        if self.text.startswith("[", at):
            return self._items(at + 1, "]", self.value)
        end = _BARE_END.search(self.text, at)
        end = len(self.text) if end is None else end.start()
        raw = self.text[at:end].strip()
        if not raw or STRING_DELIM in raw:
            raise _Bad("no value")
        return _bare(raw), end


def _bare(raw: str) -> Any:
    """A bare value: a constant, a JSON number, else the word itself (vLLM's reading)."""
    if raw.lower() in _CONSTANTS:
        return _CONSTANTS[raw.lower()]
    try:
        value = JSON_DECODER.decode(raw)
    except ValueError:
        return raw
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else raw
