"""`python -m infire_jax.kv_transfer.measure`: KV blocks over Mooncake against a plain Mooncake write.

Both move the same bytes between two transfer engines on this machine (TCP loopback): once as
`MooncakeTransport.send` of KV blocks (k and v in one batched write; the copy into the staging
buffer is not timed), once as one `transfer_sync_write` of a registered buffer. Median of --reps,
after a first transfer that opens the connection.
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
    region = dst.reserve(n)
    send, plain = [], []
    for _ in range(a.reps + 1):  # the first opens the connection
        send.append(src.send(blocks, region))
        local = src.reserve(n)
        start = time.perf_counter()
        rc = src._engine.transfer_sync_write(region.target, local.address, region.address, n)
        plain.append(time.perf_counter() - start)
        src.release(local)
        assert rc == 0, rc
    arrived = dst.received(region, layout, blocks.token_ids, None)
    assert np.array_equal(arrived.k, blocks.k) and np.array_equal(arrived.v, blocks.v)
    send_s, plain_s = statistics.median(send[1:]), statistics.median(plain[1:])
    print(json.dumps(dict(bytes=n, pages=a.pages, kv_send_GBps=round(n / send_s / 1e9, 3),
                          plain_write_GBps=round(n / plain_s / 1e9, 3), ratio=round(plain_s / send_s, 3),
                          first_send_s=round(send[0], 4))))


if __name__ == "__main__":
    main()
