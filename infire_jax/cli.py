"""`infire-jax` command line: generate, chat, serve, compress, plan, precompile (also `python -m infire_jax ...`)."""

from __future__ import annotations

import argparse
import logging
import sys

from infire_jax.engine.args import (add_engine_args, add_sampling_args, engine_config, init_distributed, progress_bar,
                                    sampling_params)
from infire_jax.engine.vllm_args import add_vllm_serve_args, expand_config_file, resolve_serve_args
from infire_jax.errors import InfireError
from infire_jax.structured.reasoning_parsers import REASONING_PARSER_NAMES
from infire_jax.structured.tool_parsers import TOOL_PARSER_NAMES
from sharding.distributed import DistributedConfigError


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is an integer in [0, 65535], got {text!r}")
    return port


def _make_llm(args):
    """An LLM on process 0; on follower processes, runs process 0's steps and exits."""
    from infire_jax.engine.engine import Engine
    from infire_jax.llm import LLM

    follower = init_distributed(args)
    engine = Engine(engine_config(args), progress=None if follower else progress_bar())
    if follower:
        engine.follow()
        sys.exit(0)
    return LLM(engine=engine)


def cmd_generate(args) -> int:
    llm = _make_llm(args)
    out = llm.generate(args.prompt, sampling_params(args))
    llm.engine.close()
    print(out[0].text)
    return 0


def cmd_chat(args) -> int:
    llm = _make_llm(args)
    params = sampling_params(args)
    history = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("infire-jax chat: type a message, or /exit to quit.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            llm.engine.close()
            return 0
        if line.strip() in ("/exit", "/quit"):
            llm.engine.close()
            return 0
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        reply = llm.chat(history, params)[0].text
        print(reply, flush=True)
        history.append({"role": "assistant", "content": reply})


def cmd_serve(args) -> int:
    from server.app import serve

    resolve_serve_args(args)
    return serve(args)


def cmd_compress(args) -> int:
    """Writes a compressed native checkpoint and prints how much each kind of weight shrank."""
    from infire_jax.compression import parse_kinds
    from infire_jax.errors import ConfigError
    from infire_jax.loaders.compressed import size_summary, write_compressed
    from infire_jax.loaders.load import load_model

    try:
        kinds = parse_kinds(args.tensors)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    tensors = write_compressed(load_model(args.model), args.out, args.format, kinds)
    for kind, (before, after) in size_summary(tensors).items():
        print(f"{kind:>6}: {before / 1e6:10.2f} MB bf16 -> {after / 1e6:10.2f} MB ({1 - after / before:6.1%} smaller)")
    print(f"wrote {args.out}")
    return 0


def cmd_plan(args) -> int:
    """`infire-jax plan`, a draft head (--speculative-config) counted by the speculation layer."""
    from infire_jax.memplan.cli import run_plan
    from infire_jax.speculative.plan import draft_head_for

    return run_plan(args, draft_head_for)


def cmd_router(args) -> int:
    from router.app import run_router

    return run_router(args)


def cmd_fleet(args) -> int:
    from router.fleet import run_fleet

    return run_fleet(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="infire-jax", description="LLM inference on JAX/XLA",
                                     epilog="infire-jax bench ... runs the benchmarks (python -m infire_jax.bench).")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete one prompt")
    g.add_argument("prompt")
    add_engine_args(g)
    add_sampling_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="chat with the model in the terminal")
    c.add_argument("--system", default=None, help="system message")
    add_engine_args(c)
    add_sampling_args(c)
    c.set_defaults(func=cmd_chat)

    s = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API", usage="infire-jax serve [MODEL] [flags]",
                       description="Serve the OpenAI-compatible HTTP API. vLLM's `vllm serve` flags are taken where "
                                   "we can honour them (docs/SERVER.md).")
    add_engine_args(s, several_models=True)
    add_vllm_serve_args(s)
    s.add_argument("--max-resident", type=int, default=None,
                   help="several models: at most this many on the device at once, the others in host memory "
                        "(default: all)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=_port, default=8000, help="port to listen on (0: any free port)")
    s.add_argument("--api-key", action="append", default=None, metavar="KEY[:TENANT]",
                   help="require this bearer key (repeatable); KEY:TENANT also names the key's cache tenant")
    s.add_argument("--max-queue", type=int, default=1024,
                   help="sequences allowed to wait beyond a full batch; past it requests get 429")
    s.add_argument("--served-model-name", default=None, action="append", nargs="+", metavar="NAME",
                   help="the model's names in the API, as vLLM's: requests may name any, responses carry the first "
                        "(default: the model's name); with several --model, one --served-model-name per --model, "
                        "in order, each with that model's names")
    s.add_argument("--role", default="both", choices=["both", "prefill", "decode"],
                   help="fleet role: prefill workers hand their prompts' KV to decode workers (docs/FLEET.md)")
    s.add_argument("--kv-buffer-mb", type=int, default=512,
                   help="prefill/decode: the Mooncake staging buffer for KV transfers, in MiB")
    s.add_argument("--kv-host", default="127.0.0.1",
                   help="prefill/decode: the address this worker's Mooncake transfer engine listens on")
    s.add_argument("--kv-hold-seconds", type=float, default=30.0,
                   help="prefill: how long exported KV waits for a decode worker to fetch it")
    s.add_argument("--lora-modules", nargs="+", action="extend", default=None, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT directories) served under their names, as vLLM's flag: NAME=PATH or "
                        'JSON {"name": ..., "path": ...}; needs --enable-lora')
    s.add_argument("--tool-call-parser", default=None, choices=TOOL_PARSER_NAMES, metavar="NAME",
                   help="the tool-call format the model writes, by vLLM's names: " + ", ".join(TOOL_PARSER_NAMES)
                        + " (default: the one its chat template shows, else hermes)")
    s.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSER_NAMES, metavar="NAME",
                   help="split the model's reasoning from its answer (chat: message.reasoning; Responses: "
                        "a reasoning item), by vLLM's names: " + ", ".join(REASONING_PARSER_NAMES)
                        + " (default: openai_gptoss for a harmony chat template such as gpt-oss's, else none)")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM's command lines: tool_choice \"auto\" is always served")
    s.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template file that replaces the model's own")
    s.add_argument("--chat-template-content-format", default="auto", choices=("auto", "string", "openai"),
                   help="vLLM's flag: what the chat template takes as a message's content when it comes as "
                        "parts: openai, the parts ({type: text}, {type: image}); string, their texts joined by "
                        "newlines, each image a marker; auto (default): openai where the template loops over a "
                        "message's content, as vLLM detects it")
    s.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="chat images may be file: URLs under this directory (default: none)")
    s.add_argument("--allowed-media-domains", nargs="*", default=None, metavar="HOST",
                   help="chat images may be fetched from these hosts only (default: any)")
    s.set_defaults(func=cmd_serve)

    z = sub.add_parser("compress", help="write a losslessly compressed bfloat16 checkpoint (serve it with --model DIR)")
    z.add_argument("--model", default=None, help="model spec, as for generate (default: the embedded model)")
    z.add_argument("--out", required=True, help="directory to write (must not exist, or be empty)")
    z.add_argument("--dtype", default="bfloat16", choices=["bfloat16"], help="stored dtype (compression is of bfloat16)")
    z.add_argument("--format", default="entropy", choices=["palette", "entropy"],
                   help="entropy: rANS-coded exponents, smallest on disk; palette: the fixed-rate device format")
    z.add_argument("--tensors", default="mlp", help="comma-separated kinds to compress: mlp, attn, embed (default mlp)")
    z.set_defaults(func=cmd_compress)

    m = sub.add_parser("plan", help="per-device memory plan: weights by kind, activations, KV room and tokens")
    from infire_jax.memplan.cli import add_plan_args

    add_plan_args(m)
    m.set_defaults(func=cmd_plan)

    pc = sub.add_parser("precompile", help="compile the step programs into the executable cache before the first "
                                           "start (--target: a GPU's, on a machine without one)")
    from infire_jax.bench import precompile

    precompile.add_args(pc)
    pc.set_defaults(func=precompile.run)

    r = sub.add_parser("router", help="route OpenAI requests over prefill/decode workers or replicas")
    from router.app import add_router_args

    add_router_args(r)
    r.set_defaults(func=cmd_router)

    f = sub.add_parser("fleet", help="start a router and its workers on this machine from a YAML file")
    from router.fleet import add_fleet_args

    add_fleet_args(f)
    f.set_defaults(func=cmd_fleet)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # `infire-jax bench ...` is `python -m infire_jax.bench ...`
        from infire_jax.bench.__main__ import main as bench_main

        return bench_main(argv[1:])
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    try:
        if argv[:1] == ["serve"]:
            argv = expand_config_file(argv, parser)
        args = parser.parse_args(argv)
        return args.func(args)
    except (InfireError, DistributedConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
