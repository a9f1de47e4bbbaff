"""`bench swap`: the time a hot-standby swap takes, against its floor.

The floor is the weights' bytes over the host-to-device bandwidth, measured here. The models
(--model, twice or more) are built as `serve --model ... --max-resident N` builds them, then
requested in turn, --swaps times, so every request finds its model off the device. Each round
times the promotion alone (the least recently used model's demotion included) and then the first
token of a one-token request. The first demotion of a model copies its weights to host memory;
later ones only free the device (residency.py). A promotion also allocates the model's empty KV
pool, which the floor leaves out.
"""

from __future__ import annotations

import argparse
import time

from infire_jax.bench.common import BenchError, positive_int
from infire_jax.engine.args import add_engine_args, engine_config

DESCRIPTION = __doc__.split("\n\n", 1)[1]

COLUMNS = [
    ("model", "model", "{}"), ("swaps", "swaps", "{}"), ("gb", "weights GB", "{:.3f}"),
    ("swap_s", "swap s (median)", "{:.3f}"), ("floor_s", "floor s", "{:.3f}"), ("of_floor", "floor / swap", "{:.2f}"),
    ("first_token_s", "swap + first token s", "{:.3f}"),
]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--swaps", type=positive_int, default=6, help="requests, each for the model off the device")
    p.add_argument("--max-resident", type=positive_int, default=1, help="models on the device at once")
    add_engine_args(p, several_models=True)


def run(args: argparse.Namespace):
    import numpy as np

    from infire_jax.bench import report
    from infire_jax.bench.common import settings
    from infire_jax.engine.residency import host_to_device_bandwidth, start_engines
    from infire_jax.sample.sampling_params import SamplingParams

    if not args.model or len(args.model) <= args.max_resident:
        raise BenchError("bench swap needs more --model flags than --max-resident, so that requests swap")
    unique = len(set(args.model)) == len(args.model)  # else the same model twice: number them
    engines, residency = start_engines([(None if unique else f"{i}:{m}", engine_config(args, m))
                                        for i, m in enumerate(args.model)], args.max_resident)
    bandwidth = host_to_device_bandwidth()
    names = list(engines)
    order = names[args.max_resident:] + names[:args.max_resident]  # the first requests find their models away
    rounds: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for i in range(args.swaps):
        name = order[i % len(order)]
        engine = engines[name]
        start = time.perf_counter()
        if not residency.acquire(name, timeout=600):
            raise BenchError(f"{name} did not get the device")
        promoted = time.perf_counter()
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=1, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        rounds[name].append((promoted - start, time.perf_counter() - start))
        residency.release(name)
    rows = []
    for name in names:
        if not rounds[name]:
            continue
        nbytes = engines[name].runner.weight_bytes
        swap = float(np.median([r[0] for r in rounds[name]]))
        rows.append(dict(model=name, swaps=len(rounds[name]), gb=nbytes / 1e9, swap_s=swap,
                         floor_s=nbytes / bandwidth, of_floor=nbytes / bandwidth / swap,
                         first_token_s=float(np.median([r[1] for r in rounds[name]])),
                         rounds_s=[r[0] for r in rounds[name]]))
    compiles = {n: e.compiles_since_warmup for n, e in engines.items()}
    if any(compiles.values()):
        raise BenchError(f"swaps compiled: {compiles}")
    payload = dict(benchmark="swap", settings=settings(args), host_to_device_bytes_per_second=bandwidth,
                   results=rows)
    title = f"swap: {len(names)} models, {args.max_resident} resident, host-to-device {bandwidth / 1e9:.2f} GB/s"
    return report.Result(payload, report.table(rows, COLUMNS), [], title)
