"""`infire-jax` command line: generate, chat, serve, compress, plan (also `python -m infire_jax ...`)."""

from __future__ import annotations

import argparse
import logging
import sys

from infire_jax.errors import InfireError
from sharding.distributed import DistributedConfigError

# The names `kv_scales.resolve_kv_cache_dtype` takes (kept here: building the parser imports no jax).
KV_CACHE_DTYPE_CHOICES = ("auto", "bfloat16", "float32", "float8_e4m3", "fp8", "fp8_e4m3")


def add_engine_args(p: argparse.ArgumentParser, *, several_models: bool = False) -> None:
    """Flags shared by every command that builds an engine (`several_models`: --model repeats)."""
    p.add_argument("--model", default=None, action="append" if several_models else "store",
                   help="a .gguf file, an HF model directory, or dummy:<name> (default: embedded SmolLM2-135M-Instruct)"
                        + ("; repeat it to serve several models from one process" if several_models else ""))
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="weight and KV dtype (auto: float32 on CPU, bfloat16 on GPU)")
    p.add_argument("--weights-compression", default=None, metavar="palette[:KINDS]",
                   help="keep weights losslessly palette-compressed on the device, decoded per layer (needs "
                        "--dtype bfloat16); KINDS: mlp (default), attn, e.g. palette:mlp,attn")
    p.add_argument("--weights-quantization", default=None, choices=["gguf", "int8", "int4", "checkpoint"],
                   help="keep the layer weights quantized on the device, dequantized per layer inside the layer "
                        "scan (embedding and head stay dense): gguf keeps a GGUF model's Q4_1/Q8_0 blocks; int8 "
                        "quantizes any model at load, one scale per output channel; int4 draws a dummy: model's "
                        "weights as AWQ/GPTQ-form int4 (groups of 128; a DeepSeek/Kimi dummy's routed experts as "
                        "Kimi's int4); checkpoint keeps a published DeepSeek-V3/Kimi checkpoint's own int4 or fp8 "
                        "weights (its routed experts dequantized one expert at a time in the grouped matmul)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, as vLLM\'s speculative_config, e.g. '
                        '\'{"method": "ngram", "num_speculative_tokens": 4}\'')
    p.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output, in tokens")
    p.add_argument("--max-num-seqs", type=int, default=64, help="most sequences in one step")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one step")
    p.add_argument("--num-decode-steps", type=int, default=4,
                   help="decode steps a step of decodes alone may run in one device launch, read back once "
                        "(1: one step a launch; tokens then stream one at a time). Default 4")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_CHOICES,
                   help="dtype of the KV cache: auto (the model's), bfloat16, float32, or float8_e4m3 (aliases fp8, "
                        "fp8_e4m3): e4m3 pages with per-(layer, kv head) scales, twice the tokens of bfloat16; the "
                        "scales are an HF checkpoint's k_scale / v_scale where it has them, else calibrated")
    p.add_argument("--calibrate-kv-scales", action="store_true",
                   help="fp8 KV cache: calibrate the scales even when the checkpoint carries k_scale / v_scale")
    p.add_argument("--num-kv-pages", type=int, default=None, help="size of the KV pool in pages (overrides memory)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.90,
                   help="fraction of each GPU's memory for weights, activations and the KV pool (default 0.90)")
    p.add_argument("--attention", default="auto", dest="attn_impl",
                   help="attention implementation: auto (pallas on GPU, else reference), reference, pallas, "
                        "or pallas_interpret (the Pallas kernels in interpret mode, for checking on CPU)")
    p.add_argument("--seed", type=int, default=0, help="engine seed for requests that bring none")
    p.add_argument("--grammar-compile-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="longest a structured-output grammar may take to compile; longer is a 400 (default 10)")
    p.add_argument("--mesh", default=None,
                   help="mesh-config YAML (default: the shipped file for the number of devices)")
    p.add_argument("--coordinator-address", default=None,
                   help="multi-host: host:port of process 0's coordinator (env INFIRE_COORDINATOR_ADDRESS)")
    p.add_argument("--num-processes", type=int, default=None, help="multi-host: number of processes")
    p.add_argument("--process-id", type=int, default=None, help="multi-host: this process's id")


def engine_config(args: argparse.Namespace, model: str | None = None):
    """The engine settings of the flags, for `model` when given (else --model)."""
    from infire_jax.engine import EngineConfig

    return EngineConfig(model=model or args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        num_kv_pages=args.num_kv_pages, gpu_memory_utilization=args.gpu_memory_utilization,
                        attn_impl=args.attn_impl, kv_cache_dtype=args.kv_cache_dtype,
                        calibrate_kv_scales=args.calibrate_kv_scales, mesh=args.mesh, seed=args.seed,
                        weights_compression=args.weights_compression,
                        weights_quantization=args.weights_quantization, speculative_config=args.speculative_config,
                        grammar_compile_timeout=args.grammar_compile_timeout, num_decode_steps=args.num_decode_steps)


def init_distributed(args: argparse.Namespace) -> bool:
    """Joins a multi-host group when asked to; returns whether this process must only follow."""
    import jax

    from sharding.distributed import initialize

    return initialize(args.coordinator_address, args.num_processes, args.process_id) and jax.process_index() != 0


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sampling-seed", type=int, default=None)


def sampling_params(args: argparse.Namespace):
    from infire_jax.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.sampling_seed)


def _make_llm(args):
    """An LLM on process 0; on follower processes, runs process 0's steps and exits."""
    from infire_jax.engine import Engine
    from infire_jax.llm import LLM

    follower = init_distributed(args)
    engine = Engine(engine_config(args), progress=None if follower else progress_bar())
    if follower:
        engine.follow()
        sys.exit(0)
    return LLM(engine=engine)


def progress_bar():
    """A tqdm bar per stage (load, compile) for engine start-up."""
    from tqdm import tqdm

    bars: dict[str, tqdm] = {}

    def report(stage: str, done: int, total: int) -> None:
        bar = bars.get(stage)
        if bar is None:
            bar = bars[stage] = tqdm(total=total, desc=stage, unit="step" if stage == "compile" else "model",
                                     leave=False, file=sys.stderr)
        bar.n = done
        bar.refresh()
        if done >= total:
            bar.close()

    return report


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

    s = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_engine_args(s, several_models=True)
    s.add_argument("--max-resident", type=int, default=None,
                   help="several models: at most this many on the device at once, the others in host memory "
                        "(default: all)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    s.add_argument("--api-key", action="append", default=None, metavar="KEY[:TENANT]",
                   help="require this bearer key (repeatable); KEY:TENANT also names the key's cache tenant")
    s.add_argument("--max-queue", type=int, default=1024,
                   help="sequences allowed to wait beyond a full batch; past it requests get 429")
    s.add_argument("--served-model-name", default=None, action="append",
                   help="model name of the API (default: the model's name); one per --model, in order")
    s.add_argument("--role", default="both", choices=["both", "prefill", "decode"],
                   help="fleet role: prefill workers hand their prompts' KV to decode workers (docs/FLEET.md)")
    s.add_argument("--kv-buffer-mb", type=int, default=512,
                   help="prefill/decode: the Mooncake staging buffer for KV transfers, in MiB")
    s.add_argument("--kv-host", default="127.0.0.1",
                   help="prefill/decode: the address this worker's Mooncake transfer engine listens on")
    s.add_argument("--kv-hold-seconds", type=float, default=30.0,
                   help="prefill: how long exported KV waits for a decode worker to fetch it")
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
    from infire_jax.memplan.cli import add_plan_args, run_plan

    add_plan_args(m)
    m.set_defaults(func=run_plan)

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
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (InfireError, DistributedConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
