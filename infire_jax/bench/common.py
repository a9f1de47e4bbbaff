"""What the bench subcommands share: flags, engine start-up, and the facts every report names."""

from __future__ import annotations

import argparse
import logging
import math
import sys
from typing import TYPE_CHECKING

from infire_jax.engine.args import add_engine_args, engine_config, init_distributed, progress_bar
from infire_jax.errors import InfireError

if TYPE_CHECKING:
    from infire_jax.bench.roofline import DevicePeaks
    from infire_jax.engine.engine import Engine

log = logging.getLogger(__name__)


class BenchError(InfireError):
    """A benchmark cannot run as asked (bad flags, a bad dataset, a server that does not answer)."""


def int_at_least(low: int):
    """An argparse type: an integer no smaller than `low`."""
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text}")
        return value

    return parse


positive_int = int_at_least(1)


def rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive (or inf), got {text}")
    return value


def add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="FILE", default=None,
                   help="write every figure, the settings and the measured device peaks to this JSON file")
    p.add_argument("--plot", metavar="FILE", default=None,
                   help="draw a throughput-latency chart (TTFT and TPOT against output tokens/s) to this PNG file")


def add_bench_engine_args(p: argparse.ArgumentParser, sized_by: str) -> None:
    """The engine flags of `infire-jax serve`, with --max-num-seqs sized to the workload by default."""
    add_engine_args(p)
    p.set_defaults(max_num_seqs=None)
    p.epilog = f"--max-num-seqs defaults to {sized_by}; --seed also seeds the random prompts."


def start_engine(args: argparse.Namespace, max_num_seqs: int) -> tuple[Engine, DevicePeaks]:
    """The engine, and the measured device peaks scaled to the devices its mesh spans.

    The peaks are measured before the engine takes the device memory for its KV pool. On the
    follower processes of a multi-host group this runs process 0's steps, then exits.
    """
    import dataclasses

    import jax
    import jax.numpy as jnp

    from infire_jax.bench.roofline import measure_peaks
    from infire_jax.engine.engine import Engine
    from infire_jax.engine.setup import resolve_dtype

    config = engine_config(args)
    config.max_num_seqs = args.max_num_seqs or max_num_seqs
    if init_distributed(args):
        Engine(config).follow()
        sys.exit(0)
    peaks = measure_peaks(resolve_dtype(args.dtype))
    engine = Engine(config, progress=progress_bar())
    resident = engine_weight_bytes(engine)
    counted = engine.model_config.param_count() * engine_itemsize(engine)
    if abs(resident - counted) > 0.01 * counted:
        log.info("the model holds %d weight bytes where %s weights would take %d (quantized or compressed): "
                 "roofline bytes count %.3f bytes a parameter", resident, jnp.dtype(engine.dtype).name, counted,
                 weight_bytes_per_param(engine))
    return engine, dataclasses.replace(peaks, num_devices=jax.device_count() if engine.plan else 1)


def engine_itemsize(engine: Engine) -> int:
    import jax.numpy as jnp

    return jnp.dtype(engine.dtype).itemsize


def kv_itemsize(engine: Engine) -> int:
    """Bytes of one element of the KV pool (1 for an fp8 pool, whatever the model's dtype)."""
    return engine.kv_dtype.itemsize


def engine_weight_bytes(engine: Engine) -> int:
    import jax

    return sum(x.nbytes for x in jax.tree.leaves(engine.runner.state))


def weight_bytes_per_param(engine: Engine) -> float:
    """The bytes a parameter takes on the device as held (below the dtype's itemsize when quantized
    or compressed): what a roofline's weight traffic counts."""
    return engine_weight_bytes(engine) / engine.model_config.param_count()


def engine_info(engine: Engine) -> dict:
    import jax.numpy as jnp

    cfg, rc = engine.model_config, engine.runner.rc
    return dict(model=engine.model_name, dtype=jnp.dtype(engine.dtype).name, param_count=cfg.param_count(),
                weight_bytes=engine_weight_bytes(engine), architecture=cfg.architecture,
                max_model_len=engine.max_model_len, max_num_seqs=rc.max_num_seqs,
                max_num_batched_tokens=engine.scheduler.max_num_batched_tokens, page_size=rc.page_size,
                num_kv_pages=rc.num_pages, kv_cache_bytes=engine.runner.kv_cache_bytes,
                kv_pool=engine.pool_sizing.describe(),
                load_seconds=engine.load_seconds, weights_restored=engine.boot.restored,
                warmup_seconds=engine.warmup_seconds)


def device_info() -> dict:
    import jax

    dev = jax.devices()[0]
    return dict(backend=jax.default_backend(), device=dev.device_kind, num_devices=jax.device_count(),
                jax_version=jax.__version__)


def settings(args: argparse.Namespace) -> dict:
    """The parsed flags as JSON values (infinite rates as the string "inf"), without secrets."""
    def clean(v):
        if isinstance(v, float) and math.isinf(v):
            return "inf"
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v

    return {k: clean(v) for k, v in vars(args).items() if not callable(v) and k != "api_key"}
