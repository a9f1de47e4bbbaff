"""`POST /v1/completions` and `POST /v1/chat/completions`: validate, tokenize, run, respond.

A prefill or decode worker's KV handoff is one step before the run and one after it, both in
server/kv_handoff.py (`request_handoff`), which also settles the hold a request claims.

Tokenizing happens here, on the event loop (the tokenizer is immutable and cheap next to a step),
so the engine thread only schedules and steps. The request is admitted before any byte of the
response is sent, so admission errors still get their 4xx status even when streaming.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
import uuid
from typing import Any, AsyncIterator, Callable, Mapping

from aiohttp import web

from infire_jax.engine.async_engine import AsyncEngine, RequestStream
from infire_jax.engine.detokenizer import TokenText
from infire_jax.engine.images import images_digest
from infire_jax.errors import InvalidRequestError
from infire_jax.lora.request import LoRARequest
from infire_jax.structured import StructuredOutputs, harmony
from infire_jax.structured.backend import CompiledGrammar, GrammarCompileError
from infire_jax.structured.reasoning_parsers import reasoning_grammar, reasoning_markers
from infire_jax.structured.tool_grammar import FORCEABLE_FORMATS, MARKERS, tool_call_constraint
from infire_jax.structured.tool_parsers import HERMES, LLAMA3_JSON
from infire_jax.structured.tool_prompt import render_inputs
from infire_jax.loaders.tokenizer import Tokenizer
from infire_jax.vision import preprocess
from infire_jax.vision import prompt as image_placeholders
from server import beam_search
from server.auth import TENANT, salted_tenant
from server.errors import APIError, to_api_error
from server.kv_handoff import KVHandoff, RequestHandoff, request_handoff
from server.media import MediaPolicy, image_bytes
from server.protocol import ChatRequest, GenerationRequest, bad, parse_chat, parse_completion
from server.responses import ChatFormatter, Choice, CompletionFormatter, Formatter, Usage
from server.streaming import SSEWriter

PREFIX_HEADER = "x-prefix-tokens"
SESSION_HEADER = "x-session-affinity"
_MAX_SESSION_LEN = 256


@dataclasses.dataclass
class ServedModel:
    """One model the server serves: its engine thread and what requests are validated against."""

    engine: AsyncEngine
    tokenizer: Tokenizer
    token_text: TokenText
    name: str  # the first of its served names: responses carry it
    max_model_len: int
    aliases: tuple[str, ...] = ()  # its other served names (--served-model-name NAME NAME ...), accepted alike
    # LoRA adapters served over it, by name (server/lora.py); changed on the event loop only.
    adapters: dict[str, LoRARequest] = dataclasses.field(default_factory=dict)
    loading: set[str] = dataclasses.field(default_factory=set)  # names of adapters being loaded
    tool_parser: str = HERMES  # the call format of its outputs (--tool-call-parser, else its chat template's)
    reasoning_parser: str | None = None  # --reasoning-parser; None: its outputs are all answer
    # its generation config's sampling defaults (vLLM's --generation-config; sample/generation_config.py)
    sampling_defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class ServerState:
    """What the handlers need, fixed when the app is built."""

    models: dict[str, ServedModel]  # by served name; several with hot standby (infire_jax/engine/residency.py)
    role: str = "both"  # prefill, decode or both (server/kv_handoff.py)
    handoff: KVHandoff | None = None  # the KV transfer of a prefill or decode worker
    media: MediaPolicy = MediaPolicy()  # where chat images may come from (server/media.py)
    response_role: str = "assistant"  # vLLM's --response-role: chat answers' role after a generation prompt
    tokens_as_ids: bool = False  # vLLM's --return-tokens-as-token-ids: every request's default


STATE = web.AppKey("state", ServerState)


async def completions(request: web.Request) -> web.StreamResponse:
    st = request.app[STATE]
    body = await read_json(request)
    with request_handoff(st.handoff, request, body) as kv:
        return await _completions(request, st, body, kv)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    st = request.app[STATE]
    body = await read_json(request)
    with request_handoff(st.handoff, request, body) as kv:
        return await _chat_completions(request, st, body, kv)


async def _completions(request: web.Request, st: ServerState, body, kv: RequestHandoff) -> web.StreamResponse:
    req = parse_completion(body, sampling_defaults(st, body))
    m, lora = served_model(st, req.model)
    given = [m.tokenizer.encode(p, req.add_special_tokens) if isinstance(p, str) else p for p in req.prompts]
    if any(not ids for ids in given):
        raise bad("the prompt is empty", "prompt")
    prompts = _truncated(m, req, given)
    _check_length(m, prompts, "prompt")

    def formatter() -> CompletionFormatter:  # after admission: token-id prompts are known to be valid
        echo = [p if isinstance(p, str) and len(ids) == len(full) else m.tokenizer.decode(ids)
                for p, full, ids in zip(req.prompts, given, prompts)] if req.echo else None
        echo_logprobs = req.echo and req.params.logprobs is not None
        return CompletionFormatter(f"cmpl-{uuid.uuid4().hex}", response_model(m, lora), m.token_text, echo_texts=echo,
                                   echo_ids=prompts if echo_logprobs else None, top=req.params.logprobs or 0,
                                   n=req.params.n,
                                   want_logprobs=req.params.logprobs is not None, include_usage=req.include_usage,
                                   tokens_as_ids=req.tokens_as_ids or st.tokens_as_ids,
                                   prompt_logprobs=req.prompt_logprobs)

    return await _run(request, kv, m, lora, req, prompts, formatter, "prompt")


async def _chat_completions(request: web.Request, st: ServerState, body, kv: RequestHandoff) -> web.StreamResponse:
    req = parse_chat(body, sampling_defaults(st, body))
    m, lora = served_model(st, req.model)
    tiles = await image_tiles(st, m, req) if req.images else None
    prompts = await chat_prompt(m, req, "messages", tiles)

    def formatter() -> ChatFormatter:
        return ChatFormatter(f"chatcmpl-{uuid.uuid4().hex}", response_model(m, lora), m.token_text,
                             top_logprobs=req.top_logprobs or 0, want_logprobs=req.top_logprobs is not None,
                             include_usage=req.include_usage, tool_format=m.tool_parser if req.tools else None,
                             tools=req.tools.tools if req.tools else None, reasoning_parser=m.reasoning_parser,
                             chat_template_kwargs=req.chat_template_kwargs,
                             tokens_as_ids=req.tokens_as_ids or st.tokens_as_ids, prompt_logprobs=req.prompt_logprobs,
                             echo_text=req.echo_text,
                             role=st.response_role if req.add_generation_prompt else "assistant")

    return await _run(request, kv, m, lora, req, prompts, formatter, "messages", tiles)


async def image_tiles(st: ServerState, m: ServedModel, req: ChatRequest) -> list[preprocess.Tiles]:
    """The request's images fetched (server/media.py), decoded and cut into the model's tiles, off the
    event loop; a 400 naming the part for any that cannot be, or where the model takes no images."""
    images = m.engine.engine.images
    if images is None:
        raise bad(f"the model {m.name!r} takes no images (a Llama 4 or Gemma 3 checkpoint with a vision tower does)",
                  req.images[0][1])
    if len(req.images) > images.limit:
        raise bad(f"{len(req.images)} images in one request; at most {images.limit} (--limit-mm-per-prompt)",
                  "messages")
    out = []
    for url, param in req.images:
        data = await image_bytes(url, st.media, param)
        try:
            out.append(await asyncio.to_thread(lambda d=data: images.tiles(preprocess.decode(d))))
        except InvalidRequestError as e:
            raise bad(str(e), param) from e
    return out


async def chat_prompt(m: ServedModel, req: ChatRequest, param: str,
                      tiles: list[preprocess.Tiles] | None = None) -> list[list[int]]:
    """The prompt of a chat request (the chat API's and the Responses API's): its messages and tools
    through the chat template, as token ids, each image's marker expanded for its `tiles`; its tools'
    schemas checked and forced calls constrained. `param`: the field errors in the messages are named after."""
    text = chat_text(m, req, param, tiles)
    prompts = _truncated(m, req, [m.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)])
    _check_length(m, prompts, param)
    if harmony.is_harmony(m.tokenizer.chat_template):
        _harmony_stops(m, req)
    if req.tools is not None:
        await _force_tool_calls(m, req, m.tool_parser)
    _reasoning(m, req)
    return prompts


def chat_text(m: ServedModel, req: ChatRequest, param: str, tiles: list[preprocess.Tiles] | None = None) -> str:
    """A chat request's messages and tools through the chat template (each image's marker expanded for
    its `tiles`); a template's error is a 400 naming `param`."""
    try:
        messages, extra = render_inputs(m.tokenizer.chat_template, req.messages,
                                        req.tools.tools if req.tools else None)
        text = m.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                               continue_final_message=req.continue_final_message,
                                               **req.chat_template_kwargs, **extra)
        if tiles:  # string content carries our marker; a template taking parts writes the model's own
            at = image_placeholders.IMAGE if m.tokenizer.content_format == "string" else None
            text = m.engine.engine.images.expand(text, tiles, at=at)
    except (InvalidRequestError, ValueError) as e:
        raise bad(str(e), param) from e
    return text


def _harmony_stops(m: ServedModel, req: ChatRequest) -> None:
    """A harmony output ends at `<|return|>` (answered) or `<|call|>` (a tool called), whatever the
    model's config lists as its end tokens."""
    ids = [i for i in (m.tokenizer.special_token_id(t) for t in harmony.STOP_TOKENS) if i is not None]
    stops = list(dict.fromkeys([*req.params.stop_token_ids, *ids]))
    req.params = dataclasses.replace(req.params, stop_token_ids=stops)


def _reasoning(m: ServedModel, req: ChatRequest) -> None:
    """While the request may think: its markers that are special tokens stay in the decoded text, for
    the reasoning parser to find; and a constraint on the answer (response_format, a forced
    tool_choice) starts where the reasoning ends, the grammar letting the reasoning through first.
    vLLM's `structured_outputs` is not an answer's constraint: it constrains the whole output, the
    reasoning included."""
    markers = reasoning_markers(m.reasoning_parser, req.chat_template_kwargs) if m.reasoning_parser else ()
    if not markers:
        return
    ids = {marker: m.tokenizer.added_token_id(marker) for marker in markers}  # the grammar names these by id
    changes = {}
    if any(m.tokenizer.special_token_id(marker) is not None for marker in markers):
        changes["skip_special_tokens"] = False
    so = req.params.structured_outputs
    if m.reasoning_parser == harmony.REASONING_PARSER:  # a forced call's grammar lets the analysis through itself
        if so is not None and req.response_format is not None:
            changes["structured_outputs"] = dataclasses.replace(so, after=harmony.answer_grammar(ids))
    elif so is not None and (req.response_format is not None or (req.tools is not None and req.tools.forced)):
        after = reasoning_grammar(m.reasoning_parser, req.chat_template_kwargs, ids)
        changes["structured_outputs"] = dataclasses.replace(so, after=after)
    req.params = dataclasses.replace(req.params, **changes)


async def _force_tool_calls(m: ServedModel, req: ChatRequest, tool_format: str) -> None:
    """Checks every tool's parameter schema, and with a forced `tool_choice` constrains the output to
    calls in the model's format. Markers such as Mistral's `[TOOL_CALLS]` or Kimi's and DeepSeek's
    section tokens are special tokens: kept in the text for the parser, and written as those tokens in
    a forced call's grammar."""
    for i, t in enumerate(req.tools.tools):
        if "parameters" in t["function"]:
            await _compile(m, StructuredOutputs(json=t["function"]["parameters"],
                                                param=f"tools[{i}].function.parameters"))
    changes = {}
    if tool_format not in (HERMES, LLAMA3_JSON):  # the others' markers are special tokens: keep them in the text
        changes["skip_special_tokens"] = False
    if req.tools.forced and tool_format not in FORCEABLE_FORMATS:
        raise bad(f"tool_choice {req.tools.choice!r} cannot be forced for the {tool_format} tool-call format "
                  f"yet (forced calls exist for {', '.join(FORCEABLE_FORMATS)}); use tool_choice \"auto\"",
                  "tool_choice")
    if req.tools.forced:
        changes["structured_outputs"] = tool_call_constraint(
            tool_format, req.tools.forced_functions(), parallel=req.tools.forced_many,
            special_token_ids={mark: m.tokenizer.added_token_id(mark) for mark in MARKERS.get(tool_format, ())})
    req.params = dataclasses.replace(req.params, **changes)


async def _compile(m: ServedModel, spec: StructuredOutputs) -> CompiledGrammar:
    """On the default executor: a grammar never compiles on the event loop or the engine thread."""
    try:
        return await asyncio.get_running_loop().run_in_executor(None, m.engine.engine.grammars.compile, spec)
    except GrammarCompileError as e:  # a cached failure names the field of the request that first compiled it
        raise GrammarCompileError(str(e), spec.field_param) from e


# ---- shared steps ---------------------------------------------------------------------------------
def sampling_defaults(st: ServerState, body: Any) -> Mapping[str, Any]:
    """The sampling defaults of the model a body names (an adapter's: its base model's; no name: the
    only model served); none for a name not served, which `served_model` refuses once the body is read."""
    name = body.get("model") if isinstance(body, dict) else None
    m = _named(st, name)[0] if name is None or isinstance(name, str) else None
    return m.sampling_defaults if m is not None else {}


def _named(st: ServerState, model: str | None) -> tuple[ServedModel | None, str | None]:
    """The served model a name selects (None: none does), and the LoRA adapter it names (None: the model).
    No name (None or ""), as vLLM takes it, selects the served model, where there is only one."""
    if not model:
        return (next(iter(st.models.values())) if len(st.models) == 1 else None), None
    m = st.models.get(model) or next((x for x in st.models.values() if model in x.aliases), None)
    if m is not None:
        return m, None
    return next((x for x in st.models.values() if model in x.adapters), None), model


def served_model(st: ServerState, model: object) -> tuple[ServedModel, str | None]:
    """The requested model, if it is served and its engine runs, and the LoRA adapter the name
    selects (None: the model itself). A request naming none gets the only model served, as on vLLM
    (whose server serves one); a server of several asks it to name one. Every endpoint's `model`
    is checked here: a value that is not a string is a 400."""
    if model is not None and not isinstance(model, str):
        raise bad("'model' must be a string (a served model's name)", "model")
    m, lora = _named(st, model)
    if m is None and not model:
        raise bad(f"this server serves {len(st.models)} models: name one in 'model'", "model")
    if m is None:
        names = ", ".join(f"`{n}`" for x in st.models.values() for n in (x.name, *x.aliases, *x.adapters))
        raise APIError(404, f"The model `{model}` does not exist; this server serves {names}.",
                       param="model", code="model_not_found")
    if not m.engine.healthy:
        raise APIError(503, "the engine is not running; the server cannot generate", type="server_error",
                       code="engine_unavailable")
    return m, lora


def response_model(m: ServedModel, lora: str | None) -> str:
    """The model a response names: the adapter asked for, else the model's first served name (as vLLM
    answers a request naming any of them)."""
    return lora or m.name


def _no_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


# Where a body may hold a lone surrogate: a \uD800-\uDFFF escape, or its bytes (json.loads reads them).
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


async def read_json(request: web.Request):
    raw = await request.read()
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # also UnicodeDecodeError, JSONDecodeError and deep nesting
        reason = "it is nested too deeply" if isinstance(e, RecursionError) else e
        raise bad(f"We could not parse the JSON body of your request ({reason}). The body must be a JSON "
                  "object.") from e
    if _SURROGATE.search(raw):
        _check_unicode(body)
    return body


def _check_unicode(body) -> None:
    """400 naming a string of `body` that holds a lone UTF-16 surrogate: JSON lets a body escape one, but
    it is no character, and no tokenizer, template or grammar takes it."""
    stack = [(body, None)]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise bad(f"{path or 'the request body'} is not valid Unicode text: it holds a lone surrogate "
                          f"(U+{ord(value[e.start]):04X}) at character {e.start}", param=path) from None
        elif isinstance(value, dict):
            for key, item in value.items():
                stack.append((key, path))
                stack.append((item, key if path is None else f"{path}.{key}"))
        elif isinstance(value, list):
            stack.extend((item, f"{path or ''}[{i}]") for i, item in enumerate(value))


def _truncated(m: ServedModel, req: GenerationRequest, prompts: list[list[int]]) -> list[list[int]]:
    """vLLM's `truncate_prompt_tokens`: each prompt's last k tokens (-1: the model's context length)."""
    k = req.truncate_prompt_tokens
    if k is None:
        return prompts
    k = m.max_model_len if k == -1 else k
    return [p[-k:] for p in prompts]


def _check_length(m: ServedModel, prompts: list[list[int]], param: str) -> None:
    for ids in prompts:
        if len(ids) >= m.max_model_len:
            raise APIError(400, f"This model's maximum context length is {m.max_model_len} tokens, but the "
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


@contextlib.asynccontextmanager
async def admitted(request: web.Request, kv: RequestHandoff, m: ServedModel, lora: str | None,
                   req: GenerationRequest, prompts: list[list[int]], prompt_param: str,
                   images: list[preprocess.Tiles] | None = None) -> AsyncIterator[RequestStream]:
    """The request's stream once the engine admitted it (with the LoRA adapter `lora`; `kv`: its KV
    handoff before it runs). Leaving the block early (a disconnect cancels the handler) aborts it."""
    hint, session = _headers(request, prompts)
    tenant = request.get(TENANT)
    if req.cache_salt is not None and req.kv_transfer is not None:
        raise bad("'cache_salt' cannot be used with 'kv_transfer_params' (a salted prompt is computed where it "
                  "runs)", "cache_salt")
    await kv.before(req.kv_transfer, prompts, tenant, stream=req.stream, lora_name=lora,
                    image_digest=images_digest(images) if images else None)
    spec = req.params.structured_outputs
    grammar = await _compile(m, spec) if spec is not None else None
    stream = m.engine.generate(prompts, req.params, request_id=uuid.uuid4().hex, priority=req.priority,
                                tenant=salted_tenant(tenant, req.cache_salt), prefix_hint_tokens=hint,
                                session_id=session, grammar=grammar, lora_request=lora, images=images)
    try:
        async with stream:
            yield stream
    except InvalidRequestError as e:  # the engine's admission checks; name the field the client sent
        named = {"prompt": prompt_param, "prompt_logprobs": "prompt_logprobs" if req.prompt_logprobs is not None
                 else "logprobs"}  # echo with logprobs asks for them otherwise
        raise bad(str(e), named.get(e.param, e.param)) from e


async def _run(request: web.Request, kv: RequestHandoff, m: ServedModel, lora: str | None,
               req: GenerationRequest, prompts: list[list[int]], make_formatter: Callable[[], Formatter],
               prompt_param: str, images: list[preprocess.Tiles] | None = None) -> web.StreamResponse:
    """Admits the request, then answers it whole or as a stream (`kv`: its KV handoff, before and after).
    A beam search runs as requests of its own (server/beam_search.py)."""
    if req.beam_search:
        if images:
            raise bad("images cannot be used with 'use_beam_search'", "messages")
        return await beam_search.respond(request, m, lora, req, prompts, make_formatter)
    async with admitted(request, kv, m, lora, req, prompts, prompt_param, images) as stream:
        usage = Usage([len(p) for p in prompts])
        if req.stream:
            return await _stream(request, req, stream, make_formatter(), usage, len(prompts))
        choices = await _collect(req, stream, usage, len(prompts))
    return await kv.answer(make_formatter().response(choices, usage), choices[0])


async def _collect(req: GenerationRequest, stream: RequestStream, usage: Usage, num_prompts: int) -> list[Choice]:
    n = req.params.n
    choices = [Choice() for _ in range(num_prompts * n)]
    async for batch in stream:
        for pi, d in batch:
            usage.add(pi, d)
            choices[pi * n + d.index].add(d)
    return choices


async def release_kv(request: web.Request) -> web.Response:
    """`POST /v1/kv_transfer/release`: a decode worker fetched a hold, or the router gives it up (the decode failed)."""
    st = request.app[STATE]
    if st.handoff is None or st.role != "prefill":
        raise APIError(404, f"this worker's role is {st.role}; only prefill workers hold KV", code="not_found")
    body = await read_json(request)
    transfer_id = body.get("transfer_id") if isinstance(body, dict) else None
    if not isinstance(transfer_id, str):
        raise bad("the body must be {\"transfer_id\": \"...\"}", "transfer_id")
    if not st.handoff.release(transfer_id, request.get(TENANT)):
        raise APIError(404, f"no live KV hold {transfer_id!r} for this tenant (it expired or was released)",
                       param="transfer_id", code="kv_hold_not_found")
    return web.json_response({"released": True})


async def _stream(request: web.Request, req: GenerationRequest, stream: RequestStream, fmt: Formatter, usage: Usage,
                  num_prompts: int) -> web.StreamResponse:
    n = req.params.n
    sse = SSEWriter(request)
    try:
        await sse.start()  # the client may already have gone
        try:
            head = fmt.head_chunks(num_prompts * n)
            if req.continuous_usage:
                for i, chunk in enumerate(head):
                    chunk["usage"] = usage.choice_dict(i // n, i % n)
            await sse.send(head)
            async for batch in stream:
                chunks = []
                for pi, d in batch:
                    usage.add(pi, d)
                    new = fmt.chunks(pi * n + d.index, d)
                    if req.continuous_usage:
                        for chunk in new:
                            chunk["usage"] = usage.choice_dict(pi, d.index)
                    chunks += new
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
