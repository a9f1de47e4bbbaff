"""A grammar that forces tool calls: `tool_choice` "required" or a named function, in the model's format.

Each call names one of the functions and its arguments follow that tool's parameter schema (a JSON
object with `name` a constant; in Kimi's and DeepSeek's formats the name between their markers and the
arguments' object after them), so a forced call is well formed and its arguments validate, whatever
the model. Markers that are special tokens of the tokenizer are written as those tokens.
"""

from __future__ import annotations

import json
from typing import Any

from infire_jax.structured import harmony
from infire_jax.structured.backend import inline_json
from infire_jax.structured.schema_refs import inlined, relocated
from infire_jax.structured.spec import StructuredOutputs
from infire_jax.structured.tool_formats import gemma4_grammar, glm45_grammar, minimax_m2_grammar
from infire_jax.structured.tool_formats.pythonic_grammar import pythonic_calls
from infire_jax.structured.tool_formats.qwen3_coder_grammar import qwen3_coder_call
from infire_jax.structured.tool_formats.special_tokens import (DEEPSEEK_CALL_BEGIN, DEEPSEEK_CALL_END,
                                                               DEEPSEEK_CALLS_BEGIN, DEEPSEEK_CALLS_END, DEEPSEEK_SEP,
                                                               KIMI_ARGS_BEGIN, KIMI_CALL_BEGIN, KIMI_CALL_END,
                                                               KIMI_SECTION_BEGIN, KIMI_SECTION_END)
from infire_jax.structured.tool_parsers import (DEEPSEEK_V3, DEEPSEEK_V31, GEMMA4, GLM45, HERMES, HERMES_CLOSE,
                                                HERMES_OPEN, KIMI_K2, LLAMA3_JSON, LLAMA4_PYTHONIC, MINIMAX_M2, MISTRAL,
                                                MISTRAL_MARKER, OPENAI, PYTHONIC, QWEN3_CODER)

EMPTY_PARAMETERS = {"type": "object", "properties": {}}
NEWLINE = "\n"
# The formats a forced call is written in: all of them.
FORCEABLE_FORMATS = (HERMES, LLAMA3_JSON, MISTRAL, KIMI_K2, DEEPSEEK_V3, DEEPSEEK_V31, QWEN3_CODER, GLM45,
                     MINIMAX_M2, PYTHONIC, LLAMA4_PYTHONIC, GEMMA4, OPENAI)
# Each format's markers, for the caller to look up as tokens the tokenizer added whole, special or not
# (`special_token_ids`: Qwen's <tool_call> is such a token, and not special).
_DEEPSEEK_MARKERS = (DEEPSEEK_CALLS_BEGIN, DEEPSEEK_CALLS_END, DEEPSEEK_CALL_BEGIN, DEEPSEEK_SEP, DEEPSEEK_CALL_END)
MARKERS = {MISTRAL: (MISTRAL_MARKER,), DEEPSEEK_V3: _DEEPSEEK_MARKERS, DEEPSEEK_V31: _DEEPSEEK_MARKERS,
           KIMI_K2: (KIMI_SECTION_BEGIN, KIMI_SECTION_END, KIMI_CALL_BEGIN, KIMI_ARGS_BEGIN, KIMI_CALL_END),
           OPENAI: harmony.SPECIAL_TOKENS, GLM45: glm45_grammar.MARKERS, MINIMAX_M2: minimax_m2_grammar.MARKERS,
           GEMMA4: gemma4_grammar.MARKERS,
           HERMES: (HERMES_OPEN, HERMES_CLOSE), QWEN3_CODER: (HERMES_OPEN, HERMES_CLOSE)}


def _call_schema(fmt: str, function: dict[str, Any], at: str) -> dict[str, Any]:
    """A call's JSON object, placed at pointer `at` of the whole schema (its parameters' `$ref`s follow)."""
    args_key = "parameters" if fmt == LLAMA3_JSON else "arguments"
    parameters = relocated(function.get("parameters") or EMPTY_PARAMETERS, f"{at}/properties/{args_key}")
    return {"type": "object", "properties": {"name": {"const": function["name"]}, args_key: parameters},
            "required": ["name", args_key], "additionalProperties": False}


def _more(separator: str) -> str:
    """Lark: further calls, each after `separator`."""
    return f" ({json.dumps(separator)} call)*"


def tool_call_constraint(fmt: str, functions: list[dict[str, Any]], *, parallel: bool,
                         special_token_ids: dict[str, int | None] | None = None) -> StructuredOutputs:
    """Calls to the given functions only (one, or one or more when `parallel`), in format `fmt`.

    `special_token_ids`: the format's markers (`MARKERS`) that the tokenizer has as one token each
    (added tokens, special or not: the grammar names them by id)."""
    if fmt not in FORCEABLE_FORMATS:
        raise ValueError(f"no forced-call grammar for the {fmt} format; forced calls exist for {FORCEABLE_FORMATS}")
    ids = special_token_ids or {}

    def mark(text: str) -> str:
        return f"<[{ids[text]}]>" if ids.get(text) is not None else json.dumps(text, ensure_ascii=False)

    if fmt in (KIMI_K2, DEEPSEEK_V3, DEEPSEEK_V31):
        return _section_constraint(fmt, functions, parallel, mark)
    if fmt == OPENAI:  # harmony: one call a turn (its <|call|> ends the output), after any reasoning
        return StructuredOutputs(grammar=harmony.call_grammar(functions, ids), param="tool_choice")
    if fmt in (PYTHONIC, LLAMA4_PYTHONIC, MINIMAX_M2, QWEN3_CODER, GLM45, GEMMA4):  # each parameter on its own
        functions = [f | {"parameters": inlined(f.get("parameters") or {}, f["name"])} for f in functions]
    if fmt in (PYTHONIC, LLAMA4_PYTHONIC):  # Python literals (tool_formats/pythonic_grammar.py)
        return StructuredOutputs(grammar=pythonic_calls(functions, parallel), param="tool_choice")
    if fmt == GEMMA4:  # Gemma 4's own value syntax (tool_formats/gemma4_grammar.py)
        return StructuredOutputs(grammar=gemma4_grammar.gemma4_calls(
            functions, parallel, mark, lambda marker: ids.get(marker) is not None), param="tool_choice")
    if fmt == MINIMAX_M2:  # one block of <invoke>s, raw-text parameters (tool_formats/minimax_m2_grammar.py)
        return StructuredOutputs(grammar=minimax_m2_grammar.minimax_m2_calls(functions, parallel, mark),
                                 param="tool_choice")
    if fmt in (QWEN3_CODER, GLM45):  # raw-text parameters typed by the schema (tool_formats/*_grammar.py)
        calls = [line for i, f in enumerate(functions) for line in (
            qwen3_coder_call(f, i, mark) if fmt == QWEN3_CODER else
            glm45_grammar.glm45_call(f, i, mark, lambda marker: ids.get(marker) is not None))]
        rules = (f"start: call{_more(NEWLINE) if parallel else ''}\n"
                 f"call: {' | '.join(f'call{i}' for i in range(len(functions)))}\n" + "\n".join(calls) + "\n")
        return StructuredOutputs(grammar=rules, param="tool_choice")
    top = "/items" if fmt == MISTRAL else ""
    one = {"anyOf": [_call_schema(fmt, f, f"{top}/anyOf/{i}") for i, f in enumerate(functions)]} \
        if len(functions) > 1 else _call_schema(fmt, functions[0], top)
    if fmt == HERMES:
        call = f"{mark(HERMES_OPEN)} {json.dumps(NEWLINE)} {inline_json(one)} {json.dumps(NEWLINE)} {mark(HERMES_CLOSE)}"
        rules = f"start: call{_more(NEWLINE) if parallel else ''}\ncall: {call}\n"
    elif fmt == LLAMA3_JSON:
        rules = f"start: call{_more('; ') if parallel else ''}\ncall: {inline_json(one)}\n"
    else:  # MISTRAL
        array = {"type": "array", "items": one, "minItems": 1} | ({} if parallel else {"maxItems": 1})
        rules = f"start: {mark(MISTRAL_MARKER)} {inline_json(array)}\n"
    return StructuredOutputs(grammar=rules, param="tool_choice")


def _section_constraint(fmt: str, functions: list[dict[str, Any]], parallel: bool, mark) -> StructuredOutputs:
    """Kimi K2's and DeepSeek V3 / V3.1's calls: a section of call blocks, each the function's name
    between markers and its arguments' JSON object (fenced as ```json for V3)."""
    def args(f: dict[str, Any]) -> str:
        return inline_json((f.get("parameters") or EMPTY_PARAMETERS) | {"type": "object"})

    calls = []
    for i, f in enumerate(functions):
        name = f["name"]
        if fmt == KIMI_K2:  # the id functions.NAME:IDX; IDX counts the calls (two digits: a bound, not a count)
            head = f"{json.dumps(f'functions.{name}:')} /[0-9]{{1,2}}/ {mark(KIMI_ARGS_BEGIN)}"
            body = f"{mark(KIMI_CALL_BEGIN)} {head} {args(f)} {mark(KIMI_CALL_END)}"
        elif fmt == DEEPSEEK_V3:
            fence = json.dumps(f"{name}\n```json\n")
            body = (f"{mark(DEEPSEEK_CALL_BEGIN)} \"function\" {mark(DEEPSEEK_SEP)} {fence} {args(f)} "
                    f"{json.dumps(chr(10) + '```')} {mark(DEEPSEEK_CALL_END)}")
        else:
            body = (f"{mark(DEEPSEEK_CALL_BEGIN)} {json.dumps(name)} {mark(DEEPSEEK_SEP)} {args(f)} "
                    f"{mark(DEEPSEEK_CALL_END)}")
        calls.append(f"call{i}: {body}")
    kimi = fmt == KIMI_K2
    begin, end = (KIMI_SECTION_BEGIN, KIMI_SECTION_END) if kimi else (DEEPSEEK_CALLS_BEGIN, DEEPSEEK_CALLS_END)
    rules = (f"start: {mark(begin)} call{'+' if parallel else ''} {mark(end)}\n"
             f"call: {' | '.join(f'call{i}' for i in range(len(functions)))}\n" + "\n".join(calls) + "\n")
    return StructuredOutputs(grammar=rules, param="tool_choice")
