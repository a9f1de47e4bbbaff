"""Pythonic calls (`pythonic`, `llama4_pythonic`: Llama 3.2, Llama 4 and others prompted so):
`[get_weather(city='LA', n=3), other(x=[1, 2], flag=True, v=None)]`, either as the whole output or
wrapped in `<|python_start|>` … `<|python_end|>` (Llama 4's tokens) anywhere in it.

The list is read with Python's own parser (`ast`), never evaluated: only keyword arguments whose
values are literals (str, numbers, bool, None, and lists, tuples and string-keyed dicts of them)
make a call. Anything else (a variable, an expression, a positional argument) means the text was
not a call, and it stays content.
"""

from __future__ import annotations

import ast
import math
import re
from typing import Any

from infire_jax.structured.tool_formats.base import Block, Format, ToolCall, closed_block, dumps

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
_CALL_START = re.compile(r"\s*[A-Za-z_]\w*\s*\(")  # what must follow the `[` of a call list
_CALL_START_SO_FAR = re.compile(r"\s*(?:[A-Za-z_]\w*\s*)?")  # a text that may still grow into it


class _NotLiteral(ValueError):
    pass


def _literal(node: ast.expr) -> Any:
    """A JSON value from a literal node, or _NotLiteral."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, bool, int, float))):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise _NotLiteral  # JSON has no inf or nan
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _NotLiteral
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        keys = [_literal(k) if k is not None else None for k in node.keys]  # None: a `**x` entry
        if not all(isinstance(k, str) for k in keys):
            raise _NotLiteral
        return {k: _literal(v) for k, v in zip(keys, node.values)}
    raise _NotLiteral


def parse_call_list(source: str) -> list[ToolCall] | None:
    """`[f(a=1), g()]` as calls, or None when it is anything else."""
    try:
        tree = ast.parse(source.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        if any(kw.arg is None for kw in node.keywords):  # `**kwargs`
            return None
        try:
            args = {kw.arg: _literal(kw.value) for kw in node.keywords}
        except _NotLiteral:
            return None
        calls.append(ToolCall(node.func.id, dumps(args)))
    return calls


# What matters to bracket depth: a whole string literal (its brackets do not count), a quote the
# text has not closed yet, or a bracket. Possessive quantifiers (`*+`, `++`) keep an unclosed string
# from backtracking, so rescanning a growing list on every delta stays linear in its length.
_DEPTH_TOKENS = re.compile("|".join([
    r"'''(?:[^'\\]++|\\.|'(?!''))*+'''", r'"""(?:[^"\\]++|\\.|"(?!""))*+"""',  # triple-quoted strings
    r"'''|\"\"\"",  # one not closed yet (before `''` could match as an empty string)
    r"'(?:[^'\\]++|\\.)*+'", r'"(?:[^"\\]++|\\.)*+"',  # strings
    r"['\"]",  # one not closed yet
    r"[][(){}]",
]), re.DOTALL)


def list_end(text: str, start: int) -> int | None:
    """Index just past the `]` that closes the `[` at `start`; None when the text ends first."""
    depth = 0
    for token in _DEPTH_TOKENS.finditer(text, start):
        t = token.group()
        if t in ("'", '"', "'''", '"""'):
            return None
        if t in ("(", "[", "{"):
            depth += 1
        elif t in (")", "]", "}"):
            depth -= 1
            if depth == 0:
                return token.end()
    return None


class Pythonic(Format):
    markers = (PYTHON_START,)

    def head(self, text: str, final: bool) -> bool | None:
        s = text.lstrip()
        if not s:
            return None if not final else False
        return s[0] == "["

    def block(self, text: str, start: int, final: bool) -> Block | None:
        if text.startswith(PYTHON_START, start):
            return closed_block(text, start, PYTHON_START, PYTHON_END, final, parse_call_list)
        at = len(text) - len(text.lstrip())  # the head's `[`
        if not _CALL_START.match(text, at + 1):
            so_far = _CALL_START_SO_FAR.match(text, at + 1)
            if final or so_far.end() < len(text):
                return Block(at + 1, None)  # `[` of something else ("[1] ...", "[Note]"): content, decided early
            return None
        end = list_end(text, at)
        if end is None:
            return Block(len(text), None) if final else None
        return Block(end, parse_call_list(text[at:end]))
