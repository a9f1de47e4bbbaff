"""`python -m infire_jax.bench.compression_ratio`: lossless compression ratios of a model's weights,
ours (palette, entropy) against DFloat11 and lmzip on the same bfloat16 tensors.

Two groups: `mlp` (gate/up and down of every layer) and `model` (every tensor; all matrices
compressed, norms stored raw). `--safetensors FILE` reads any checkpoint's tensors instead (trained
float32 or float16 weights rounded to bfloat16, e.g. a packaged encoder's), its MLP matrices named
by `--mlp-pattern`. DFloat11 is run as its `compress_model` runs it (one Huffman
code per decoder layer, the embedding and head each their own; its encoder is pure Python and
needs no GPU) and counted by the buffers it stores; lmzip compresses a bfloat16 safetensors file
of the group and is counted by its archive. Both are optional installs (`pip install dfloat11
dahuffman lmzip`; dfloat11 with --no-deps, its package import needs cupy, its encoder does not).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import tempfile
import time
from typing import Callable, Mapping

import numpy as np

from infire_jax.compression import KINDS, as_bf16, encode_entropy, encode_palette

GROUPS = {"mlp": KINDS["mlp"], "model": None}  # None: every tensor


def _ours(fmt: str) -> Callable[[Mapping[str, np.ndarray]], int]:
    def size(tensors: Mapping[str, np.ndarray]) -> int:
        total = 0
        for name, x in tensors.items():
            if x.ndim < 2:
                total += x.nbytes
            elif fmt == "palette":
                total += encode_palette(x, stacked=name.startswith("layers."), name=name).nbytes
            else:
                total += encode_entropy(x).nbytes
        return total

    return size


def _dfloat11(tensors: Mapping[str, np.ndarray]) -> int:
    import torch

    path = os.path.join(os.path.dirname(importlib.util.find_spec("dfloat11").origin), "dfloat11_utils.py")
    spec = importlib.util.spec_from_file_location("dfloat11_utils", path)
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)

    def as_torch(x):
        return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16).flatten()

    layers = next((x.shape[0] for n, x in tensors.items() if n.startswith("layers.")), 0)
    groups = [[as_torch(x[i]) for n, x in tensors.items() if n.startswith("layers.") and x.ndim > 2]
              for i in range(layers)]
    groups += [[as_torch(x)] for n, x in tensors.items() if not n.startswith("layers.") and x.ndim == 2]
    total = sum(x.nbytes for n, x in tensors.items() if x.ndim < 2 or (n.startswith("layers.") and x.ndim == 2))
    for weights in groups:
        _, counter = utils.get_codec(torch.cat(weights))
        codec, _, table = utils.get_32bit_codec(counter)
        luts = utils.get_luts(table)
        parts = utils.encode_weights(weights, codec, 8, 512)  # dfloat11.py's bytes_per_thread, threads_per_block
        total += sum(p.numel() * p.element_size() for p in (luts, *parts[:4]))
    return total


def _lmzip(tensors: Mapping[str, np.ndarray]) -> int:
    import torch
    from lmz import api
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "model.safetensors"), os.path.join(tmp, "model.lmz")
        save_file({n: torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16)
                   for n, x in tensors.items()}, src)
        api.compress(src, dst)
        return os.path.getsize(dst)


METHODS = {"palette": _ours("palette"), "entropy": _ours("entropy"), "dfloat11": _dfloat11, "lmzip": _lmzip}


def main(argv: list[str] | None = None) -> int:
    from infire_jax.loaders.compressed import host_weights
    from infire_jax.loaders.load import load_model

    p = argparse.ArgumentParser(prog="python -m infire_jax.bench.compression_ratio", description=__doc__)
    p.add_argument("--model", default=None, help="model spec (default: the embedded model)")
    p.add_argument("--safetensors", default=None, metavar="FILE", help="measure this file's tensors instead")
    p.add_argument("--mlp-pattern", default=r"(intermediate|output)\.dense\.weight$|mlp\.", metavar="REGEX",
                   help="with --safetensors: the names of the MLP matrices (default: BERT's and HF Llama's)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, from {list(METHODS)}")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args(argv)
    if args.safetensors:
        from safetensors.numpy import load_file

        weights = {n: as_bf16(w) for n, w in load_file(args.safetensors).items() if w.dtype.kind == "f"}
        mlp = re.compile(args.mlp_pattern)
        groups = {"mlp": [n for n in weights if mlp.search(n) and "attention" not in n], "model": None}
    else:
        weights = {n: as_bf16(w) for n, w in host_weights(load_model(args.model)).items()}
        groups = GROUPS
    rows = []
    for group, names in groups.items():
        tensors = {n: w for n, w in weights.items() if names is None or n in names}
        before = sum(x.nbytes for x in tensors.values())
        for method in args.methods.split(","):
            t0 = time.monotonic()
            after = METHODS[method](tensors)
            rows.append({"group": group, "method": method, "bf16_bytes": before, "bytes": after,
                         "smaller": 1 - after / before, "seconds": time.monotonic() - t0})
            print(f"{group:>6} {method:>9}: {before / 1e6:9.2f} MB -> {after / 1e6:9.2f} MB "
                  f"({1 - after / before:6.2%} smaller, {rows[-1]['seconds']:.1f} s)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
