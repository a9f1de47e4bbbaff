"""vLLM's `vllm serve` command line on infire-jax: each flag honoured, accepted where our behaviour is
already what it asks, or refused with what to use instead (docs/SERVER.md, "Coming from vLLM").

Users paste their vLLM command lines; an unknown flag fails, one we cannot honour says why. The
parallelism flags are engine flags (every command); the rest are `serve`'s. Building a parser imports no jax.
"""

from __future__ import annotations

import argparse
import os

# --load-format values whose files we read by looking at them (a .gguf, an HF directory's safetensors).
_DETECTED_LOAD_FORMATS = ("auto", "safetensors", "gguf")
_LOCAL_ONLY = "we load local files only: download the model (e.g. `hf download`) and pass its directory"
# vLLM flags we cannot honour: what to use instead. Each takes one value unless named in _REFUSED_SWITCHES.
_REFUSED = {
    "--revision": _LOCAL_ONLY,
    "--tokenizer-revision": _LOCAL_ONLY,
    "--code-revision": _LOCAL_ONLY,
    "--download-dir": _LOCAL_ONLY,
    "--hf-token": _LOCAL_ONLY,
    "--enforce-eager": "every step is an XLA-compiled program, there is no eager mode (fewer --token-buckets "
                       "compile faster)",
    "--cpu-offload-gb": "weights stay on the device; --weights-quantization or --weights-compression shrink them",
    "--swap-space": "preempted sequences are recomputed, nothing is swapped to host memory",
    "--distributed-executor-backend": "one process drives a host's devices; several hosts: --coordinator-address, "
                                      "--num-processes, --process-id",
    "--no-enable-chunked-prefill": "prompts are always prefilled in chunks within the step's token budget",
}
_REFUSED_SWITCHES = ("--enforce-eager", "--no-enable-chunked-prefill")
# vLLM switches whose behaviour ours already is: why each changes nothing.
_ACCEPTED = {
    "--trust-remote-code": "no checkpoint code is ever run, every model is ours",
    "--enable-chunked-prefill": "prompts are always prefilled in chunks",
    "--disable-log-stats": "no periodic stats are logged (see /metrics)",
    "--disable-log-requests": "requests are not logged unless --enable-log-requests",
    "--disable-uvicorn-access-log": "no access log unless --enable-log-requests",
    "--disable-fastapi-docs": "there are no /docs pages",
    "--disable-frontend-multiprocessing": "HTTP and the engine share one process",
    "--enable-prompt-tokens-details": "usage always carries prompt_tokens_details.cached_tokens",
}
_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


class _Refuse(argparse.Action):
    """A vLLM flag we cannot honour: one line naming it and what to use instead, exit 2."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.exit(2, f"error: {option_string}: {_REFUSED[option_string]}\n")


def add_vllm_engine_args(p: argparse.ArgumentParser) -> None:
    """vLLM's engine flags we lack otherwise: parallelism (a mesh as the shipped YAML files build it,
    sharding/configs), logprobs and the KV page size."""
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=None, metavar="N",
                   help="vLLM's flag: split attention heads, MLPs and the vocabulary over N devices (the mesh of "
                        "sharding/configs/N.yaml; 1: one device, unsharded); not with --mesh. Without -tp, -pp "
                        "or --mesh: every device, as the shipped file for their number")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=None, metavar="N",
                   help="vLLM's flag: split the layers into N stages (as 2-pp2.yaml); times -tp devices in all")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="vLLM's flag: a MoE's routed experts split whole over the -tp devices (as 8-tp8-ep.yaml)")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="N",
                   help="vLLM's flag: only 1; replicas are separate servers behind `infire-jax router` "
                        "(docs/FLEET.md)")
    p.add_argument("--max-logprobs", type=int, default=None, metavar="N",
                   help="vLLM's flag: the most logprobs (sampled, at most 20, and prompt) a request may ask for; "
                        "sets --max-prompt-logprobs unless given (default 20)")
    p.add_argument("--block-size", type=int, default=16, choices=(8, 16, 32, 64, 128),
                   help="vLLM's flag: tokens per KV-cache page (default 16)")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None, metavar="BYTES",
                   help="vLLM's flag: the KV pool's bytes per device, instead of sizing it by "
                        "--gpu-memory-utilization (--num-kv-pages overrides it)")


def parallel_mesh(args: argparse.Namespace):
    """--mesh's file, or the MeshConfig of -tp/-pp/--enable-expert-parallel (-tp 1: one device, as vLLM's),
    or None (the shipped file for the device count); ConfigError naming the flags that conflict."""
    from infire_jax.errors import ConfigError
    from sharding.mesh import MeshConfigError, parallel_config

    tp, pp, dp = args.tensor_parallel_size, args.pipeline_parallel_size, args.data_parallel_size
    if dp != 1:
        raise ConfigError(f"--data-parallel-size {dp}: one server is one replica; run {dp} servers behind "
                          "`infire-jax router` (or `infire-jax fleet`, docs/FLEET.md)")
    if tp is None and pp is None:
        return args.mesh
    if args.mesh is not None:
        raise ConfigError("--mesh and --tensor-parallel-size/--pipeline-parallel-size both say the mesh; give one")
    try:
        return parallel_config(tp or 1, pp or 1, args.enable_expert_parallel)
    except MeshConfigError as e:
        raise ConfigError(str(e)) from e


def add_vllm_serve_args(s: argparse.ArgumentParser) -> None:
    """`vllm serve`'s model positional and server flags, on `infire-jax serve`."""
    s.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as `vllm serve MODEL` (the same as --model)")
    s.add_argument("--config", default=None, metavar="FILE.yaml",
                   help="vLLM's flag: more flags from a YAML mapping (flag name: value); the command line wins")
    s.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="vLLM's flag: only the model itself; the tokenizer is the model's (a GGUF's vocabulary, "
                        "an HF directory's tokenizer.json)")
    s.add_argument("--tokenizer-mode", default="auto", metavar="MODE",
                   help="vLLM's flag: only auto, the model's tokenizer.json / GGUF vocabulary through HF tokenizers")
    s.add_argument("--load-format", default="auto", metavar="FORMAT",
                   help="vLLM's flag: auto, safetensors and gguf read the model by its files; dummy serves random "
                        "weights of a dummy: config (MODEL is its name, e.g. llama-3.1-8b)")
    for flag, why in _ACCEPTED.items():
        s.add_argument(flag, action="store_true", help=f"accepted for vLLM's command lines: {why}")
    s.add_argument("--enable-log-requests", action="store_true",
                   help="vLLM's flag: log a line per request (method, path, status, time) at INFO")
    s.add_argument("--uvicorn-log-level", default=None, choices=_LOG_LEVELS,
                   help="vLLM's flag: the log level of the server (default warning; trace is debug)")
    s.add_argument("--root-path", default=None, metavar="PATH",
                   help="vLLM's flag: behind a proxy at PATH: every route is also served under PATH")
    s.add_argument("--allowed-origins", default=None, type=_json_list, metavar="JSON",
                   help="vLLM's flag: CORS, the origins browsers may call from, e.g. '[\"*\"]' (default: no CORS)")
    s.add_argument("--allowed-methods", default=["*"], type=_json_list, metavar="JSON",
                   help="vLLM's flag: with --allowed-origins, the methods allowed (default [\"*\"])")
    s.add_argument("--allowed-headers", default=["*"], type=_json_list, metavar="JSON",
                   help="vLLM's flag: with --allowed-origins, the request headers allowed (default [\"*\"])")
    s.add_argument("--allow-credentials", action="store_true",
                   help="vLLM's flag: with --allowed-origins, browsers may send credentials")
    s.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="vLLM's flag: serve HTTPS with this key")
    s.add_argument("--ssl-certfile", default=None, metavar="FILE",
                   help="vLLM's flag: serve HTTPS with this certificate (needs --ssl-keyfile)")
    s.add_argument("--response-role", default="assistant", metavar="ROLE",
                   help="vLLM's flag: the role of chat completions' messages (default assistant)")
    s.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="vLLM's flag: logprobs name every token \"token_id:{id}\" (as a request's "
                        "return_tokens_as_token_ids)")
    for flag in _REFUSED:
        s.add_argument(flag, action=_Refuse, nargs=0 if flag in _REFUSED_SWITCHES else None,
                       help=f"refused: {_REFUSED[flag]}")


def _json_list(text: str) -> list[str]:
    import json

    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, e.g. '[\"*\"]', got {text!r}")
    return value


def resolve_serve_args(args: argparse.Namespace) -> None:
    """Folds the vLLM spellings into our flags (MODEL into --model, dummy loads into dummy: specs);
    ConfigError naming the flag where they cannot be honoured."""
    from infire_jax.errors import ConfigError

    if args.model_tag is not None:
        if args.model:
            raise ConfigError(f"the model is given twice: as MODEL ({args.model_tag}) and --model "
                              f"({', '.join(args.model)}); give one")
        args.model = [args.model_tag]
    if args.load_format == "dummy":
        if not args.model:
            raise ConfigError("--load-format dummy: name the dummy config as MODEL, e.g. llama-3.1-8b")
        args.model = [m if m.startswith("dummy:") else f"dummy:{m}" for m in args.model]
    elif args.load_format not in _DETECTED_LOAD_FORMATS:
        raise ConfigError(f"--load-format {args.load_format}: we read {', '.join(_DETECTED_LOAD_FORMATS)} "
                          "(by the model's files) and dummy")
    if args.tokenizer is not None and [os.path.normpath(args.tokenizer)] != [os.path.normpath(m)
                                                                           for m in args.model or []]:
        raise ConfigError(f"--tokenizer {args.tokenizer}: the tokenizer is the model's own; a separate one is "
                          "not supported")
    if args.tokenizer_mode != "auto":
        raise ConfigError(f"--tokenizer-mode {args.tokenizer_mode}: only auto (the model's own tokenizer, through "
                          "HF tokenizers)")
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ConfigError("--ssl-keyfile and --ssl-certfile go together")
    if args.root_path is not None and (not args.root_path.startswith("/") or args.root_path.endswith("/")):
        raise ConfigError(f"--root-path {args.root_path!r}: a path such as /llm (a leading /, no trailing /)")


def expand_config_file(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`--config FILE.yaml`'s flags inserted before the command line's (so that those win), as vLLM does:
    `key: value` is --key value, `key: true` is --key, `key: false` --no-key where `parser`'s command
    has it (--no-enable-prefix-caching) and nothing otherwise (a switch left off), a list repeats its
    values after one --key."""
    from infire_jax.errors import ConfigError

    for i, arg in enumerate(argv):
        if arg == "--config" or arg.startswith("--config="):
            path = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else None)
            rest = argv[:i] + argv[i + (1 if "=" in arg else 2):]
            break
    else:
        return argv
    if path is None:
        raise ConfigError("--config needs a YAML file")
    import json

    import yaml

    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"--config {path}: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag names to values")
    flags = []
    for key, value in raw.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            negated = "--no-" + flag[2:]
            flags += [negated] if not parser.parse_known_args([argv[0], negated])[1] else []
        elif value is None:
            continue
        elif isinstance(value, dict):  # e.g. speculative_config: a JSON flag
            flags += [flag, json.dumps(value)]
        elif isinstance(value, list):
            flags += [flag, *map(str, value)]
        else:
            flags += [flag, str(value)]
    return rest[:1] + flags + rest[1:]  # rest[0] is the command (serve)
