"""CPU micro-benchmark of the skinny matmul (`cpu_matmul`) against XLA's dot, in the model's layer scan.

    python -m infire_jax.bench.cpu_matmul [--dtype float32 bfloat16] [--rows 1 4 8 16 64 512] [--layers 30]

A stack of random dense layers shaped like the default model's (SmolLM2-135M: 30 layers, hidden
576, MLP 1536, 9 q heads and 3 kv heads of 64) multiplies T tokens through its four weights per
layer (q/k/v, o, gate/up, down), once with the model's einsums scanned over the stack (XLA's dot)
and once through the FFI call (`llama.linear` with `InPlace` weights) where it applies (float32
steps of at most 16 tokens; bfloat16 steps of any size on an AVX512-BF16 CPU; elsewhere both
columns are XLA's), and once more with the weights repacked into panels (`cpu_matmul.pack_panels`,
as the model runner keeps them), which the panel matmul takes at any step size. Reports ms per pass over the stack and
the weight bytes streamed per second; best of 3 loops of --iters passes; the speed-up is the
fastest column's over XLA's. For float32 on an AVX-512 CPU a last column keeps the layers as random
GGUF Q4_1 blocks (`--weights-quantization gguf`): read in place by `cpu_matmul.q4_1_matmul` in steps
of at most 16 tokens, dequantized in the layer body (XLA) in larger ones; its GB/s count the blocks.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from infire_jax.models import llama
from infire_jax.models.config import ModelConfig
from infire_jax.models.panels import PanelWeight, stack_view_shape
from infire_jax.models.parallel import Reductions
from infire_jax.quant.resident import QuantLayout, dequantize_layer
from pallas_kernels import cpu_kernels, cpu_matmul

LAYERS, EMBED, MLP, HEADS, KV_HEADS, HEAD_DIM = 30, 576, 1536, 9, 3, 64
CFG = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=EMBED, intermediate_size=MLP, num_layers=LAYERS,
                  num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)


def _stack(dtype, layers: int) -> dict[str, jax.Array]:
    rng = np.random.default_rng(0)
    n, e, f, hkv, d = layers, EMBED, MLP, KV_HEADS, HEAD_DIM
    shapes = {"wqkv": (n, e, hkv, HEADS // hkv + 2, d), "wo": (n, HEADS, d, e), "w_gate_up": (n, e, 2, f),
              "w_down": (n, f, e)}
    return {k: jnp.asarray(0.02 * rng.standard_normal(s, np.float32)).astype(dtype) for k, s in shapes.items()}


def _panels(weights: dict[str, jax.Array]) -> dict[str, PanelWeight]:
    return {k: PanelWeight(cpu_matmul.pack_panels(w.reshape(stack_view_shape(k, w.shape))), tuple(w.shape[1:]))
            for k, w in weights.items()}


def _q4_1_stack(layers: int) -> dict[str, dict[str, jax.Array]]:
    """The stack's weights as random Q4_1 parts in the model's layout (quant/resident.py)."""
    rng = np.random.default_rng(1)
    out = {}
    for name, w in _stack(jnp.float32, layers).items():
        specs = QuantLayout("Q4_1").part_specs(name, tuple(w.shape), (None,) * w.ndim)
        out[name] = {part: jnp.asarray(rng.integers(0, 256, shape, dtype=np.uint8)) if dtype == jnp.uint8
                     else jnp.asarray((0.002 * rng.standard_normal(shape)).astype(np.float16))
                     for part, (shape, dtype, _) in specs.items()}
    return out


def _pass(use_kernel: bool, x: jax.Array, weights: dict[str, jax.Array]) -> jax.Array:
    in_place = llama.in_place_weights(CFG, weights, x.shape[0], Reductions()) if use_kernel else {}
    scanned = {k: w for k, w in weights.items() if k not in in_place}

    def layer(h, xs):
        lp, idx = xs
        lp = llama.kernel_weights(dequantize_layer(lp, h.dtype), in_place, idx, h.shape[0], cpu=use_kernel)
        q, _, _ = llama.project_qkv(lp, h, False)
        h = h + llama.linear(q, lp["wo"], "thd,hde->te")
        return h + 0.01 * llama.dense_mlp(lp, h), None

    layers = len(jax.tree.leaves(weights)[0])
    return jax.lax.scan(layer, x, (scanned, jnp.arange(layers, dtype=jnp.int32)))[0]


def best_seconds(fn, *args, iters: int) -> float:
    """Seconds a call of `fn` takes: the best of 3 loops of `iters` calls, after one untimed."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / iters)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m infire_jax.bench.cpu_matmul", description=__doc__.split("\n")[0])
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16], help="tokens per step")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--layers", type=int, default=LAYERS, help="layers in the stack (the default model's 30)")
    args = p.parse_args(argv)
    if jax.default_backend() != "cpu" or not cpu_kernels.available():
        p.error("needs the CPU backend and a C++ compiler (see pallas_kernels/cpu_matmul.py)")
    print(f"{'dtype':>8} {'T':>4} {'XLA ms':>8} {'GB/s':>6} {'kernel ms':>10} {'GB/s':>6} {'panels ms':>10} "
          f"{'GB/s':>6} {'speed-up':>8} {'Q4_1 ms':>8} {'GB/s':>6}")
    for dtype in args.dtype:
        weights = _stack(jnp.dtype(dtype), args.layers)
        panels = _panels(weights) if cpu_matmul.panel_kernel(jnp.dtype(dtype)) else None
        quant = _q4_1_stack(args.layers) if dtype == "float32" and cpu_matmul.q4_1_kernel() else None
        nbytes = sum(w.nbytes for w in weights.values())
        for rows in args.rows:
            x = jnp.full((rows, EMBED), 0.01, jnp.dtype(dtype))
            xla = best_seconds(jax.jit(functools.partial(_pass, False)), x, weights, iters=args.iters)
            ffi = best_seconds(jax.jit(functools.partial(_pass, True)), x, weights, iters=args.iters)
            pan = (best_seconds(jax.jit(functools.partial(_pass, True)), x, panels, iters=args.iters)
                   if panels is not None else None)
            cells = f"{pan * 1e3:10.2f} {nbytes / pan / 1e9:6.1f}" if pan else f"{'-':>10} {'-':>6}"
            q = best_seconds(jax.jit(functools.partial(_pass, True)), x, quant, iters=args.iters) if quant else None
            qbytes = sum(a.nbytes for a in jax.tree.leaves(quant)) if quant else 0
            qcells = f"{q * 1e3:8.2f} {qbytes / q / 1e9:6.1f}" if q else f"{'-':>8} {'-':>6}"
            print(f"{dtype:>8} {rows:>4} {xla * 1e3:8.2f} {nbytes / xla / 1e9:6.1f} {ffi * 1e3:10.2f} "
                  f"{nbytes / ffi / 1e9:6.1f} {cells} {xla / min(ffi, pan or ffi):7.2f}x {qcells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
