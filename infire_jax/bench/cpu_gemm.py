"""CPU GEMM rates of the bfloat16 layer products: XLA's dot, the hand-written panel kernel, oneDNN.

    python -m infire_jax.bench.cpu_gemm [--model smollm2-135m llama-3.1-8b] [--rows 1 8 512]

For each dense weight of a layer ([K, N]: q/k/v, o, gate/up, down) and each step size, GFLOP/s
(2 M K N over the best of 3 loops of --iters calls) of x [M, K] @ w in bfloat16 with float32 sums:
- XLA: `jnp.dot` with float32 accumulation, as the layer body does without a kernel;
- panels: `cpu_matmul`'s `vdpbf16ps` kernel on the panels (AVX512-BF16 CPUs);
- oneDNN: the same panels through `cpu_onednn` (its AMX tile kernels where the CPU has them, else
  its AVX-512 ones; the ISA is printed), which the models take on AMX CPUs for steps of at least
  `cpu_onednn.MIN_ROWS` rows.
One weight of each shape (no layer stack), so a small model's weights sit in the caches: these are
compute rates, not the memory-bound decode rates of `bench.cpu_matmul`.
"""

from __future__ import annotations

import argparse
import os
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from infire_jax.bench.cpu_matmul import best_seconds
from pallas_kernels import cpu_kernels, cpu_matmul, cpu_onednn

# hidden, MLP, q heads, kv heads, head dim
MODELS = {"smollm2-135m": (576, 1536, 9, 3, 64), "llama-3.1-8b": (4096, 14336, 32, 8, 128)}


def layer_shapes(model: str) -> dict[str, tuple[int, int]]:
    """[K, N] of each dense layer weight, as the Llama layer multiplies them (q/k/v and gate/up fused)."""
    e, f, h, hkv, d = MODELS[model]
    return {"wqkv": (e, (h + 2 * hkv) * d), "wo": (h * d, e), "w_gate_up": (e, 2 * f), "w_down": (f, e)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m infire_jax.bench.cpu_gemm", description=__doc__.split("\n")[0])
    p.add_argument("--model", nargs="+", default=["smollm2-135m"], choices=sorted(MODELS))
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 512], help="tokens per step (M)")
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args(argv)
    if jax.default_backend() != "cpu" or not cpu_kernels.available():
        p.error("needs the CPU backend and a C++ compiler (see pallas_kernels/cpu_kernels.py)")
    has_panels = cpu_matmul.panel_kernel(jnp.bfloat16)
    print(f"oneDNN: {cpu_onednn.isa() or 'not available'}; {os.cpu_count()} CPUs")
    print(f"{'model':>13} {'weight':>9} {'K':>6} {'N':>6} {'M':>5} {'XLA':>7} {'panels':>7} {'oneDNN':>7}  GFLOP/s")
    xla = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32))
    hand = jax.jit(cpu_matmul.panel_matmul)
    onednn = jax.jit(cpu_onednn.panel_matmul)
    # the panels column is the hand-written kernel at every M (panel_matmul would hand oneDNN its steps on AMX)
    with mock.patch.dict(os.environ, {"INFIRE_JAX_NO_ONEDNN": "1"}):
        rng = np.random.default_rng(0)
        for model in args.model:
            for name, (k, n) in layer_shapes(model).items():
                w = jnp.asarray(0.02 * rng.standard_normal((k, n), np.float32)).astype(jnp.bfloat16)
                panels = jax.jit(cpu_matmul.pack_panels)(w[None])
                for m in args.rows:
                    x = jnp.asarray(rng.standard_normal((m, k), np.float32)).astype(jnp.bfloat16)
                    flops = 2 * m * k * n
                    rates = [flops / best_seconds(xla, x, w, iters=args.iters) / 1e9]
                    for ok, fn in ((has_panels, hand), (cpu_onednn.library() is not None and k % 32 == 0, onednn)):
                        seconds = best_seconds(fn, x, panels, jnp.int32(0), iters=args.iters) if ok else None
                        rates.append(flops / seconds / 1e9 if ok else None)
                    cells = " ".join(f"{'-':>7}" if r is None else f"{r:7.0f}" if r >= 10 else f"{r:7.2f}"
                                     for r in rates)
                    print(f"{model:>13} {name:>9} {k:>6} {n:>6} {m:>5} {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
