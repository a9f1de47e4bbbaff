"""Tool calls in a model's own output format, found in its text as it streams.

Models are trained on one way of writing a call; the chat template shows which (`detect_format`):

* `hermes` (Qwen2.5, Hermes, and SmolLM2 through our Hermes-style prompt): content, then
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks.
* `llama3_json` (Llama 3.1+): the whole output is `{"name": ..., "parameters": {...}}`, several
  separated by `;`, optionally after `<|python_tag|>`.
* `mistral`: content, then `[TOOL_CALLS]` and a JSON array of `{"name", "arguments"}`.

`ToolCallStream` turns text deltas into content deltas and finished calls: text that may still
turn out to be the start of a call is held back, and a call is handed out once complete. Output
that looks like a call but does not parse is returned as content, as vLLM does.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid

HERMES, LLAMA3_JSON, MISTRAL = "hermes", "llama3_json", "mistral"
FORMATS = (HERMES, LLAMA3_JSON, MISTRAL)
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_MARKER = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"
_HERMES_BLOCK = re.compile(re.escape(HERMES_OPEN) + r"\s*(.*?)\s*" + re.escape(HERMES_CLOSE), re.DOTALL)


def detect_format(chat_template: str | None) -> str:
    """The call format a chat template teaches; Hermes when it shows none (we then prompt for Hermes)."""
    t = chat_template or ""
    if MISTRAL_MARKER in t:
        return MISTRAL
    if HERMES_OPEN in t:
        return HERMES
    if PYTHON_TAG in t or ('"parameters"' in t and "tools" in t):
        return LLAMA3_JSON
    return HERMES


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str = dataclasses.field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call(obj: object, args_key: str) -> ToolCall | None:
    """A call from one decoded JSON object, or None when it is not shaped like one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_calls(text: str, args_key: str, sep: str = ";") -> list[ToolCall] | None:
    """Calls written as JSON objects one after another (a separator between them), or None."""
    decoder, calls, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and (text[i].isspace() or (calls and text[i] == sep)):
            i += 1
        if i == len(text):
            return calls or None
        try:
            obj, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        items = obj if isinstance(obj, list) else [obj]
        found = [_call(o, args_key) for o in items]
        if not found or None in found:
            return None
        calls.extend(found)


def parse_hermes_block(body: str) -> ToolCall | None:
    try:
        return _call(json.loads(body), "arguments")
    except ValueError:
        return None


def _held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that could begin `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolCallStream:
    """Splits one choice's output into content and tool calls, delta by delta."""

    def __init__(self, fmt: str):
        if fmt not in FORMATS:
            raise ValueError(f"unknown tool-call format {fmt!r}")
        self.fmt = fmt
        self.text = ""
        self.calls: list[ToolCall] = []
        self._sent = 0  # characters of `text` handed out as content or consumed by calls
        self._in_calls = False
        self._calls_from = 0  # where the calls began: if none parses, content from there on

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """(content to show now, calls completed now)."""
        self.text += delta
        if self._in_calls:
            return "", self._closed_calls()
        if self.fmt == LLAMA3_JSON:
            return self._feed_llama(), []
        marker = HERMES_OPEN if self.fmt == HERMES else MISTRAL_MARKER
        at = self.text.find(marker, self._sent)
        if at < 0:
            return self._content(len(self.text) - _held_back(self.text, marker)), []
        content = self._content(at)
        self._in_calls, self._calls_from = True, at
        return content, self._closed_calls()

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end of the output: what is left, as calls if they parse, else as content."""
        calls = self._closed_calls()
        rest = self.text[self._sent:]
        self._sent = len(self.text)
        if not self._in_calls:
            return rest, []
        if self.fmt == HERMES:
            at = rest.find(HERMES_OPEN)  # a last block the output ended inside of
            last = parse_hermes_block(rest[at + len(HERMES_OPEN):].strip()) if at >= 0 else None
            calls += [last] if last is not None else []
        elif self.fmt == MISTRAL:
            calls = _json_calls(rest.removeprefix(MISTRAL_MARKER), "arguments") or []
        else:
            calls = _json_calls(rest.removeprefix(PYTHON_TAG), "parameters") or []
        self.calls.extend(c for c in calls if c not in self.calls)
        if not self.calls:
            return self.text[self._calls_from:], []  # it looked like a call but is not one: plain content
        return "", calls

    def _content(self, end: int) -> str:
        out = self.text[self._sent:end]
        self._sent = max(self._sent, end)
        return out

    def _closed_calls(self) -> list[ToolCall]:
        """Hermes: the `<tool_call>` blocks closed in the unsent text (one that does not parse is skipped)."""
        if self.fmt != HERMES or not self._in_calls:
            return []
        out = []
        for m in _HERMES_BLOCK.finditer(self.text, self._sent):
            call = parse_hermes_block(m.group(1))
            if call is not None:
                out.append(call)
            self._sent = m.end()
        self.calls.extend(out)
        return out

    def _feed_llama(self) -> str:
        """The first non-blank characters decide: a JSON object (or the python tag) starts calls."""
        head = self.text[self._sent:].lstrip()
        if self._sent == 0 and (not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG)):
            return ""  # undecided yet
        if self._sent == 0 and (head.startswith("{") or head.startswith(PYTHON_TAG)):
            self._in_calls = True
            self._sent = self._calls_from = len(self.text) - len(head)
            return ""
        return self._content(len(self.text))
