"""`POST /v1/responses` and `GET /v1/responses/{id}`: OpenAI's Responses API, as vLLM serves it.

A request is translated into a chat request and validated by the chat path (server/protocol.py),
so sampling, tools, `text.format` and `chat_template_kwargs` mean what they mean in chat; errors
name the Responses API's fields. It then runs as a chat request does: the chat template renders the
prompt (server/endpoints.py `chat_prompt`), the engine admits it, and the output is parsed by the
same reasoning and tool-call parsers into output items (server/responses_output.py).

Stored responses (`store`, the default) are kept in memory, the most recent ones only, each
readable by its own tenant only (server/auth.py: the tenant that also salts the prefix cache).
`previous_response_id` continues a stored conversation: its input items, then its output.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import re
import time
from typing import Any, Callable, Iterator, Mapping

from aiohttp import web

from infire_jax.engine.async_engine import RequestStream
from infire_jax.errors import InvalidRequestError
from server.auth import TENANT
from server.endpoints import (STATE, admitted, chat_prompt, image_tiles, read_json, response_model, sampling_defaults,
                              served_model)
from server.errors import APIError, to_api_error
from server.kv_handoff import RequestHandoff
from server.protocol import Body, ChatRequest, bad, json_type, parse_chat
from server.responses import Usage
from server.responses_output import COMPLETED, INCOMPLETE, IN_PROGRESS, ResponseOutput, new_id
from server.streaming import SSEWriter
from server.tool_calls import ChoiceParser

MAX_STORED = 1000
_FIELDS = frozenset({
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
    "parallel_tool_calls", "text", "stream", "store", "previous_response_id", "metadata", "user", "background",
    "include", "truncation", "service_tier", "reasoning",
    # vLLM's extensions, as in chat
    "chat_template_kwargs", "top_k", "min_p", "repetition_penalty", "seed", "stop", "priority", "cache_salt",
})
# Fields that mean the same in chat.
_SAME = ("model", "temperature", "top_p", "parallel_tool_calls", "user", "stream", "chat_template_kwargs", "top_k",
         "min_p", "repetition_penalty", "seed", "stop", "priority", "cache_salt")
_ROLES = ("user", "system", "developer", "assistant")
_ITEM_KEYS = {"message": {"type", "role", "content", "id", "status"},
              "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
              "function_call_output": {"type", "call_id", "output", "id", "status"},
              "reasoning": {"type", "id", "summary", "content", "status", "encrypted_content"}}
_PARTS = {"input_text": {"type", "text"}, "output_text": {"type", "text", "annotations", "logprobs"},
          "input_image": {"type", "image_url", "detail", "file_id"}}
# Chat field names in the chat path's errors -> the Responses API's.
_RENAMES = ((re.compile(r"\bmax_(completion_)?tokens\b"), "max_output_tokens"),
            (re.compile(r"\bresponse_format(\.json_schema)?"), "text.format"),
            (re.compile(r"\btool_choice\.function\.name\b"), "tool_choice.name"),
            (re.compile(r"\b(tools\[\d+\])\.function\b"), r"\1"),
            (re.compile(r"(?<!chat_template_kwargs\.)\bmessages\b"), "input"),
            (re.compile(r"(?<!\.)\breasoning_effort\b"), "reasoning.effort"))


@dataclasses.dataclass
class Stored:
    response: dict[str, Any]
    items: list[dict[str, Any]]  # the conversation before its output (no instructions: they do not carry over)


class ResponseStore:
    """The last `capacity` stored responses of all tenants, least recently used out first."""

    def __init__(self, capacity: int = MAX_STORED):
        self.capacity = capacity
        self._entries: collections.OrderedDict[tuple[str | None, str], Stored] = collections.OrderedDict()

    def put(self, tenant: str | None, stored: Stored) -> None:
        key = (tenant, stored.response["id"])
        self._entries[key] = stored
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, tenant: str | None, response_id: str) -> Stored | None:
        stored = self._entries.get((tenant, response_id))
        if stored is not None:
            self._entries.move_to_end((tenant, response_id))
        return stored


STORE = web.AppKey("responses", ResponseStore)


@dataclasses.dataclass
class ResponsesRequest:
    chat: ChatRequest
    items: list[dict[str, Any]]  # the conversation so far: earlier turns' items, then this input's
    echo: dict[str, Any]  # the request's settings, as a response repeats them
    store: bool


# ---- handlers -------------------------------------------------------------------------------------
async def create(request: web.Request) -> web.StreamResponse:
    st, store, tenant = request.app[STATE], request.app[STORE], request.get(TENANT)
    body = await read_json(request)
    r = parse_request(body, store, tenant, sampling_defaults(st, body))
    m, lora = served_model(st, r.chat.model)
    tools = r.chat.tools
    out = ResponseOutput(ChoiceParser(m.tool_parser if tools else None, tools.tools if tools else None,
                                      m.reasoning_parser, r.chat.chat_template_kwargs))
    response = {"id": new_id("resp"), "object": "response", "created_at": int(time.time()), "status": IN_PROGRESS,
                "background": False, "error": None, "incomplete_details": None, "output": [], "usage": None,
                **r.echo, "model": response_model(m, lora)}

    def finished(status: str) -> dict[str, Any]:
        """The response once its output ended with `status` (its items closed), stored if asked."""
        u = usage.to_dict()
        reasoning = min(len(m.tokenizer.encode(out.reasoning, add_special_tokens=False)), u["completion_tokens"])
        final = response | {"status": status, "output": out.items, "usage": {
            "input_tokens": u["prompt_tokens"], "input_tokens_details": u["prompt_tokens_details"],
            "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": u["total_tokens"]}}
        if status == INCOMPLETE:
            final["incomplete_details"] = {"reason": "max_output_tokens"}
        if r.store:
            store.put(tenant, Stored(final, r.items))
        return final

    with _responses_names():
        tiles = await image_tiles(st, m, r.chat) if r.chat.images else None
        prompts = await chat_prompt(m, r.chat, "input", tiles)
        usage = Usage([len(prompts[0])])
        async with admitted(request, RequestHandoff(None, request, None), m, lora, r.chat, prompts,
                            "input", tiles) as stream:
            if r.chat.stream:
                return await _stream(request, stream, out, usage, response, finished)
            reason = None
            async for batch in stream:
                for _, d in batch:
                    usage.add(0, d)
                    out.feed(d.text, d.finished)
                    reason = d.finish_reason or reason
    out.finish(_status(reason))
    return web.json_response(finished(_status(reason)))


def _status(finish_reason: str | None) -> str:
    return INCOMPLETE if finish_reason == "length" else COMPLETED


async def _stream(request: web.Request, stream: RequestStream, out: ResponseOutput, usage: Usage,
                  response: dict[str, Any], finished: Callable[[str], dict[str, Any]]) -> web.StreamResponse:
    """The response as events: created and in progress, its items' events, then completed (or
    incomplete); a failure after the start is an `error` event."""
    sse = SSEWriter(request)
    try:
        await sse.start()  # the client may already have gone
        try:
            await sse.send_typed([out.event("response.created", response=response),
                                  out.event("response.in_progress", response=response)])
            reason = None
            async for batch in stream:
                events = []
                for _, d in batch:
                    usage.add(0, d)
                    events += out.feed(d.text, d.finished)
                    reason = d.finish_reason or reason
                await sse.send_typed(events)
            events = out.finish(_status(reason))
            final = finished(_status(reason))
            await sse.send_typed(events + [out.event(f"response.{final['status']}", response=final)])
        except ConnectionResetError:
            raise
        except Exception as e:  # noqa: BLE001 - the headers are sent: report the failure in the stream
            err = to_api_error(e)
            await sse.send_typed([out.event("error", code=err.code, message=err.message, param=err.param)])
        await sse.close()
    except ConnectionResetError:
        pass  # the client went away; the caller's `async with` aborts the request
    return sse.response


async def retrieve(request: web.Request) -> web.Response:
    """`GET /v1/responses/{id}`: a stored response of this tenant."""
    response_id = request.match_info["response_id"]
    stored = request.app[STORE].get(request.get(TENANT), response_id)
    if stored is None:
        raise APIError(404, f"Response with id '{response_id}' not found.", param="response_id",
                       code="response_not_found")
    return web.json_response(stored.response)


# ---- the request ----------------------------------------------------------------------------------
def parse_request(data: Any, store: ResponseStore, tenant: str | None,
                  defaults: Mapping[str, Any] | None = None) -> ResponsesRequest:
    """The Responses API body as a chat request, the conversation it continues, and what the
    response repeats. `store`: the stored responses `previous_response_id` may name; `defaults`:
    the model's sampling defaults (parse_chat's)."""
    b = Body(data, _FIELDS)
    b.neutral("background", lambda v: v is False, "responses run in the foreground only")
    b.neutral("include", lambda v: v == [], "no extra output data (reasoning.encrypted_content, logprobs) is served")
    b.neutral("truncation", lambda v: v == "disabled", "an input longer than the context is refused, not truncated")
    b.neutral("service_tier", lambda v: v in ("auto", "default"), "there is one service tier")
    if not b.present("input"):
        raise bad("you must provide an input parameter", "input")
    items = _input_items(b.data["input"])
    previous = b.string("previous_response_id")
    if previous is not None:
        stored = store.get(tenant, previous)
        if stored is None:
            raise APIError(404, f"Previous response with id '{previous}' not found.", param="previous_response_id",
                           code="previous_response_not_found")
        items = stored.items + stored.response["output"] + items
    instructions = b.string("instructions")
    metadata = b.string_map("metadata")
    system = [{"role": "system", "content": instructions}] if instructions is not None else []
    chat: dict[str, Any] = {k: b.data[k] for k in _SAME if k in b.data}
    chat["messages"] = system + _messages(items)
    if b.present("max_output_tokens"):
        chat["max_completion_tokens"] = b.data["max_output_tokens"]
    if b.present("tools"):
        chat["tools"] = _tools(b.data["tools"])
    if b.present("tool_choice"):
        chat["tool_choice"] = _tool_choice(b.data["tool_choice"])
    reasoning = _reasoning(b.data.get("reasoning"))
    if reasoning["effort"] is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    text = _text(b.data.get("text"))
    if text["format"]["type"] != "text":
        chat["response_format"] = _response_format(text["format"])
    with _responses_names():
        req = parse_chat(chat, defaults)
    echo = {"instructions": instructions, "max_output_tokens": b.data.get("max_output_tokens"), "metadata": metadata,
            "model": req.model, "parallel_tool_calls": b.boolean("parallel_tool_calls", True),
            "previous_response_id": previous,
            "reasoning": reasoning if b.present("reasoning") else None, "store": b.boolean("store", True),
            "temperature": req.params.temperature, "text": text, "tool_choice": b.data.get("tool_choice") or "auto",
            "tools": b.data.get("tools") or [], "top_p": req.params.top_p, "truncation": "disabled",
            "user": b.data.get("user")}
    return ResponsesRequest(req, items, echo, echo["store"])


@contextlib.contextmanager
def _responses_names() -> Iterator[None]:
    """Errors of the chat path and the engine's checks, with the Responses API's field names in
    their param and message."""
    try:
        yield
    except (APIError, InvalidRequestError) as exc:
        e = to_api_error(exc)
        for pattern, name in _RENAMES:
            e.message = pattern.sub(name, e.message)
            e.param = pattern.sub(name, e.param) if e.param is not None else None
        raise e from exc


def _object(v: Any, p: str, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise bad(f"Invalid type for '{p}': expected an object, but got {json_type(v)} instead.", p)
    unknown = sorted(k for k in v if k not in allowed and v[k] is not None)  # a null field is an absent one
    if unknown:
        raise bad(f"Unrecognized or unsupported field: {p}.{unknown[0]}", f"{p}.{unknown[0]}")
    return v


def _string(item: dict[str, Any], key: str, p: str) -> str:
    v = item.get(key)
    if not isinstance(v, str):
        raise bad(f"Missing or invalid '{p}.{key}': expected a string", f"{p}.{key}")
    return v


def _input_items(raw: Any) -> list[dict[str, Any]]:
    """`input`: a string (one user message) or a non-empty array of items, checked."""
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise bad(f"Invalid type for 'input': expected a string or a non-empty array of input items, but got "
                  f"{json_type(raw) if raw != [] else 'an empty array'} instead.", "input")
    items = []
    for i, item in enumerate(raw):
        p = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind not in _ITEM_KEYS:
            if kind == "item_reference":
                raise bad(f"'{p}': item references are not supported; send the item itself", f"{p}.type")
            raise bad(f"Invalid value for '{p}.type': expected one of {', '.join(_ITEM_KEYS)}, got {kind!r}",
                      f"{p}.type")
        item = _object(item, p, _ITEM_KEYS[kind])
        if kind == "message":
            if item.get("role") not in _ROLES:
                raise bad(f"Invalid value for '{p}.role': expected one of {', '.join(_ROLES)}, got "
                          f"{item.get('role')!r}", f"{p}.role")
            item = {"type": kind, "role": item["role"], "content": _content(item.get("content"), f"{p}.content")}
        elif kind == "function_call":
            item = {k: _string(item, k, p) for k in ("call_id", "name", "arguments")} | {"type": kind}
        elif kind == "function_call_output":
            item = {"type": kind, "call_id": _string(item, "call_id", p),
                    "output": _content(item.get("output"), f"{p}.output", images=False)}
        elif not isinstance(item.get("content") or [], list):
            raise bad(f"Invalid type for '{p}.content': expected an array of reasoning_text parts", f"{p}.content")
        items.append(item)  # a reasoning item is kept as given: templates drop earlier turns' reasoning
    return items


def _content(raw: Any, p: str, images: bool = True) -> str | list[dict[str, Any]]:
    """A string, or parts: input_text, output_text (from an earlier response's output) and, where
    `images`, input_image (a URL or data URL, as chat's image_url part takes). Text alone is joined into
    a string; with an image, the chat parts in order."""
    if isinstance(raw, str):
        return raw
    if not isinstance(raw, list):
        raise bad(f"Invalid type for '{p}': expected a string or an array of content parts, but got "
                  f"{json_type(raw)} instead.", p)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(raw):
        kind, q = part.get("type") if isinstance(part, dict) else None, f"{p}[{j}]"
        if kind not in _PARTS or (kind == "input_image" and not images):
            what = "files are not supported yet; " if kind == "input_file" else ""
            taken = "input_text, output_text and input_image" if images else "input_text and output_text"
            raise bad(f"'{q}': {what}only {taken} parts are supported here", q)
        part = _object(part, q, _PARTS[kind])
        if kind != "input_image":
            parts.append({"type": "text", "text": _string(part, "text", q)})
        elif part.get("file_id") is not None:
            raise bad(f"'{q}.file_id': uploaded files are not supported; send the image as image_url (a URL or a "
                      "data URL)", f"{q}.file_id")
        else:
            ref = {"url": _string(part, "image_url", q)} | ({"detail": part["detail"]} if part.get("detail") else {})
            parts.append({"type": "image_url", "image_url": ref})
    if any(part["type"] == "image_url" for part in parts):
        return parts
    return "\n".join(part["text"] for part in parts)


def _messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages of input items: consecutive function calls join the assistant message before
    them, as the model wrote them; their outputs are `tool` messages; a reasoning item becomes the
    next assistant message's `reasoning_content` (which templates such as Qwen3's render)."""
    out: list[dict[str, Any]] = []
    reasoning: dict[str, str] = {}
    for item in items:
        kind = item.get("type", "message")
        if kind == "reasoning":
            parts = item.get("content") or []
            reasoning = {"reasoning_content": "".join(p.get("text", "") for p in parts if isinstance(p, dict))}
        elif kind == "message":
            content = item["content"] if item.get("id") is None else _content(item["content"], "input")
            out.append({"role": item["role"], "content": content} | (reasoning if item["role"] == "assistant" else {}))
            reasoning = {}
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant" and not reasoning:
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]} | reasoning)
            reasoning = {}
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return out


def _tools(raw: Any) -> list[dict[str, Any]]:
    """Responses function tools (flat: name, description, parameters, strict) as chat's."""
    if not isinstance(raw, list):
        raise bad(f"Invalid type for 'tools': expected an array, but got {json_type(raw)} instead.", "tools")
    out = []
    for i, t in enumerate(raw):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise bad(f"Invalid value for 'tools[{i}].type': only function tools are served, got {kind!r}",
                      f"tools[{i}].type")
        out.append({"type": "function", "function": {k: v for k, v in t.items() if k != "type"}})
    return out


def _tool_choice(raw: Any) -> Any:
    """none, auto, required, or {"type": "function", "name"} (chat nests the name under "function")."""
    if isinstance(raw, dict):
        _object(raw, "tool_choice", {"type", "name"})
        if raw.get("type") != "function":
            raise bad(f"Invalid value for 'tool_choice.type': only 'function' is supported, got {raw.get('type')!r}",
                      "tool_choice.type")
        return {"type": "function", "function": {"name": _string(raw, "name", "tool_choice")}}
    return raw


def _reasoning(raw: Any) -> dict[str, Any]:
    """`reasoning`: its `effort` goes to the chat template as chat's `reasoning_effort`; no summaries
    are written (the reasoning itself is the reasoning item's content)."""
    r = _object(raw if raw is not None else {}, "reasoning", {"effort", "summary", "generate_summary"})
    for key in ("summary", "generate_summary"):
        if r.get(key) is not None:
            raise bad(f"'reasoning.{key}' is not supported: no reasoning summaries are written", f"reasoning.{key}")
    return {"effort": r.get("effort"), "summary": None}


def _text(raw: Any) -> dict[str, Any]:
    """`text`: its `format` (default plain text), as a response repeats it."""
    if raw is None:
        return {"format": {"type": "text"}}
    fmt = _object(raw, "text", {"format"}).get("format") or {"type": "text"}
    kind = _object(fmt, "text.format", {"type", "name", "schema", "strict", "description"}).get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise bad(f"Invalid value for 'text.format.type': expected one of text, json_object, json_schema; got "
                  f"{kind!r}", "text.format.type")
    return {"format": fmt}


def _response_format(fmt: dict[str, Any]) -> dict[str, Any]:
    """`text.format` as chat's response_format (whose json_schema nests what text.format has flat)."""
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
