"""Roofline: what a step must move or compute, and what this device measurably can.

Decode is bound by memory: a step reads every weight it uses once, plus each sequence's cached K
and V, so bytes per step ÷ step time, over the bandwidth of a large on-device copy, says how close
decode runs to the hardware. Prefill is bound by compute: its FLOPs ÷ time, over the rate of a
large matmul in the model's dtype. Both ceilings are measured here, never taken from a spec sheet.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from typing import Callable, Sequence

import numpy as np

from infire_jax.models.config import ModelConfig
from infire_jax.models.kv_entry import kv_entry


@dataclasses.dataclass(frozen=True)
class DevicePeaks:
    """The measured ceilings of one device, and how many such devices the engine spans."""

    device: str
    backend: str
    bandwidth: float  # bytes/s of an on-device copy (bytes read + bytes written)
    matmul_flops: float  # FLOP/s of a square matmul in `dtype`
    dtype: str
    copy_bytes: int  # size of the array copied
    matmul_size: int  # n of the n x n x n matmul
    num_devices: int = 1

    @property
    def total_bandwidth(self) -> float:
        return self.bandwidth * self.num_devices

    @property
    def total_matmul_flops(self) -> float:
        return self.matmul_flops * self.num_devices

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _best_seconds(fn: Callable, args: tuple, iters: int, repeats: int, *, carry: bool = False) -> float:
    """Fastest mean time of `iters` back-to-back calls, over `repeats` tries (after a warm call).

    With `carry`, each call's output is the next call's (donated) input.
    """
    import jax

    out = fn(*args)
    jax.block_until_ready(out)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(out) if carry else fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / iters)
    return best


def measure_bandwidth(nbytes: int, iters: int = 10, repeats: int = 3) -> float:
    """Bytes/s of an in-place elementwise copy of `nbytes` (counting the read and the write).

    The buffer is donated, so every call rewrites the same memory: a fresh output buffer per call
    would time the allocator (page faults on a CPU) instead of the memory.
    """
    import jax
    import jax.numpy as jnp

    x = jnp.zeros(nbytes // 4, jnp.float32)
    # An identity would be forwarded without a copy; adding one forces a read and a write.
    copy = jax.jit(lambda a: a + 1, donate_argnums=0)
    seconds = _best_seconds(copy, (x,), iters, repeats, carry=True)
    return 2 * (nbytes // 4) * 4 / seconds


def measure_matmul_rate(n: int, dtype, iters: int = 5, repeats: int = 3) -> float:
    """FLOP/s of an n x n x n matmul in `dtype` (2 n^3 FLOPs each): the fastest of XLA's dot and, on
    CPU, the engine's own matmul kernels where they take the shape (bfloat16 through `vdpbf16ps` runs
    about 1.5x XLA's bfloat16 dot here, on panels faster still), so no step can exceed the ceiling
    by using them."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import cpu_matmul

    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (n, n), dtype)
    b = jax.random.normal(kb, (n, n), dtype)
    matmuls = [jax.jit(lambda p, q: p @ q)]
    if cpu_matmul.applies(n, b[None]):
        matmuls.append(jax.jit(lambda p, q: cpu_matmul.skinny_matmul(p, q[None], jnp.int32(0))))
    if cpu_matmul.panels_apply(b[None]):
        panels = jax.jit(cpu_matmul.pack_panels)(b[None])
        matmuls.append(jax.jit(lambda p, q: cpu_matmul.panel_matmul(p, panels, jnp.int32(0))))
    seconds = min(_best_seconds(fn, (a, b), iters, repeats) for fn in matmuls)
    return 2 * n ** 3 / seconds


def measure_peaks(dtype) -> DevicePeaks:
    """Measures the default device. Run it before the engine takes the device memory for its KV pool."""
    import jax
    import jax.numpy as jnp

    on_gpu = jax.default_backend() == "gpu"
    # Large enough to leave every cache behind: 1 GiB on a GPU, 128 MiB on a CPU (its L3 is far smaller).
    nbytes = (1 << 30) if on_gpu else (1 << 27)
    n = 8192 if on_gpu else 1024
    return DevicePeaks(device=jax.devices()[0].device_kind, backend=jax.default_backend(),
                       bandwidth=measure_bandwidth(nbytes), matmul_flops=measure_matmul_rate(n, dtype),
                       dtype=jnp.dtype(dtype).name, copy_bytes=nbytes, matmul_size=n)


# ---- what the model needs per step ----------------------------------------------------------------

def _attention_params(cfg: ModelConfig) -> int:
    """One layer's attention projections: q/k/v/o, or MLA's low-rank q, latent kv and up-projections."""
    e, h = cfg.hidden_size, cfg.num_heads
    if cfg.mla is None:
        return e * cfg.head_dim * (2 * h + 2 * cfg.num_kv_heads)
    m = cfg.mla
    return (e * m.q_lora_rank + m.q_lora_rank * h * (m.qk_nope_head_dim + m.qk_rope_head_dim)
            + e * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * h * (m.qk_nope_head_dim + m.v_head_dim)
            + h * m.v_head_dim * e)


def _moe_layers(cfg: ModelConfig) -> int:
    """Layers with experts (DeepSeek-V3 keeps its first `first_k_dense_replace` dense; Llama 4 interleaves)."""
    if not cfg.is_moe:
        return 0
    if cfg.llama4 is not None:
        return cfg.llama4.stack_sizes["moe"]
    return cfg.num_layers - (cfg.deepseek_moe.first_k_dense_replace if cfg.deepseek_moe else 0)


def layer_matmul_params(cfg: ModelConfig) -> int:
    """Weights one token multiplies through in all decoder layers (the routed experts only, for MoE)."""
    e = cfg.hidden_size
    moe = _moe_layers(cfg)
    routed = 0
    if moe:
        shared = cfg.deepseek_moe.num_shared_experts if cfg.deepseek_moe else int(cfg.llama4 is not None)
        routed = (cfg.num_experts_per_tok + shared) * 3 * e * cfg.moe_intermediate_size + e * cfg.num_experts
    return cfg.num_layers * _attention_params(cfg) + moe * routed + (cfg.num_layers - moe) * 3 * e * cfg.intermediate_size


def forward_flops(cfg: ModelConfig, new_tokens: int, cached_tokens: int, sampled_rows: int = 1) -> int:
    """FLOPs of one sequence's step over `new_tokens` that follow `cached_tokens` already in the KV cache.

    2 per multiply-add: the layer weights for every new token (the embedding is a gather, no FLOPs),
    the LM head for the rows that sample, and causal attention (QK^T and PV), where new token i
    attends to cached_tokens + i + 1 keys in a global layer, fewer in a chunked or window layer.
    """
    keys = sum(count * keys_attended(chunk, window, cached_tokens, new_tokens)
               for (chunk, window), count in _layer_kinds(cfg).items())
    if cfg.mla is None:
        per_key = 2 * cfg.head_dim  # q.k and p.v over head_dim each
    else:  # the absorbed form: q.latent + q.rope key, then p.latent
        per_key = 2 * cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
    attention = 2 * cfg.num_heads * per_key * keys
    head = 2 * cfg.hidden_size * cfg.vocab_size * sampled_rows
    return 2 * layer_matmul_params(cfg) * new_tokens + head + attention


def expected_experts_touched(num_experts: int, per_token: int, batch: int) -> float:
    """Distinct experts that `batch` tokens route to, in expectation, when routing is uniform."""
    return num_experts * (1 - (1 - per_token / num_experts) ** batch)


def decode_weight_bytes(cfg: ModelConfig, itemsize: float, batch: int) -> float:
    """Weight bytes one decode step of `batch` sequences reads.

    Every weight counts once, except: an untied input embedding is only gathered (`batch` rows),
    and of an MoE layer's experts only those the batch routes to are read.
    """
    e = cfg.hidden_size
    params = float(cfg.param_count())
    if not cfg.tie_word_embeddings:
        params -= (cfg.vocab_size - batch) * e
    if cfg.is_moe:
        idle = cfg.num_experts - expected_experts_touched(cfg.num_experts, cfg.num_experts_per_tok, batch)
        params -= _moe_layers(cfg) * idle * 3 * e * cfg.moe_intermediate_size
    return params * itemsize


def visible_keys(chunk: int, window: int, context: int) -> int:
    """Keys a decode query at position context - 1 attends to: its chunk's start to itself in a chunked
    layer, the last `window` in a sliding-window layer, every one in a global layer."""
    if chunk:
        return (context - 1) % chunk + 1
    return min(context, window) if window else context


def keys_attended(chunk: int, window: int, cached: int, new: int) -> int:
    """Keys that `new` tokens following `cached` ones attend to in one layer, summed over the tokens."""
    if not (chunk or window):
        return new * cached + new * (new + 1) // 2
    positions = np.arange(cached, cached + new, dtype=np.int64)
    return int(np.sum(positions % chunk + 1 if chunk else np.minimum(positions + 1, window)))


def _layer_kinds(cfg: ModelConfig) -> collections.Counter:
    """How many layers attend with each (chunk, window); (0, 0) is global attention."""
    return collections.Counter(cfg.local_attention or ((0, 0),) * cfg.num_layers)


def kv_bytes_read(cfg: ModelConfig, itemsize: int, contexts: Sequence[int]) -> tuple[int, int]:
    """Bytes of K and V one decode step reads over all layers (MLA: latent + rope key), and the part of
    them that chunked and sliding-window layers read, which stays flat as contexts grow."""
    entry = kv_entry(cfg)
    per_token = entry.heads * (entry.k_dim + entry.v_dim) * itemsize
    total = local_part = 0
    for (chunk, window), count in _layer_kinds(cfg).items():
        tokens = count * sum(visible_keys(chunk, window, c) for c in contexts)
        total += tokens
        local_part += tokens if chunk or window else 0
    return total * per_token, local_part * per_token


def decode_step_bytes(cfg: ModelConfig, itemsize: int, contexts: Sequence[int],
                      weight_itemsize: float | None = None) -> float:
    """Bytes one decode step reads: the weights (`weight_itemsize` bytes a parameter, default
    `itemsize`: quantized or compressed weights hold fewer), plus each sequence's K and V over the keys
    each layer sees, `itemsize` bytes an element (the pool's: 1 for fp8)."""
    return decode_weight_bytes(cfg, weight_itemsize or itemsize, len(contexts)) + kv_bytes_read(cfg, itemsize, contexts)[0]
