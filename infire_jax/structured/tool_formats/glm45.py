"""GLM-4.5 / GLM-4.6's calls (`glm45`), as their chat template writes them:

    <tool_call>NAME
    <arg_key>K</arg_key>
    <arg_value>V</arg_value>
    ...
    </tool_call>

A value is raw text, as in Qwen3-Coder's format: the tool's JSON schema types it (qwen3_coder.py
`typed_value`); without a schema, JSON where it is JSON. In GLM's tokenizer the markers are tokens of
their own; the server keeps them in the decoded text for this parser.
"""

from __future__ import annotations

import re

from infire_jax.structured.tool_formats.base import Block, Format, ToolCall, closed_block, dumps
from infire_jax.structured.tool_formats.json_calls import HERMES_CLOSE, HERMES_OPEN
from infire_jax.structured.tool_formats.qwen3_coder import tool_properties, typed_value

ARG_KEY, ARG_KEY_END, ARG_VALUE, ARG_VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
_NAME = re.compile(r"([^\n<]+)\n?")
_ARG = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


class Glm45(Format):
    markers = (HERMES_OPEN,)

    def block(self, text: str, start: int, final: bool) -> Block | None:
        return closed_block(text, start, HERMES_OPEN, HERMES_CLOSE, final, self.parse)

    def parse(self, body: str) -> list[ToolCall] | None:
        """The function's name on the first line, then its `<arg_key>` / `<arg_value>` pairs; any other
        text in the block means no call."""
        head = _NAME.match(body)
        if head is None or not head.group(1).strip():
            return None
        name, at, args = head.group(1).strip(), head.end(), {}
        properties = tool_properties(self.tools, name)
        for arg in _ARG.finditer(body, at):
            if arg.start() != at:
                return None
            args[arg.group(1).strip()] = typed_value(arg.group(2), properties.get(arg.group(1).strip()))
            at = arg.end()
        if body[at:].strip():
            return None
        return [ToolCall(name, dumps(args))]
