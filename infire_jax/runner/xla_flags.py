"""XLA flags the engine needs on a GPU, set before jax starts its backend.

XLA reads `XLA_FLAGS` once, when the first backend is created; a flag set later does nothing. So
`infire_jax/__init__.py` calls `apply()` before anything can touch a device. The user's own
`XLA_FLAGS` win: a default is added only when the user did not name that flag. Every backend
parses them; the `xla_gpu_*` ones change nothing on a CPU, and the CPU test suite runs with the
rematerialization pass off too.

Measured on an H100 (`dummy:llama-3.1-8b`, bf16, batch-1 decode; ../shared/design/GPU.md):
  * `--xla_gpu_enable_triton_gemm=false`: 19.1 -> 10.4 ms/token. XLA's Triton GEMM fusions take
    their operands by value, so each layer's weights were copied out of the stacked `[layers, ...]`
    arrays every step (8.9 ms of copies); cuBLAS reads the slice in place.
  * `--xla_gpu_graph_min_graph_size=1`: 11.0 -> 10.2 ms/token: every run of kernels goes into a CUDA
    graph, so short ones launch without gaps.
Compiled for an H200 on a CPU machine (`bench gpu-compile --target h200`, jax 0.10.2; structure, not
timing; docs/PERFORMANCE.md):
  * `--xla_disable_hlo_passes=rematerialization`: XLA's rematerialization misjudges memory beside a
    donated KV pool (the 8B's 117 GB pool on an H200: "only reduced to 328 GiB", three times the pool)
    and, with the pool filling the card, recomputed and copied weights to save nothing: the 8B's
    prompt chunks went from 26 to 38 launches a layer and from 16 to 34 GB of copies a step, at the
    same peak. The pool is already sized beside the largest step's temporaries as compiled with a
    minimal pool, where the pass does nothing (kv_pool.py), so it has nothing left to win.
It also raises XLA's GPU allocator limit, `XLA_PYTHON_CLIENT_MEM_FRACTION`, from jax's 0.75 of
the card to 0.95 (unless the user set it), so that `--gpu-memory-utilization` (0.90 by default, of
the whole card) can be met: the KV pool is sized within both (infire_jax/runner/kv_pool.py).
`INFIRE_JAX_NO_XLA_FLAGS=1` leaves both variables untouched.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger(__name__)

ALLOCATOR_FRACTION_VAR = "XLA_PYTHON_CLIENT_MEM_FRACTION"
JAX_DEFAULT_ALLOCATOR_FRACTION = 0.75
DEFAULT_ALLOCATOR_FRACTION = "0.95"

DEFAULT_GPU_FLAGS: dict[str, str] = {
    "xla_gpu_enable_triton_gemm": "false",
    "xla_gpu_graph_min_graph_size": "1",
    "xla_disable_hlo_passes": "rematerialization",
}


def _flag_name(token: str) -> str:
    return token.lstrip("-").split("=", 1)[0]


def merged_flags(user: str, defaults: dict[str, str] = DEFAULT_GPU_FLAGS) -> str:
    """The user's flags, then each default whose name the user did not set."""
    tokens = user.split()
    named = {_flag_name(t) for t in tokens}
    tokens += [f"--{name}={value}" for name, value in defaults.items() if name not in named]
    return " ".join(tokens)


def backend_started() -> bool:
    """Whether jax has already created a backend (after which XLA_FLAGS is no longer read)."""
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge

    return bool(getattr(xla_bridge, "_backends", {}))


def allocator_fraction() -> float:
    """The fraction of the card XLA's GPU allocator may use, as jax reads it at backend start."""
    return float(os.environ.get(ALLOCATOR_FRACTION_VAR, JAX_DEFAULT_ALLOCATOR_FRACTION))


def apply() -> None:
    """Merges the defaults into `XLA_FLAGS`; warns if a backend already started without them."""
    if os.environ.get("INFIRE_JAX_NO_XLA_FLAGS"):
        return
    if not backend_started():
        os.environ.setdefault(ALLOCATOR_FRACTION_VAR, DEFAULT_ALLOCATOR_FRACTION)
    current = os.environ.get("XLA_FLAGS", "")
    merged = merged_flags(current)
    if merged == current:
        return
    if backend_started():
        log.warning("jax started its backend before infire_jax was imported, so XLA_FLAGS=%r is not "
                    "in effect; import infire_jax first (or set XLA_FLAGS yourself) for full GPU speed",
                    merged)
    os.environ["XLA_FLAGS"] = merged
