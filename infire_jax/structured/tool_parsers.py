"""Tool calls in a model's own output format, found in its text as it streams.

Models are trained on one way of writing a call; the chat template shows which (`detect_format`).
The formats, under vLLM's `--tool-call-parser` names, are in tool_formats/: `hermes`,
`llama3_json`, `mistral`, `pythonic`, `llama4_pythonic`, `kimi_k2`, `deepseek_v3`, `deepseek_v31`,
`qwen3_coder`, `glm45`, `minimax_m2`, `gemma4`; and `openai`, gpt-oss's harmony, whose calls are messages
of their own (harmony.py reads them with the rest of the output, so it is no `ToolCallStream` format).

`ToolCallStream` turns text deltas into content deltas and calls: text that may still turn out to
be the start of a call is held back, and each call is handed out once its block is complete. Output
that looks like a call but does not parse is returned as content, as vLLM does. Content is the
output without its calls, without the section markers around them (Kimi, DeepSeek), and without
whitespace that only separates calls; it is "" (never None) when there is none.

The stream decides only on text it has, never on where a delta ended, so the content and calls are
the same however the output is split: `parse_tool_calls` is the stream fed the whole text at once.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from infire_jax.structured import harmony
from infire_jax.structured.tool_formats import FORMATS as _FORMATS
from infire_jax.structured.tool_formats import ToolCall
from infire_jax.structured.tool_formats.base import held_back
from infire_jax.structured.tool_formats.gemma4 import TOOL_CALL as GEMMA4_CALL
from infire_jax.structured.tool_formats.glm45 import ARG_KEY
from infire_jax.structured.tool_formats.minimax_m2 import OPEN as MINIMAX_OPEN
from infire_jax.structured.tool_formats.json_calls import HERMES_CLOSE, HERMES_OPEN, MISTRAL_MARKER, PYTHON_TAG
from infire_jax.structured.tool_formats.pythonic import PYTHON_START
from infire_jax.structured.tool_formats.special_tokens import (DEEPSEEK_CALL_BEGIN, DEEPSEEK_CALLS_BEGIN, DEEPSEEK_SEP,
                                                               KIMI_CALL_BEGIN, KIMI_SECTION_BEGIN)

HERMES, LLAMA3_JSON, MISTRAL = "hermes", "llama3_json", "mistral"
PYTHONIC, LLAMA4_PYTHONIC, KIMI_K2 = "pythonic", "llama4_pythonic", "kimi_k2"
DEEPSEEK_V3, DEEPSEEK_V31, QWEN3_CODER, GLM45 = "deepseek_v3", "deepseek_v31", "qwen3_coder", "glm45"
MINIMAX_M2, GEMMA4 = "minimax_m2", "gemma4"
FORMATS = tuple(_FORMATS)
TOOL_PARSERS = FORMATS
OPENAI = harmony.TOOL_PARSER
TOOL_PARSER_NAMES = (*FORMATS, OPENAI)  # every --tool-call-parser name

__all__ = ["DEEPSEEK_V3", "DEEPSEEK_V31", "FORMATS", "GEMMA4", "GLM45", "HERMES", "HERMES_CLOSE", "HERMES_OPEN",
           "KIMI_K2", "LLAMA3_JSON", "LLAMA4_PYTHONIC", "MINIMAX_M2", "MISTRAL", "MISTRAL_MARKER", "OPENAI", "PYTHONIC",
           "PYTHON_TAG", "QWEN3_CODER", "TOOL_PARSERS", "TOOL_PARSER_NAMES", "ToolCall", "ToolCallStream",
           "detect_format", "parse_tool_calls", "stream_tool_calls"]


def detect_format(chat_template: str | None) -> str:
    """The call format a chat template teaches; Hermes when it shows none (we then prompt for Hermes).

    The most specific markers are looked for first: Qwen3-Coder's and GLM-4.5's templates also have
    `<tool_call>`, and DeepSeek V3 and V3.1 share their markers but only V3 writes the call type and a
    ```json fence."""
    t = chat_template or ""
    if harmony.is_harmony(t):
        return OPENAI
    if KIMI_SECTION_BEGIN in t or KIMI_CALL_BEGIN in t:
        return KIMI_K2
    if MINIMAX_OPEN in t:
        return MINIMAX_M2
    if GEMMA4_CALL in t:  # Gemma 4's <|tool_call>, not Hermes' <tool_call>
        return GEMMA4
    if DEEPSEEK_CALLS_BEGIN in t or DEEPSEEK_CALL_BEGIN in t:
        return DEEPSEEK_V3 if "```json" in t or "function" + DEEPSEEK_SEP in t else DEEPSEEK_V31
    if MISTRAL_MARKER in t:
        return MISTRAL
    if "<function=" in t:
        return QWEN3_CODER
    if ARG_KEY in t:
        return GLM45
    if HERMES_OPEN in t:
        return HERMES
    if PYTHON_START in t:
        return LLAMA4_PYTHONIC
    if "[func_name1(" in t:  # the instruction pythonic templates give: [func_name1(params_name1=...), ...]
        return PYTHONIC
    if PYTHON_TAG in t or ('"parameters"' in t and "tools" in t):
        return LLAMA3_JSON
    return HERMES


class ToolCallStream:
    """Splits one choice's output into content and tool calls, delta by delta.

    `fmt`: a parser name (FORMATS). `tools`: the request's tools, which Qwen3-Coder's format needs to
    type its raw parameter values. `calls` collects every call handed out so far."""

    def __init__(self, fmt: str, tools: list[dict[str, Any]] | None = None):
        if fmt == OPENAI:
            raise ValueError(f"{fmt} calls are read by structured/harmony.py's HarmonyStream")
        if fmt not in _FORMATS:
            raise ValueError(f"unknown tool-call parser {fmt!r}; known: {', '.join(TOOL_PARSER_NAMES)}")
        self.fmt = fmt
        self.calls: list[ToolCall] = []
        self._format = _FORMATS[fmt](tools)
        self._markers = self._format.markers + self._format.noise
        self._buf = ""  # the output from its first undecided character on (the rest is handed out)
        self._undecided_head = True  # whether a head block begins is not known yet
        self._in_block = False  # a block begins at _buf[0] and is not complete yet
        self._gap_ws: str | None = None  # after a call: whitespace that is content only if text follows

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """(content to show now, calls completed now)."""
        self._buf += delta
        return self._advance(final=False)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end of the output: what is left, as calls if they parse, else as content."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, list[ToolCall]]:
        content: list[str] = []
        calls: list[ToolCall] = []
        buf, pos = self._buf, 0
        while pos < len(buf):
            if self._undecided_head:
                head = self._format.head(buf, final)
                if head is None:
                    break
                self._undecided_head, self._in_block = False, head
            if self._in_block:
                block = self._format.block(buf, pos, final)
                if block is None:
                    break
                if block.calls is None:
                    content.append(buf[pos:block.end])
                calls += block.calls or []
                self._in_block, self._gap_ws = False, ("" if block.calls is not None else None)
                pos = block.end
                continue
            at, marker = self._next_marker(buf, pos)
            end = at if at >= 0 else len(buf) if final else max(pos, len(buf) - self._held_back(buf))
            self._gap(buf[pos:end], content)
            pos = end
            if at < 0:
                break
            if marker in self._format.noise:
                pos += len(marker)
            else:
                self._in_block = True
        self._buf = buf[pos:]
        self.calls += calls
        return "".join(content), calls

    def _next_marker(self, buf: str, pos: int) -> tuple[int, str]:
        """The first marker (or noise) at or after `pos`, the longest where two begin together."""
        best, found = -1, ""
        for marker in self._markers:
            at = buf.find(marker, pos)
            if at >= 0 and (best < 0 or at < best or (at == best and len(marker) > len(found))):
                best, found = at, marker
        return best, found

    def _held_back(self, buf: str) -> int:
        return max((held_back(buf, m) for m in self._markers), default=0)

    def _gap(self, text: str, out: list[str]) -> None:
        """Text between blocks is content; after a call, only once something other than whitespace
        comes (the newlines a model puts between its calls are not content)."""
        if self._gap_ws is None:
            out.append(text)
            return
        self._gap_ws += text
        if self._gap_ws.strip():
            out.append(self._gap_ws)
            self._gap_ws = None


def parse_tool_calls(text: str, parser: str, tools: list[dict[str, Any]] | None = None,
                     chat_template_kwargs: dict[str, Any] | None = None) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole output in format `parser`; content is "" when there is none.

    `chat_template_kwargs` is taken so that a caller passes a request's the same way here and to
    `parse_reasoning`; no tool-call format depends on them."""
    return stream_tool_calls([text], parser, tools, chat_template_kwargs)


def stream_tool_calls(deltas: Iterable[str], parser: str, tools: list[dict[str, Any]] | None = None,
                      chat_template_kwargs: dict[str, Any] | None = None) -> tuple[str, list[ToolCall]]:
    """(content, calls) of an output given as deltas: the same as `parse_tool_calls` of their
    concatenation, whatever the split."""
    stream = ToolCallStream(parser, tools)
    content = [stream.feed(d)[0] for d in deltas]
    content.append(stream.finish()[0])
    return "".join(content), stream.calls
