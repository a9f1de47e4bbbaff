"""MiniMax-M2's calls (`minimax_m2`), as its chat template writes them:

    <minimax:tool_call>
    <invoke name="NAME">
    <parameter name="P">V</parameter>
    ...
    </invoke>
    <invoke name="OTHER">...</invoke>
    </minimax:tool_call>

One block holds every call of a turn. A value is raw text, as in Qwen3-Coder's format: the tool's JSON
schema types it (qwen3_coder.py `typed_value`); without a schema, JSON where it is JSON.
"""

from __future__ import annotations

import re

from infire_jax.structured.tool_formats.base import Block, Format, ToolCall, closed_block, dumps
from infire_jax.structured.tool_formats.qwen3_coder import tool_properties, typed_value

OPEN, CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"
_INVOKE = re.compile(r'\s*<invoke name="([^"\n]+)">(.*?)</invoke>', re.DOTALL)
_PARAMETER = re.compile(r'\s*<parameter name="([^"\n]+)">(.*?)</parameter>', re.DOTALL)


class MiniMaxM2(Format):
    markers = (OPEN,)

    def block(self, text: str, start: int, final: bool) -> Block | None:
        return closed_block(text, start, OPEN, CLOSE, final, self.parse)

    def parse(self, body: str) -> list[ToolCall] | None:
        """Each `<invoke>` with its `<parameter>`s; any other text in the block means no call."""
        calls, at = [], 0
        for invoke in _INVOKE.finditer(body):
            if invoke.start() != at:
                return None
            args = self._arguments(invoke.group(1).strip(), invoke.group(2))
            if args is None:
                return None
            calls.append(ToolCall(invoke.group(1).strip(), dumps(args)))
            at = invoke.end()
        return calls if calls and not body[at:].strip() else None

    def _arguments(self, name: str, inner: str) -> dict | None:
        properties, args, at = tool_properties(self.tools, name), {}, 0
        for p in _PARAMETER.finditer(inner):
            if p.start() != at:
                return None
            raw = p.group(2).removeprefix("\n").removesuffix("\n")
            args[p.group(1).strip()] = typed_value(raw, properties.get(p.group(1).strip()))
            at = p.end()
        return args if not inner[at:].strip() else None
