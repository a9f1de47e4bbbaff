"""The aiohttp application: routes, middlewares, start-up and shut-down, and `serve(args)` for the CLI.

Threads: the event loop (HTTP, tokenization, response building) and the engine thread (scheduling
and device steps, see infire_jax.engine.async_engine). Nothing on the event loop waits for the device.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import ssl
import sys
import time
from typing import Mapping, Sequence

import jinja2
from aiohttp import web

from infire_jax import __version__
from infire_jax.engine.async_engine import AsyncEngine
from infire_jax.engine.detokenizer import TokenText
from infire_jax.engine.engine import Engine
from infire_jax.engine.args import engine_config, init_distributed, progress_bar
from infire_jax.engine.residency import Residency, host_to_device_bandwidth, start_engines
from infire_jax.structured import harmony
from infire_jax.structured.reasoning_parsers import REASONING_PARSER_NAMES
from infire_jax.structured.tool_parsers import TOOL_PARSER_NAMES, detect_format
from server import responses_api
from server.embeddings import embeddings
from server.scoring import rerank, score
from server.auth import AUTH, Auth, auth_middleware, parse_api_keys
from server.cors import CORS, CorsPolicy, cors_headers, cors_middleware
from server.endpoints import (SESSION_HEADER, STATE, ServedModel, ServerState, chat_completions, completions,
                              release_kv)
from server.errors import error_middleware
from server.listen import bind, serve_until_signal
from server.media import MediaPolicy
from server.kv_handoff import KV_PULLED, RELEASE_PATH, ROLES, KVHandoff
from server.lora import add_static, load_lora_adapter, model_cards, parse_lora_modules, unload_lora_adapter
from server.metrics import CONTENT_TYPE, ServerMetrics
from server.tokenize import detokenize, tokenize, tokenizer_info

METRICS = web.AppKey("metrics", ServerMetrics)
_MAX_BODY = 64 << 20  # bytes; prompts of token ids are large


def _default_reasoning(chat_template: str | None) -> str | None:
    """Harmony's channels are always read (as vLLM serves gpt-oss): its raw output is no answer."""
    return harmony.REASONING_PARSER if harmony.is_harmony(chat_template) else None


def build_app(engines: Engine | Sequence[Engine], *, model_names: Sequence[str] | None = None,
              aliases: Mapping[str, Sequence[str]] | None = None, api_keys: dict[str, str] | None = None,
              max_queue: int = 1024, role: str = "both",
              kv_buffer_bytes: int = 512 << 20, kv_host: str = "127.0.0.1", kv_hold_seconds: float = 30.0,
              residency: Residency | None = None, host_to_device_bytes_per_second: float = 0.0,
              lora_modules: Sequence[tuple[str, str]] = (), tool_call_parser: str | None = None,
              reasoning_parser: str | None = None, chat_template: str | None = None, content_format: str = "auto",
              media: MediaPolicy | None = None, root_path: str | None = None, cors: CorsPolicy | None = None,
              response_role: str = "assistant", tokens_as_ids: bool = False) -> web.Application:
    """The app over warmed-up engines (one per served model); their threads start with the app.
    `aliases`: a model's other names by its name (requests may name any; responses carry its name).
    `lora_modules` (name, path) are LoRA adapters loaded now over the engine that has LoRA enabled.
    `tool_call_parser` and `reasoning_parser` (vLLM's names) read every model's outputs (default: the
    call format its chat template shows, and no reasoning unless it writes harmony); `chat_template`
    (Jinja text) replaces every model's own; `content_format` is what it takes as a message's content
    (loaders/chat_content.py). `media` says where chat images may come from (server/media.py).
    vLLM's server flags: `root_path` (every route also under it), `cors` (browsers on other origins),
    `response_role` (chat answers' role) and `tokens_as_ids` (every request's return_tokens_as_token_ids).

    Several engines share the device through `residency` (hot standby, infire_jax/engine/residency.py).
    A prefill or decode worker (`role`) serves one model and also runs a Mooncake transfer engine
    with a staging buffer of `kv_buffer_bytes` on `kv_host`, whose holds expire after `kv_hold_seconds`.
    """
    engines = list(engines) if isinstance(engines, (list, tuple)) else [engines]
    names = list(model_names or [e.model_name for e in engines])
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    aliases = {name: tuple(aliases.get(name, ())) for name in names} if aliases else {}
    every = [*names, *(a for more in aliases.values() for a in more)]
    if len(names) != len(engines) or len(set(every)) != len(every):
        raise ValueError(f"each engine needs its own served model names, got {names} and aliases {aliases}")
    if role != "both" and len(engines) > 1:
        raise ValueError("a prefill or decode worker serves one model")
    if len(engines) > 1 and residency is None:
        raise ValueError("several models share the device through a Residency")
    if tool_call_parser is not None and tool_call_parser not in TOOL_PARSER_NAMES:
        raise ValueError(f"unknown tool-call parser {tool_call_parser!r}; known: {', '.join(TOOL_PARSER_NAMES)}")
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSER_NAMES:
        raise ValueError(f"unknown reasoning parser {reasoning_parser!r}; known: {', '.join(REASONING_PARSER_NAMES)}")
    metrics = ServerMetrics(names)
    models = {}
    for name, engine in zip(names, engines):
        async_engine = AsyncEngine(engine, max_queue=max_queue, observer=metrics.observer(name), residency=residency,
                                   name=name)
        metrics.track_engine(name, lambda a=async_engine: a.snapshot, engine.pool_sizing)
        tokenizer = engine.tokenizer
        if chat_template is not None or content_format != "auto":  # the server's copy; offline keeps the model's
            tokenizer = tokenizer.with_chat_template(chat_template, content_format)
        models[name] = ServedModel(async_engine, tokenizer, TokenText(engine.tokenizer), name, engine.max_model_len,
                                   aliases=aliases.get(name, ()),
                                   tool_parser=tool_call_parser or detect_format(tokenizer.chat_template),
                                   reasoning_parser=reasoning_parser or _default_reasoning(tokenizer.chat_template),
                                   sampling_defaults=engine.sampling_defaults)
    if residency is not None:
        metrics.track_residency(residency, host_to_device_bytes_per_second)
    handoff = None
    if role != "both":
        handoff = KVHandoff(models[names[0]].engine, role, buffer_bytes=kv_buffer_bytes, host=kv_host,
                            hold_seconds=kv_hold_seconds, metrics=metrics)
        metrics.track_holds(lambda: handoff.num_holds, lambda: handoff.free_bytes)

    if lora_modules:
        lora_engines = [m for m in models.values() if m.engine.engine.lora is not None]
        if len(lora_engines) != 1:
            raise ValueError("LoRA modules need exactly one served model with LoRA enabled (--enable-lora)")
        add_static(lora_engines[0], list(lora_modules))

    app = web.Application(middlewares=[cors_middleware, error_middleware, auth_middleware], client_max_size=_MAX_BODY)
    app[STATE] = ServerState(models=models, role=role, handoff=handoff, media=media or MediaPolicy(),
                             response_role=response_role, tokens_as_ids=tokens_as_ids)
    if cors is not None:
        app[CORS] = cors
    app[AUTH] = Auth(api_keys or {})
    app[METRICS] = metrics
    app[responses_api.STORE] = responses_api.ResponseStore()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/responses", responses_api.create)
    app.router.add_post("/v1/embeddings", embeddings)
    for path in ("/score", "/v1/score"):  # vLLM's scoring API (server/scoring.py)
        app.router.add_post(path, score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.router.add_post(path, rerank)
    app.router.add_get("/v1/responses/{response_id}", responses_api.retrieve)
    app.router.add_post(RELEASE_PATH, release_kv)
    app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/tokenize", tokenize)  # vLLM's tokenizer endpoints (server/tokenize.py)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/tokenizer_info", tokenizer_info)
    app.router.add_get("/health", _health)
    for method in ("GET", "POST"):  # vLLM's (SageMaker's health check): /health's answer
        app.router.add_route(method, "/ping", _health)
    app.router.add_get("/version", _version)
    app.router.add_get("/metrics", _metrics)
    if root_path:  # vLLM's --root-path: a proxy that keeps the prefix reaches the same routes
        for route in list(app.router.routes()):
            app.router.add_route(route.method, root_path + route.resource.canonical, route.handler)
    app.on_response_prepare.append(_routing_headers)
    app.on_response_prepare.append(cors_headers)
    app.on_startup.append(_start_engine)
    app.on_cleanup.append(_stop_engine)
    return app


async def _start_engine(app: web.Application) -> None:
    st = app[STATE]
    for m in st.models.values():
        m.engine.start()
    if st.handoff is not None:
        await st.handoff.start()


async def _stop_engine(app: web.Application) -> None:
    st = app[STATE]
    if st.handoff is not None:
        await st.handoff.stop()
    for m in st.models.values():
        await m.engine.shutdown()
    # The app may outlive its server (aiohttp caches each app's middleware chain, keyed by the app):
    # it lets go of the engines, so that their weights and pools go with their owners.
    st.models.clear()
    st.handoff = None
    app[METRICS].release()


async def _routing_headers(request: web.Request, response: web.StreamResponse) -> None:
    """Echoes the session-affinity header (the router's routing key) and reports a KV import."""
    session = request.headers.get(SESSION_HEADER)
    if session is not None:
        response.headers[SESSION_HEADER] = session
    if KV_PULLED in request:
        pulled = request[KV_PULLED]
        response.headers["x-infire-kv-transfer"] = "imported" if pulled is not None else "failed"
        if pulled is not None:
            response.headers["x-infire-kv-bytes"] = str(pulled.num_bytes)
            response.headers["x-infire-kv-seconds"] = f"{pulled.seconds:.6f}"


async def _models(request: web.Request) -> web.Response:
    """The served models, each of its names (`root`: its first, the name responses carry), then each
    one's LoRA adapters (`parent`: the model)."""
    created = int(time.time())
    models = request.app[STATE].models.values()
    return web.json_response({"object": "list", "data": [
        {"id": name, "object": "model", "created": created, "owned_by": "infire-jax", "root": m.name,
         "parent": None, "max_model_len": m.max_model_len} for m in models for name in (m.name, *m.aliases)] + [
        card for m in models for card in model_cards(m, created)]})


async def _version(request: web.Request) -> web.Response:
    """vLLM's `/version`: this engine's."""
    return web.json_response({"version": __version__})


async def _health(request: web.Request) -> web.Response:
    """Liveness and load, for routers: the role, sequences running and waiting, KV pool usage (the
    fullest model's), and each model's figures."""
    st = request.app[STATE]
    sick = {m.name: repr(m.engine.error) for m in st.models.values() if not m.engine.healthy}
    if sick:
        return web.json_response({"status": "unhealthy", "role": st.role, "error": "; ".join(sick.values()),
                                  "models": sick}, status=503)
    snaps = {m.name: m.engine.snapshot for m in st.models.values()}
    return web.json_response({
        "status": "ok", "role": st.role, "running": sum(s.num_running for s in snaps.values()),
        "waiting": sum(s.num_waiting for s in snaps.values()), "kv_usage": max(s.kv_usage for s in snaps.values()),
        "models": {n: {"running": s.num_running, "waiting": s.num_waiting, "kv_usage": s.kv_usage}
                   for n, s in snaps.items()}})


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS].render(), headers={"Content-Type": CONTENT_TYPE})


def _served_models(args: argparse.Namespace) -> list[tuple[tuple[str, ...], str | None]]:
    """(served names, model spec) pairs from --model (repeatable) and --served-model-name: one model
    has every name given (vLLM's --served-model-name NAME [NAME ...], the first the name responses
    carry); several have one --served-model-name each, in order, with that model's names. No names:
    the model's own."""
    specs = args.model or [None]
    groups = [tuple(g) for g in args.served_model_name or []]
    if len(specs) == 1:
        groups = [tuple(n for g in groups for n in g)]
    elif groups and len(groups) != len(specs):
        raise ValueError(f"with several --model, give one --served-model-name per --model, in order ({len(specs)} "
                         f"models, {len(groups)} --served-model-name)")
    names = groups or [()] * len(specs)
    keys = [n for group, spec in zip(names, specs) for n in group or (spec,)]
    if len(set(keys)) != len(keys):  # the same name, or the same model unnamed: caught before any load
        raise ValueError("a served model name is given twice, or two models would be served under the same "
                         "name; give each its own --served-model-name")
    return list(zip(names, specs))


def _read_chat_template(path: str | None) -> str | None:
    """--chat-template's file, checked as Jinja before any model loads."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--chat-template {path}: {e}") from e
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template {path}: not a valid Jinja template (line {e.lineno}: {e.message})") from e
    return text


def _ssl_context(args: argparse.Namespace) -> ssl.SSLContext | None:
    """--ssl-certfile/--ssl-keyfile's server context, read before any model loads."""
    if args.ssl_certfile is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"--ssl-certfile {args.ssl_certfile} / --ssl-keyfile {args.ssl_keyfile}: {e}") from e
    return context


def _check_flags(args: argparse.Namespace) -> tuple[dict[str, str], list[tuple[tuple[str, ...], str | None]]]:
    """The API keys and the served models, or ValueError naming the bad flag."""
    if args.max_queue < 0:
        raise ValueError("--max-queue must be >= 0")
    if args.kv_buffer_mb < 1 or args.kv_hold_seconds <= 0:
        raise ValueError("--kv-buffer-mb must be >= 1 and --kv-hold-seconds > 0")
    keys = parse_api_keys(args.api_key or [])
    models = _served_models(args)
    if args.max_resident is not None and args.max_resident < 1:
        raise ValueError("--max-resident must be >= 1")
    if len(models) > 1 and (args.role != "both" or args.num_processes):
        raise ValueError("several models are served by one process with --role both")
    if (args.lora_modules or args.enable_lora) and len(models) > 1:
        raise ValueError("--enable-lora serves adapters over one model; give one --model")
    if args.lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    parse_lora_modules(args.lora_modules or [])
    return keys, models


def serve(args: argparse.Namespace) -> int:
    """`infire-jax serve`: bind, load and warm up (with a progress bar), listen, print the ready line, serve."""
    try:
        keys, models = _check_flags(args)
        chat_template = _read_chat_template(args.chat_template)
        ssl_context = _ssl_context(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.uvicorn_log_level is not None:
        level = args.uvicorn_log_level.upper()
        logging.getLogger().setLevel(logging.DEBUG if level == "TRACE" else level)
    if init_distributed(args):  # a multi-host follower: run process 0's steps, serve nothing
        Engine(engine_config(args, models[0][1])).follow()
        return 0
    try:
        sock = bind(args.host, args.port)  # before the slow warmup, so a taken port fails at once
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with sock:
        bar = progress_bar()

        def make(config) -> Engine:
            engine = Engine(config, progress=bar)
            for line in (engine.pool_sizing.describe(), engine.boot.describe()):
                print(f"{engine.model_name}: {line}", file=sys.stderr, flush=True)
            return engine

        max_resident = args.max_resident or len(models)
        engines, residency = start_engines([(names[0] if names else None, engine_config(args, spec))
                                            for names, spec in models], max_resident, make)
        bandwidth = host_to_device_bandwidth() if len(engines) > 1 else 0.0
        if len(engines) > 1:
            print(f"hot standby: {min(max_resident, len(engines))} of {len(engines)} models on the device; "
                  f"host-to-device copies at {bandwidth / 1e9:.2f} GB/s", file=sys.stderr, flush=True)
        app = build_app(list(engines.values()), model_names=list(engines),
                        aliases={names[0]: names[1:] for names, _ in models if names}, api_keys=keys,
                        max_queue=args.max_queue, role=args.role, kv_buffer_bytes=args.kv_buffer_mb << 20,
                        kv_host=args.kv_host,
                        kv_hold_seconds=args.kv_hold_seconds, residency=residency if len(engines) > 1 else None,
                        host_to_device_bytes_per_second=bandwidth,
                        lora_modules=parse_lora_modules(args.lora_modules or []),
                        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                        chat_template=chat_template, content_format=args.chat_template_content_format,
                        media=MediaPolicy(args.allowed_local_media_path,
                                          tuple(args.allowed_media_domains) if args.allowed_media_domains else None),
                        root_path=args.root_path, response_role=args.response_role,
                        tokens_as_ids=args.return_tokens_as_token_ids,
                        cors=CorsPolicy(tuple(args.allowed_origins), tuple(args.allowed_methods),
                                        tuple(args.allowed_headers), args.allow_credentials)
                        if args.allowed_origins else None)
        print(f"boot: ready to serve {time.monotonic() - _process_start():.2f} s after the process started",
              file=sys.stderr, flush=True)
        asyncio.run(serve_until_signal(app, sock, args.host, ssl_context=ssl_context,
                                       access_log=args.enable_log_requests))
    return 0


def _process_start() -> float:
    """When this process started, on the time.monotonic clock (Linux /proc; else when this module loaded)."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.monotonic() - (uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return _LOADED


_LOADED = time.monotonic()
