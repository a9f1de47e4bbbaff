"""`python -m infire_jax.bench`: latency, throughput, serve, fleet, suite, profile, boot, swap, spec, compare,
device-checks, gpu-compile and perplexity subcommands.

Flags follow `vllm bench` where they overlap. Every subcommand prints a table and takes
--json FILE and --plot FILE.
"""

from __future__ import annotations

import argparse
import logging
import sys

from infire_jax.bench import (boot, compare, device_checks, fleet, gpu_compile, latency, perplexity, profile, serve,
                               spec, suite, swap, throughput)
from infire_jax.bench.common import add_output_args
from infire_jax.errors import InfireError

SUBCOMMANDS = {"latency": latency, "throughput": throughput, "serve": serve, "fleet": fleet, "suite": suite,
               "profile": profile, "boot": boot, "swap": swap, "spec": spec, "compare": compare,
               "device-checks": device_checks, "gpu-compile": gpu_compile, "perplexity": perplexity}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m infire_jax.bench",
                                     description="Benchmarks of the infire_jax engine and of OpenAI-compatible servers")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=module.__doc__.split("\n", 1)[0].split(": ", 1)[1],
                           description=module.DESCRIPTION, **getattr(module, "PARSER_OPTIONS", {}))
        module.add_args(p)
        add_output_args(p)
        p.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    from infire_jax.bench.report import emit

    try:
        result = args.run(args)
    except InfireError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    emit(result, args.json, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
