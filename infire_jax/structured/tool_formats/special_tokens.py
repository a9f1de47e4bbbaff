"""Formats written in the model's own special tokens: Kimi K2 and DeepSeek V3 / V3.1.

A section marker opens and closes the calls; each call is a block between its own begin and end
markers. The section markers are dropped from the content whether or not a call inside parses: they
are control tokens, never text the user should see. A call that does not parse is content verbatim.

* `kimi_k2`: `<|tool_calls_section_begin|>` then per call `<|tool_call_begin|>functions.NAME:IDX
  <|tool_call_argument_begin|>{json}<|tool_call_end|>`, then `<|tool_calls_section_end|>`. The
  `functions.NAME:IDX` string is the call's id (Kimi's template writes it back in the history).
* `deepseek_v3`: `<｜tool▁calls▁begin｜>` then per call `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`,
  a newline, the arguments in a ```json fence, `<｜tool▁call▁end｜>`; then `<｜tool▁calls▁end｜>`.
* `deepseek_v31`: the same markers, each call `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}<｜tool▁call▁end｜>`.
"""

from __future__ import annotations

import re

from infire_jax.structured.tool_formats.base import Block, Format, ToolCall, closed_block, dumps, json_object

KIMI_SECTION_BEGIN, KIMI_SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL_BEGIN, KIMI_CALL_END = "<|tool_call_begin|>", "<|tool_call_end|>"
KIMI_ARGS_BEGIN = "<|tool_call_argument_begin|>"
DEEPSEEK_CALLS_BEGIN, DEEPSEEK_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DEEPSEEK_CALL_BEGIN, DEEPSEEK_SEP, DEEPSEEK_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
_KIMI_ID = re.compile(r"\s*((?:functions\.)?([^\s:]+):\d+)\s*")
_FENCED = re.compile(r"\s*```(?:json)?\s*\n?(.*?)\n?\s*```\s*", re.DOTALL)


class KimiK2(Format):
    markers = (KIMI_CALL_BEGIN,)
    noise = (KIMI_SECTION_BEGIN, KIMI_SECTION_END)

    def block(self, text: str, start: int, final: bool) -> Block | None:
        return closed_block(text, start, KIMI_CALL_BEGIN, KIMI_CALL_END, final, _kimi_call)


def _kimi_call(body: str) -> list[ToolCall] | None:
    head, sep, args = body.partition(KIMI_ARGS_BEGIN)
    ident = _KIMI_ID.fullmatch(head)
    obj = json_object(args) if sep else None
    if ident is None or obj is None:
        return None
    return [ToolCall(ident.group(2), dumps(obj), ident.group(1))]


class DeepSeekV3(Format):
    markers = (DEEPSEEK_CALL_BEGIN,)
    noise = (DEEPSEEK_CALLS_BEGIN, DEEPSEEK_CALLS_END)

    def block(self, text: str, start: int, final: bool) -> Block | None:
        return closed_block(text, start, DEEPSEEK_CALL_BEGIN, DEEPSEEK_CALL_END, final, self.parse)

    @staticmethod
    def parse(body: str) -> list[ToolCall] | None:
        """`function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n````; the fence may be missing."""
        kind, sep, rest = body.partition(DEEPSEEK_SEP)
        name, _, args = rest.partition("\n")
        fenced = _FENCED.fullmatch(args)
        obj = json_object(fenced.group(1) if fenced else args)
        if not sep or kind.strip() != "function" or not name.strip() or obj is None:
            return None
        return [ToolCall(name.strip(), dumps(obj))]


class DeepSeekV31(DeepSeekV3):
    @staticmethod
    def parse(body: str) -> list[ToolCall] | None:
        """`NAME<｜tool▁sep｜>{...}`: no call type, no fence."""
        name, sep, args = body.partition(DEEPSEEK_SEP)
        obj = json_object(args)
        if not sep or not name.strip() or obj is None:
            return None
        return [ToolCall(name.strip(), dumps(obj))]
