"""`POST /v1/completions` and `POST /v1/chat/completions`: validate, tokenize, run, respond.

Tokenizing happens here, on the event loop (the tokenizer is immutable and cheap next to a step),
so the engine thread only schedules and steps. The request is admitted before any byte of the
response is sent, so admission errors still get their 4xx status even when streaming.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Callable

from aiohttp import web

from infire_jax.async_engine import AsyncEngine, RequestStream
from infire_jax.errors import InvalidRequestError
from infire_jax.tokenizer import Tokenizer
from server.auth import TENANT
from server.errors import APIError, to_api_error
from server.protocol import GenerationRequest, bad, parse_chat, parse_completion
from server.responses import ChatFormatter, Choice, CompletionFormatter, Formatter, TokenText, Usage
from server.streaming import SSEWriter

PREFIX_HEADER = "x-prefix-tokens"
SESSION_HEADER = "x-session-affinity"
_MAX_SESSION_LEN = 256


@dataclasses.dataclass
class ServerState:
    """What the handlers need, fixed when the app is built."""

    engine: AsyncEngine
    tokenizer: Tokenizer
    token_text: TokenText
    model_name: str
    max_model_len: int


STATE = web.AppKey("state", ServerState)


async def completions(request: web.Request) -> web.StreamResponse:
    st = _ready(request)
    req = parse_completion(await _json(request))
    _check_model(st, req)
    prompts = [st.tokenizer.encode(p) if isinstance(p, str) else p for p in req.prompts]
    if any(not ids for ids in prompts):
        raise bad("the prompt is empty", "prompt")
    _check_length(st, prompts, "prompt")

    def formatter() -> CompletionFormatter:  # after admission: token-id prompts are known to be valid
        echo = [p if isinstance(p, str) else st.tokenizer.decode(p) for p in req.prompts] if req.echo else None
        return CompletionFormatter(f"cmpl-{uuid.uuid4().hex}", st.model_name, st.token_text, echo_texts=echo,
                                   n=req.params.n, want_logprobs=req.params.logprobs is not None,
                                   include_usage=req.include_usage)

    return await _run(request, st, req, prompts, formatter, "prompt")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    st = _ready(request)
    req = parse_chat(await _json(request))
    _check_model(st, req)
    try:
        text = st.tokenizer.apply_chat_template(req.messages, add_generation_prompt=True)
    except InvalidRequestError as e:
        raise bad(str(e), "messages") from e
    prompts = [st.tokenizer.encode(text, add_special_tokens=False)]
    _check_length(st, prompts, "messages")

    def formatter() -> ChatFormatter:
        return ChatFormatter(f"chatcmpl-{uuid.uuid4().hex}", st.model_name, st.token_text,
                             top_logprobs=req.top_logprobs or 0, want_logprobs=req.top_logprobs is not None,
                             include_usage=req.include_usage)

    return await _run(request, st, req, prompts, formatter, "messages")


# ---- shared steps ---------------------------------------------------------------------------------
def _ready(request: web.Request) -> ServerState:
    st = request.app[STATE]
    if not st.engine.healthy:
        raise APIError(503, "the engine is not running; the server cannot generate", type="server_error",
                       code="engine_unavailable")
    return st


def _no_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


async def _json(request: web.Request):
    try:
        return json.loads(await request.read(), parse_constant=_no_constant)
    except ValueError as e:  # also UnicodeDecodeError and JSONDecodeError
        raise bad(f"We could not parse the JSON body of your request ({e}). The body must be a JSON object.") from e


def _check_model(st: ServerState, req: GenerationRequest) -> None:
    if req.model != st.model_name:
        raise APIError(404, f"The model `{req.model}` does not exist; this server serves `{st.model_name}`.",
                       param="model", code="model_not_found")


def _check_length(st: ServerState, prompts: list[list[int]], param: str) -> None:
    for ids in prompts:
        if len(ids) >= st.max_model_len:
            raise APIError(400, f"This model's maximum context length is {st.max_model_len} tokens, but the "
                                f"{param} has {len(ids)} tokens (at least one token must be left to generate).",
                           param=param, code="context_length_exceeded")


def _headers(request: web.Request, prompts: list[list[int]]) -> tuple[int, str | None]:
    """The prefix hint (clamped to each prompt, so a hint never exceeds it) and the session id."""
    raw = request.headers.get(PREFIX_HEADER)
    hint = 0
    if raw is not None:
        if not (raw.isascii() and raw.isdigit()):
            raise bad(f"the {PREFIX_HEADER} header must be a non-negative integer, got {raw!r}")
        hint = min(int(raw), max(len(p) for p in prompts))
    session = request.headers.get(SESSION_HEADER)
    if session is not None and not 0 < len(session) <= _MAX_SESSION_LEN:
        raise bad(f"the {SESSION_HEADER} header must be 1 to {_MAX_SESSION_LEN} characters")
    return hint, session


async def _run(request: web.Request, st: ServerState, req: GenerationRequest, prompts: list[list[int]],
               make_formatter: Callable[[], Formatter], prompt_param: str) -> web.StreamResponse:
    """Admits the request, then answers it whole or as a stream."""
    hint, session = _headers(request, prompts)
    stream = st.engine.generate(prompts, req.params, request_id=uuid.uuid4().hex, priority=req.priority,
                                tenant=request.get(TENANT), prefix_hint_tokens=hint, session_id=session)
    try:
        async with stream:  # admits the request; leaving early (a disconnect) aborts it
            usage = Usage([len(p) for p in prompts])
            if req.stream:
                return await _stream(request, req, stream, make_formatter(), usage, len(prompts))
            return await _collect(req, stream, make_formatter(), usage, len(prompts))
    except InvalidRequestError as e:  # the engine's admission checks; name the field the client sent
        raise bad(str(e), prompt_param if e.param == "prompt" else e.param) from e


async def _collect(req: GenerationRequest, stream: RequestStream, fmt: Formatter, usage: Usage,
                   num_prompts: int) -> web.Response:
    n = req.params.n
    choices = [Choice() for _ in range(num_prompts * n)]
    async for batch in stream:
        for pi, d in batch:
            usage.add(pi, d)
            choices[pi * n + d.index].add(d)
    return web.json_response(fmt.response(choices, usage))


async def _stream(request: web.Request, req: GenerationRequest, stream: RequestStream, fmt: Formatter, usage: Usage,
                  num_prompts: int) -> web.StreamResponse:
    n = req.params.n
    sse = SSEWriter(request)
    await sse.start()
    try:
        try:
            await sse.send(fmt.head_chunks(num_prompts * n))
            async for batch in stream:
                chunks = []
                for pi, d in batch:
                    usage.add(pi, d)
                    chunk = fmt.chunk(pi * n + d.index, d)
                    if chunk is not None:
                        chunks.append(chunk)
                await sse.send(chunks)
            if req.include_usage:
                await sse.send([fmt.usage_chunk(usage)])
        except ConnectionResetError:
            raise
        except Exception as e:  # noqa: BLE001 - the headers are sent: report the failure in the stream
            await sse.send([to_api_error(e).body()])
        await sse.done()
    except ConnectionResetError:
        pass  # the client went away; the caller's `async with` aborts the request
    return sse.response
