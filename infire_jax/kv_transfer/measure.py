"""`python -m infire_jax.kv_transfer.measure`: KV blocks over Mooncake against plain Mooncake transfers.

All move the same bytes between two transfer engines on this machine (TCP loopback): once as
`MooncakeTransport.fetch` of held KV blocks (the receiver reads k and v in one batched read; the
sender's copy into its staging buffer is not timed), once as one plain `transfer_sync_read` and
once as one plain `transfer_sync_write` of a registered buffer. Median of --reps, after a first
transfer that opens the connection.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from infire_jax.kv_transfer.blocks import KVBlocks, KVLayout
from infire_jax.kv_transfer.mooncake import MooncakeTransport


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pages", type=int, default=128, help="KV pages moved (default: a 2k-token prompt)")
    p.add_argument("--page-shape", type=int, nargs=4, default=[32, 16, 8, 128],
                   metavar=("LAYERS", "PAGE_SIZE", "KV_HEADS", "HEAD_DIM"), help="default: Llama-3.1-8B")
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args(argv)
    layers, ps, heads, dim = a.page_shape
    layout = KVLayout("synthetic", "float16", ps, (layers, ps, heads, dim))
    shape = (layers, a.pages, ps, heads, dim)
    rng = np.random.default_rng(0)
    blocks = KVBlocks(layout, list(range(a.pages * ps)), None, rng.standard_normal(shape).astype(np.float16),
                      rng.standard_normal(shape).astype(np.float16))
    n = blocks.nbytes
    src, dst = MooncakeTransport(2 * n), MooncakeTransport(2 * n)
    held = src.hold(blocks)
    region = dst.reserve(n)
    fetch, read, write = [], [], []
    for _ in range(a.reps + 1):  # the first opens the connection
        fetch.append(dst.fetch(held, region))
        for seconds, op in ((read, dst._engine.transfer_sync_read), (write, dst._engine.transfer_sync_write)):
            start = time.perf_counter()
            rc = op(held.target, region.address, held.address, n)
            seconds.append(time.perf_counter() - start)
            assert rc == 0, rc
    dst.fetch(held, region)
    arrived = dst.received(region, layout, blocks.token_ids, None)
    assert np.array_equal(arrived.k, blocks.k) and np.array_equal(arrived.v, blocks.v)
    fetch_s, read_s, write_s = (statistics.median(x[1:]) for x in (fetch, read, write))
    print(json.dumps(dict(bytes=n, pages=a.pages, kv_fetch_GBps=round(n / fetch_s / 1e9, 3),
                          plain_read_GBps=round(n / read_s / 1e9, 3), plain_write_GBps=round(n / write_s / 1e9, 3),
                          fetch_over_plain_read=round(read_s / fetch_s, 3), first_fetch_s=round(fetch[0], 4))))


if __name__ == "__main__":
    main()
