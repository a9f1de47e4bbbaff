"""Tools, tool results and earlier tool calls in the prompt: through the chat template when it knows
them, else written in Hermes style (as Qwen2.5's template writes them) into plain messages.

SmolLM2's template, for one, renders only `role` and `content`: for such a template the tools go
into the system message as a `<tools>` block with the instruction to answer with `<tool_call>`
blocks, an assistant's earlier calls become those blocks, and tool results become a user message
of `<tool_response>` blocks.
"""

from __future__ import annotations

import json
from typing import Any

from infire_jax.loaders.chat_content import PARTS
from infire_jax.structured.tool_parsers import HERMES_CLOSE, HERMES_OPEN

_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>")


def template_renders_tools(chat_template: str | None) -> bool:
    """Whether the template itself takes `tools` (and then tool messages and calls)."""
    return chat_template is not None and "tools" in chat_template


def _arguments(call: dict[str, Any]) -> Any:
    """A call's arguments as an object when they are JSON text (templates write them with tojson)."""
    args = call["function"].get("arguments", "{}")
    try:
        return json.loads(args) if isinstance(args, str) else args
    except ValueError:
        return args


def for_template(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> tuple[list[dict], dict]:
    """Messages for a template that renders tools, and its extra arguments (`tools`)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [c | {"function": c["function"] | {"arguments": _arguments(c)}} for c in m["tool_calls"]]
        if m.get("content") is None:
            m["content"] = ""
        out.append(m)
    return out, ({"tools": tools} if tools else {})


def hermes_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, str]]:
    """Plain role/content messages that carry the tools, calls and results in Hermes style."""
    out: list[dict[str, str]] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        kept = ("role", "name")
        if m.get("tool_calls"):
            blocks = [f"{HERMES_OPEN}\n" + json.dumps({"name": c["function"]["name"], "arguments": _arguments(c)},
                                                      ensure_ascii=False) + f"\n{HERMES_CLOSE}"
                      for c in m["tool_calls"]]
            content = "\n".join(([content] if content else []) + blocks)
        else:
            kept += (PARTS,)  # the content's parts, which a template may take instead (loaders/chat_content.py)
        out.append({k: v for k, v in m.items() if k in kept} | {"content": content})
    for m in out:
        m.pop("_tool_results", None)
    if tools:
        prompt = _TOOLS_PROMPT.format(tools="".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = out[0] | {"content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def render_inputs(chat_template: str | None, messages: list[dict[str, Any]],
                  tools: list[dict[str, Any]] | None) -> tuple[list[dict], dict]:
    """What to give the chat template: messages and extra arguments."""
    if template_renders_tools(chat_template):
        return for_template(messages, tools)
    return hermes_messages(messages, tools), {}
