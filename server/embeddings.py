"""`POST /v1/embeddings` (OpenAI's, with vLLM's extensions): each input's embedding, from an engine
started with `--runner pooling` (infire_jax/pooling/). vLLM's chat form takes `messages` instead of
`input`: a conversation (or an array of them, one input each) through the chat template, with no
generation prompt unless asked.

Every input is one engine request (a prompt run with nothing sampled); they are admitted together
and batched by the scheduler like any prompts, so a list of inputs costs about one prefill of their
tokens. A client that leaves aborts them all.
"""

from __future__ import annotations

import base64
import dataclasses
import sys
import time
import uuid

import ml_dtypes
import numpy as np
from aiohttp import web

from infire_jax.errors import InvalidRequestError
from infire_jax.pooling.config import REMOVED_NORMALIZE, PoolingParams
from infire_jax.structured.tool_prompt import render_inputs
from server.auth import TENANT
from server.endpoints import STATE, ServedModel, read_json, response_model, served_model
from server.protocol import bad, parse_messages, template_kwargs

_FIELDS = frozenset({"model", "input", "encoding_format", "dimensions", "user", "embed_dtype", "endianness",
                     # vLLM's extensions; the chat form's
                     "truncate_prompt_tokens", "add_special_tokens", "priority", "use_activation", "messages",
                     "add_generation_prompt", "continue_final_message", "chat_template_kwargs"})
_CHAT_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")
_EMBED_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
_MAX_INPUTS = 2048  # OpenAI's limit on one request's inputs
_INT32 = 2 ** 31


@dataclasses.dataclass
class EmbeddingRequest:
    model: str | None  # None: the served model (endpoints.served_model)
    inputs: list[str | list[int]]  # none in the chat form
    messages: list[list[dict]] | None  # vLLM's chat form: conversations, each through the chat template
    template_flags: dict  # the chat form's: add_generation_prompt, continue_final_message, chat_template_kwargs
    base64: bool
    embed_dtype: str  # base64's values: float32, float16 or bfloat16 (vLLM's embed_dtype)
    endianness: str  # base64's byte order: native, big or little (vLLM's)
    params: PoolingParams
    truncate_prompt_tokens: int | None
    add_special_tokens: bool
    priority: int


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def checked_priority(body: dict) -> int:
    """vLLM's `priority` (lower runs first), a 32-bit integer."""
    priority = body.get("priority", 0)
    if not _is_int(priority) or not -_INT32 <= priority < _INT32:
        raise bad(f"priority must be a 32-bit integer, got {priority!r}", "priority")
    return priority


def parse_embedding(body) -> EmbeddingRequest:
    """The request, or a 400 naming the field."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    if "normalize" in body:
        raise bad(REMOVED_NORMALIZE, "normalize")
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise bad(f"unknown field(s) {', '.join(unknown)}; /v1/embeddings takes {', '.join(sorted(_FIELDS))}",
                  unknown[0])
    model = body.get("model")  # checked by served_model
    inputs, messages, flags = _chat_form(body) if "messages" in body else (_inputs(body), None, {})
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise bad(f"encoding_format must be 'float' or 'base64', got {fmt!r}", "encoding_format")
    dtype, order = body.get("embed_dtype", "float32"), body.get("endianness", "native")
    if dtype not in _EMBED_DTYPES:
        raise bad(f"embed_dtype must be one of {', '.join(_EMBED_DTYPES)}, got {dtype!r}", "embed_dtype")
    if order not in ("native", "big", "little"):
        raise bad(f"endianness must be 'native', 'big' or 'little', got {order!r}", "endianness")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad("user must be a string", "user")
    dims, activation = body.get("dimensions"), body.get("use_activation")
    if dims is not None and (not _is_int(dims) or dims < 1):
        raise bad(f"dimensions must be a positive integer, got {dims!r}", "dimensions")
    if activation is not None and not isinstance(activation, bool):
        raise bad(f"use_activation must be true or false, got {activation!r}", "use_activation")
    truncate = body.get("truncate_prompt_tokens")
    if truncate is not None and (not _is_int(truncate) or not (truncate == -1 or truncate >= 1)):
        raise bad(f"truncate_prompt_tokens must be -1 or a positive integer, got {truncate!r}", "truncate_prompt_tokens")
    special = body.get("add_special_tokens", messages is None)  # vLLM's defaults: the template writes them
    if not isinstance(special, bool):
        raise bad(f"add_special_tokens must be true or false, got {special!r}", "add_special_tokens")
    return EmbeddingRequest(model, inputs, messages, flags, fmt == "base64", dtype, order,
                            PoolingParams(dims, activation), truncate, special, checked_priority(body))


def _inputs(body: dict) -> list[str | list[int]]:
    """`input`: a string, token ids, or an array of either (OpenAI's forms), none of them empty."""
    chat_only = sorted(set(_CHAT_FIELDS) & set(body))
    if chat_only:
        raise bad(f"{chat_only[0]} applies to the chat form (messages) only", chat_only[0])
    raw = body.get("input")
    if isinstance(raw, str) or (isinstance(raw, list) and raw and all(_is_int(t) for t in raw)):
        inputs = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(x, str) or (isinstance(x, list) and all(_is_int(t) for t in x))
                                               for x in raw):
        inputs = list(raw)
    else:
        raise bad("input must be a string, an array of strings, an array of token ids or an array of such arrays, "
                  "and not empty", "input")
    if len(inputs) > _MAX_INPUTS:
        raise bad(f"input may hold at most {_MAX_INPUTS} items, got {len(inputs)}", "input")
    if any(len(x) == 0 for x in inputs):
        raise bad("input must not contain an empty string or an empty array of tokens", "input")
    return inputs


def _chat_form(body: dict) -> tuple[list, list[dict], dict]:
    """vLLM's chat form: no input, the conversations (one, or an array of them; text only) and the
    template's flags, checked."""
    if "input" in body:
        raise bad("give input or messages (vLLM's chat form), not both", "messages")
    flags = {name: body.get(name, False) for name in _CHAT_FIELDS[:2]}
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise bad(f"{name} must be true or false", name)
    if all(flags.values()):
        raise bad("add_generation_prompt and continue_final_message cannot both be true", "continue_final_message")
    flags["chat_template_kwargs"] = template_kwargs(body.get("chat_template_kwargs"))
    raw = body["messages"]
    batched = isinstance(raw, list) and bool(raw) and all(isinstance(c, list) for c in raw)
    if batched and len(raw) > _MAX_INPUTS:
        raise bad(f"messages may hold at most {_MAX_INPUTS} conversations, got {len(raw)}", "messages")
    return [], [parse_messages(c) for c in raw] if batched else [parse_messages(raw)], flags


def _render(m: ServedModel, conversation: list[dict], flags: dict) -> str:
    try:
        messages, extra = render_inputs(m.tokenizer.chat_template, conversation, None)
        return m.tokenizer.apply_chat_template(messages, add_generation_prompt=flags["add_generation_prompt"],
                                               continue_final_message=flags["continue_final_message"],
                                               **{**flags["chat_template_kwargs"], **extra})
    except (InvalidRequestError, ValueError) as e:
        raise bad(str(e), "messages") from e


def _prompts(m: ServedModel, req: EmbeddingRequest) -> list[list[int]]:
    inputs = req.inputs if req.messages is None else [_render(m, c, req.template_flags) for c in req.messages]
    prompts = [m.tokenizer.encode(x, add_special_tokens=req.add_special_tokens) if isinstance(x, str) else x
               for x in inputs]
    return checked_prompts(m, prompts, req.truncate_prompt_tokens, "input")


def checked_prompts(m: ServedModel, prompts: list[list[int]], truncate: int | None, param: str) -> list[list[int]]:
    """Each prompt's last `truncate` tokens (vLLM's truncate_prompt_tokens; -1: the context length),
    none empty, each shorter than the context."""
    if truncate is not None:
        prompts = [p[-(m.max_model_len if truncate == -1 else truncate):] for p in prompts]
    for p in prompts:
        if not p:
            raise bad("an input is empty once tokenized", param)
        if len(p) >= m.max_model_len:
            raise bad(f"This model's maximum context length is {m.max_model_len} tokens, but an input has {len(p)} "
                      "tokens (truncate_prompt_tokens keeps an input's last tokens).", param)
    return prompts


async def embed(request: web.Request, m: ServedModel, lora: str | None, prompts: list[list[int]],
                params: PoolingParams, priority: int, param: str) -> list[np.ndarray]:
    """The prompts' embeddings, admitted together (the request's tenant; `lora`: its adapter); a
    client that leaves aborts them. The engine's refusals are 400s naming `param` for the prompts."""
    stream = m.engine.generate(prompts, params, request_id=uuid.uuid4().hex, priority=priority,
                               tenant=request.get(TENANT), lora_request=lora)
    vectors: list[np.ndarray | None] = [None] * len(prompts)
    try:
        async with stream:
            async for batch in stream:
                for i, d in batch:
                    vectors[i] = d.embedding
    except InvalidRequestError as e:  # the engine's checks (no pooling runner, dimensions; too many inputs)
        raise bad(str(e), param if e.param in ("prompt", "n") else e.param) from e
    return vectors


def _encoded(vector: np.ndarray, req: EmbeddingRequest) -> list[float] | str:
    """OpenAI's forms: a list of floats, or base64 of the values' bytes (float32 in this machine's
    byte order, as OpenAI's client reads them; vLLM's embed_dtype and endianness choose others)."""
    if not req.base64:
        return vector.tolist()
    values = vector.astype(_EMBED_DTYPES[req.embed_dtype])
    if req.endianness not in ("native", sys.byteorder):
        values = values.byteswap()
    return base64.b64encode(values.tobytes()).decode()


async def embeddings(request: web.Request) -> web.Response:
    st = request.app[STATE]
    req = parse_embedding(await read_json(request))
    m, lora = served_model(st, req.model)
    prompts = _prompts(m, req)
    vectors = await embed(request, m, lora, prompts, req.params, req.priority, "input")
    tokens = sum(len(p) for p in prompts)
    return web.json_response({
        "id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
        "model": response_model(m, lora),
        "data": [{"index": i, "object": "embedding", "embedding": _encoded(v, req)}
                 for i, v in enumerate(vectors)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
