"""A chat message's content as its chat template takes it: a string, or a list of parts.

Templates differ in what `message['content']` may be. Some (SmolLM2's, Llama 3's, Qwen2.5's) write it
as text; others (Llama 4's, Gemma 3's, Qwen3.5's) loop over a list of parts, writing each text part and
their own marker for each image. vLLM tells the two apart by looking for such a loop in the template
(its `--chat-template-content-format auto`) and gives a message whose content came as parts either the
parts ("openai") or their texts joined by newlines ("string"), each image a marker. So do we: the
server and `LLM.chat` keep a message's parts beside its joined text (`PARTS`), and the tokenizer
renders whichever its template takes (`for_template`).
"""

from __future__ import annotations

from typing import Any

import jinja2
from jinja2 import nodes

PARTS = "content_parts"  # a message's content as parts: [{"type": "text", "text": ...}, {"type": "image"}]
IMAGE_MARKER = "<|image|>"  # an image in string content; the engine's model expands it (vision/prompt.py)
CONTENT_FORMATS = ("auto", "string", "openai")


def template_content_format(chat_template: str | None) -> str:
    """"openai" where the template loops over a message's content (directly, or over a variable set
    from it), else "string": vLLM's detection."""
    if not chat_template:
        return "string"
    try:
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(chat_template)
    except jinja2.TemplateSyntaxError:
        return "string"
    aliases = {a.target.name for a in tree.find_all(nodes.Assign)
               if isinstance(a.target, nodes.Name) and _is_content(a.node, set())}
    return "openai" if any(_is_content(loop.iter, aliases) for loop in tree.find_all(nodes.For)) else "string"


def _is_content(node: nodes.Node, aliases: set[str]) -> bool:
    """Whether `node` is a message's content (`m['content']`, `m.content`, a variable set from one, or
    one of those through filters)."""
    while isinstance(node, nodes.Filter) and node.node is not None:
        node = node.node
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
    if isinstance(node, nodes.Getattr):
        return node.attr == "content"
    return isinstance(node, nodes.Name) and node.name in aliases


def joined(parts: list[dict[str, Any]]) -> str:
    """Parts as string content: their texts joined by newlines, each image its marker (vLLM's "string")."""
    return "\n".join(p["text"] if p["type"] == "text" else IMAGE_MARKER for p in parts)


def for_template(messages: list[dict[str, Any]], content_format: str) -> tuple[list[dict[str, Any]], str]:
    """The messages as a template of `content_format` takes them (each message's parts, where it has
    them, as its content for "openai"), and the last message's text as the template writes it last
    (for continue_final_message: its last text part, where it has parts)."""
    out, final = [], ""
    for m in messages:
        parts = m.get(PARTS)
        m = {k: v for k, v in m.items() if k != PARTS}
        if parts is not None and content_format == "openai":
            m["content"] = parts
            final = next((p["text"] for p in reversed(parts) if p["type"] == "text"), "")
        else:
            final = m.get("content") or ""
        out.append(m)
    return out, final
