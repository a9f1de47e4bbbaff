"""Reasoning ("thinking") split from the answer, under vLLM's `--reasoning-parser` names.

* `deepseek_r1`, `minimax_m2`: the reasoning is everything up to `</think>`, with or without a leading
  `<think>` (R1's and MiniMax-M2's templates put `<think>` in the prompt, so the output usually starts
  inside it). An output without `</think>` is all reasoning: it was cut off while thinking.
* `qwen3`, `glm45`: reasoning only inside a `<think>…</think>` that opens the output; an output not
  starting with `<think>` is all content. `chat_template_kwargs={"enable_thinking": False}` makes it
  all content (the template then closes an empty think block in the prompt).
* `kimi_k2`: as qwen3, with `◁think▷…◁/think▷` as well as `<think>…</think>`.
* `deepseek_v3`: V3.1+ thinks only when asked, `chat_template_kwargs={"thinking": True}`; then as
  deepseek_r1, else all content.
* `gemma4`: Gemma 4's `<|channel>thought\n…<channel|>` opening the output, its `thought\n` label
  dropped (vLLM's); `<|tool_call>` also ends the reasoning, staying in the content for the tool parser
  (a call is never reasoning, as vLLM's `is_reasoning_end` says). The block is read whether or not the
  request asked to think, as vLLM reads it; but only `chat_template_kwargs={"enable_thinking": True}`
  lets a constrained answer think first: Gemma 4's template closes an empty channel in the prompt
  otherwise (thinking is off by default).
* `openai_gptoss`: gpt-oss's harmony channels, its `analysis` channel being the reasoning. They are
  no think block: harmony.py reads them (server/tool_calls.py picks it by this name).

An opened think block that never closes is reasoning to the end, in every parser: a stream has
already handed it out as reasoning by the time the output ends. Reasoning and content are "" (never
None) when there is none. `ReasoningStream` holds back only text that may still be part of a marker,
and decides only on text it has, so streamed and whole outputs split the same way.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable
from typing import Any

from infire_jax.structured import harmony
from infire_jax.structured.tool_formats.base import held_back

THINK = ("<think>", "</think>")
KIMI_THINK = ("◁think▷", "◁/think▷")
GEMMA4_CHANNEL = ("<|channel>", "<channel|>")
GEMMA4_LABEL, GEMMA4_TOOL_CALL = "thought\n", "<|tool_call>"


@dataclasses.dataclass(frozen=True)
class _Syntax:
    pairs: tuple[tuple[str, str], ...]  # (open, close) markers of a think block
    implicit: bool  # the output begins inside the block (its open marker was in the prompt)
    label: str = ""  # dropped where it begins a block's reasoning (Gemma 4's channel name)
    ends: tuple[str, ...] = ()  # markers that also end the block, kept in the content
    grammar: bool = True  # a constrained answer may reason first (`reasoning_grammar`)


_R1 = _Syntax((THINK,), implicit=True)
_EXPLICIT = _Syntax((THINK,), implicit=False)


def _qwen3(kwargs: dict[str, Any]) -> _Syntax | None:
    return None if kwargs.get("enable_thinking", True) is False else _EXPLICIT


def _gemma4(kwargs: dict[str, Any]) -> _Syntax:
    return _Syntax((GEMMA4_CHANNEL,), implicit=False, label=GEMMA4_LABEL, ends=(GEMMA4_TOOL_CALL,),
                   grammar=kwargs.get("enable_thinking") is True)


REASONING_PARSERS: dict[str, Callable[[dict[str, Any]], _Syntax | None]] = {
    "deepseek_r1": lambda kwargs: _R1,
    "minimax_m2": lambda kwargs: _R1,  # its template opens <think> in the prompt
    "qwen3": _qwen3,
    "glm45": _qwen3,
    "kimi_k2": lambda kwargs: _Syntax((KIMI_THINK, THINK), implicit=False),
    "deepseek_v3": lambda kwargs: _R1 if kwargs.get("thinking") is True else None,
    "gemma4": _gemma4,
}

# Every --reasoning-parser name: the think-block syntaxes, and harmony's channels.
REASONING_PARSER_NAMES = (*REASONING_PARSERS, harmony.REASONING_PARSER)

_HEAD, _REASONING, _CONTENT = "head", "reasoning", "content"


def reasoning_markers(parser: str, chat_template_kwargs: dict[str, Any] | None = None) -> tuple[str, ...]:
    """The open and close markers of the think blocks an output may hold (none when it may not reason):
    a server keeps those that are special tokens in the text it decodes, for the parser to find.
    Harmony's are its special tokens, which name the channels."""
    if parser == harmony.REASONING_PARSER:
        return harmony.SPECIAL_TOKENS
    syntax = _syntax(parser, chat_template_kwargs)
    return () if syntax is None else (*(m for pair in syntax.pairs for m in pair), *syntax.ends)


def _syntax(parser: str, chat_template_kwargs: dict[str, Any] | None) -> _Syntax | None:
    if parser == harmony.REASONING_PARSER:
        raise ValueError(f"{parser} output is read by structured/harmony.py's HarmonyStream, not as think blocks")
    if parser not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {parser!r}; known: {', '.join(REASONING_PARSER_NAMES)}")
    return REASONING_PARSERS[parser](chat_template_kwargs or {})


def reasoning_grammar(parser: str, chat_template_kwargs: dict[str, Any] | None = None,
                      special_ids: dict[str, int | None] | None = None) -> str | None:
    """The Lark grammar of the reasoning an output may hold before its answer, as `parser` splits it:
    its start rule ends in `@answer`, the answer's constraint (`StructuredOutputs.after`). None when
    the output holds no reasoning (the answer's constraint applies from the first token).

    The reasoning is free text up to the first close marker (a lazy lexeme ends there); where the
    output may also begin with the answer (qwen3's syntax), the think block is optional. The answer
    follows the close marker at once, as vLLM's structured output starts at the token after it.
    `special_ids`: the markers that are special tokens of the tokenizer, by text, written as those
    tokens (a decode keeps them: `reasoning_markers`)."""
    syntax = _syntax(parser, chat_template_kwargs)
    if syntax is None or not syntax.grammar:
        return None
    ids = special_ids or {}

    def mark(marker: str) -> str:  # a special token is that token: text never holds it
        return f"<[{ids[marker]}]>" if ids.get(marker) is not None else json.dumps(marker, ensure_ascii=False)

    def block(i: int, opener: str | None, closer: str) -> str:
        """Lark lines of think block `i`: blank space and the open marker (none for a block the output
        starts inside), then free text up to the close marker's first occurrence."""
        lines, parts = [], []
        if opener is not None:
            lines.append(f"WS{i}: /[ \\t\\r\\n]+/")
            parts += [f"WS{i}?", mark(opener)]
        if ids.get(closer) is not None:
            lines.append(f"TEXT{i}: /(?s:.*)/")
            parts += [f"TEXT{i}", mark(closer)]
        else:  # a lazy lexeme ends at the first close marker
            lines += [f"BODY{i}: /(?s:.*)/ {json.dumps(closer, ensure_ascii=False)}", f"body{i}[lazy]: BODY{i}"]
            parts.append(f"body{i}")
        return "\n".join([*lines, f"think{i}: {' '.join(parts)}"])

    pairs = [(None, syntax.pairs[0][1])] if syntax.implicit else list(syntax.pairs)
    rules = [block(i, o, c) for i, (o, c) in enumerate(pairs)]
    think = " | ".join(f"think{i}" for i in range(len(pairs)))
    start = "start: think @answer" if syntax.implicit else "start: think? @answer"
    return "\n".join([start, f"think: {think}", *rules]) + "\n"


class ReasoningStream:
    """Splits one choice's output into reasoning and content, delta by delta."""

    def __init__(self, parser: str, chat_template_kwargs: dict[str, Any] | None = None):
        self.parser = parser
        self._syntax = _syntax(parser, chat_template_kwargs)
        self._phase = _HEAD if self._syntax is not None else _CONTENT
        self._close = ""  # the marker that ends the open think block
        self._label = ""  # a label that may still begin the block's reasoning
        self._buf = ""  # text not handed out yet

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning to show now, content to show now)."""
        self._buf += delta
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        """At the end of the output: what is left."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning, content = "", ""
        if self._phase == _HEAD and not self._decide_head(final):
            return "", ""
        if self._phase == _REASONING:
            if self._label:
                if not final and self._label.startswith(self._buf):
                    return "", ""  # it may still be the label
                self._buf = self._buf.removeprefix(self._label)
                self._label = ""
            ends = [(at, m) for m in (self._close, *self._syntax.ends) for at in [self._buf.find(m)] if at >= 0]
            if not ends:
                keep = 0 if final else max(held_back(self._buf, m) for m in (self._close, *self._syntax.ends))
                reasoning, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                return reasoning, ""
            at, marker = min(ends)
            dropped = len(marker) if marker == self._close else 0  # an end of `ends` stays in the content
            reasoning, self._buf = self._buf[:at], self._buf[at + dropped:]
            self._phase = _CONTENT
        content, self._buf = self._buf, ""
        return reasoning, content

    def _decide_head(self, final: bool) -> bool:
        """Whether the output opens a think block, once its first characters tell (leading
        whitespace does not): then the open marker and the whitespace before it are dropped."""
        s = self._buf.lstrip()
        for opener, closer in self._syntax.pairs:
            if s.startswith(opener):
                self._phase, self._close, self._buf = _REASONING, closer, s[len(opener):]
                self._label = self._syntax.label
                return True
        if not final and any(opener.startswith(s) for opener, _ in self._syntax.pairs):
            return False  # blank so far, or a part of an open marker
        self._phase = _REASONING if self._syntax.implicit else _CONTENT
        self._close = self._syntax.pairs[0][1]
        return True


def parse_reasoning(text: str, parser: str,
                    chat_template_kwargs: dict[str, Any] | None = None) -> tuple[str, str]:
    """(reasoning, content) of a whole output; each is "" when there is none."""
    return stream_reasoning([text], parser, chat_template_kwargs)


def stream_reasoning(deltas: Iterable[str], parser: str,
                     chat_template_kwargs: dict[str, Any] | None = None) -> tuple[str, str]:
    """(reasoning, content) of an output given as deltas: the same as `parse_reasoning` of their
    concatenation, whatever the split."""
    stream = ReasoningStream(parser, chat_template_kwargs)
    pieces = [stream.feed(d) for d in deltas] + [stream.finish()]
    return "".join(r for r, _ in pieces), "".join(c for _, c in pieces)
