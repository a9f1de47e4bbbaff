"""The Gated DeltaNet of Qwen3.5's linear-attention layers over a step's packed tokens, with each
sequence's state in its request's device slot (runner/step_programs.py `DeviceCache.linear`).

A layer's state per sequence is what transformers' Qwen3_5GatedDeltaNet carries in its cache: the last
K - 1 inputs of its causal depthwise convolution ([K - 1, C]) and the delta rule's matrix ([Hv, Dk, Dv],
float32). A step's tokens come row after row (the attention metadata's `cu_q_lens`, `seq_ids`); each
row continues its slot's state, which its first step after admission finds zeroed (the runner resets
it). A token updates the state of the slot `token_slots` names: a padding token's, and a decode burst's
token of a row that already stopped, name the dummy slot (the last), so nothing is updated twice.

The delta rule (per v head, with k and q L2-normed and q scaled by Dk ** -0.5):
    S <- S * exp(g);  S <- S + k (beta (v - S^T k))^T;  o = S^T q
runs a chunk of tokens at a time (`chunked_delta_rule`: matmuls within the chunk, the state of every row
in the carry of a scan over the chunks); a decode burst, whose rows hold one token each, updates every
row at once.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from infire_jax.models.config import GatedDeltaNetConfig, ModelConfig
from pallas_kernels.attention import is_decode_only
from pallas_kernels.metadata import AttentionMetadata


# Tokens a step's delta rule takes at once (`chunked_delta_rule`), as the FLA kernels' chunks.
CHUNK = 64


class LinearState(NamedTuple):
    """Every linear layer's state per request slot, donated with the KV pool to every step."""

    conv: Float[Array, "L R K1 C"]  # the convolution's last K - 1 inputs, oldest first (channels as `qkv_order`)
    recurrent: Float[Array, "L R Hv Dk Dv"]  # the delta rule's matrix, float32


# The state's logical axes (sharding/plan.py): on a mesh, tp splits the channels and the v heads as it
# splits the layers' weights, so each device keeps the state of its own heads.
LINEAR_STATE_AXES = LinearState(conv=(None, None, None, "linear_qkv"),
                                recurrent=(None, None, "linear_heads", None, None))


def qkv_order(cfg: ModelConfig) -> np.ndarray:
    """The model's order of the convolution's channels, as indices into HF's (every k head's q, then every
    k, then every v head's v): grouped by k head, each group its q, its k, then its v heads' v. A mesh
    then splits q, k and v of whole head groups by splitting the channels evenly (Qwen3-Next's
    `in_proj_qkvz` groups them so too)."""
    g = cfg.gated_delta
    dk, dv = g.k_head_dim, g.num_v_heads // g.num_k_heads * g.v_head_dim
    kd = g.num_k_heads * dk
    return np.concatenate([np.concatenate([np.arange(h * dk, (h + 1) * dk), kd + np.arange(h * dk, (h + 1) * dk),
                                           2 * kd + np.arange(h * dv, (h + 1) * dv)])
                           for h in range(g.num_k_heads)])


def linear_state_shapes(cfg: ModelConfig, num_slots: int, dtype) -> LinearState | None:
    """(shape, dtype) of a model's linear-attention state for `num_slots` slots, or None without linear layers:
    the convolution's inputs in the model's dtype, the delta rule's matrices in float32 (as HF computes them).
    The runner allocates it (runner/device_memory.py); `infire-jax plan` counts it (memplan/model.py)."""
    g = cfg.gated_delta
    if g is None:
        return None
    n = cfg.num_linear_layers
    return LinearState(((n, num_slots, g.conv_kernel - 1, g.conv_dim), jnp.dtype(dtype)),
                       ((n, num_slots, g.num_v_heads, g.k_head_dim, g.v_head_dim), jnp.dtype(jnp.float32)))


def default_snapshots(max_num_seqs: int) -> int:
    """Copies of a slot's state the prefix cache keeps (core/state_cache.py) unless asked otherwise: the
    engine allocates them (engine/setup.py), `infire-jax plan` counts them."""
    return min(16, max_num_seqs)


class LinearStep(NamedTuple):
    """The state and which slot each token of the step updates (the dummy slot: none)."""

    state: LinearState
    token_slots: Int[Array, "T"]


class LinearInputs(NamedTuple):
    """What a verifying step's tokens put into each linear layer's state: its convolution's inputs and the
    delta rule's decay and strength. Such a step leaves the state as it found it; once the verifier has
    decided, the state advances over the tokens it kept (`replay_kept`). A proposal it rejected never
    enters the state, which, unlike the KV pool, no later write would correct."""

    qkv: Float[Array, "L T C"]
    decay: Float[Array, "L T Hv"]
    beta: Float[Array, "L T Hv"]


# Their logical axes: on a mesh each device keeps its own heads' (as LINEAR_STATE_AXES).
LINEAR_INPUTS_AXES = LinearInputs(qkv=(None, None, "linear_qkv"), decay=(None, None, "linear_heads"),
                                  beta=(None, None, "linear_heads"))


def linear_inputs_shapes(cfg: ModelConfig, num_tokens: int, dtype) -> LinearInputs:
    """(shape, dtype) of a step's LinearInputs (on a mesh: the whole, split by LINEAR_INPUTS_AXES)."""
    g, n = cfg.gated_delta, cfg.num_linear_layers
    heads = ((n, num_tokens, g.num_v_heads), jnp.dtype(jnp.float32))
    return LinearInputs(((n, num_tokens, g.conv_dim), jnp.dtype(dtype)), heads, heads)


class Rows(NamedTuple):
    """Where each token and row of the step stands, for the convolution's window and the state's slot."""

    offset: Int[Array, "T"]  # the token's index within its row in this step
    row: Int[Array, "T"]  # its row, or S (an extra, discarded row) when it updates no slot
    row_slot: Int[Array, "S"]  # the slot each row reads and writes (the dummy slot for a row with no live token)
    row_len: Int[Array, "S"]
    last: Int[Array, "S"]  # each row's last token


def step_rows(meta: AttentionMetadata, token_slots: Int[Array, "T"], dummy: int,
              kept: Bool[Array, "T"] | None = None) -> Rows:
    """Where the step's tokens stand in their rows. `kept` (`replay_kept`): the tokens that update their
    slot, a prefix of each row; the rest update none."""
    cu = meta.cu_q_lens
    s = cu.shape[0] - 1
    t = jnp.arange(token_slots.shape[0], dtype=jnp.int32)
    offset = t - cu[jnp.clip(meta.seq_ids, 0, s - 1)]
    if kept is None:
        row_len = cu[1:] - cu[:-1]
    else:
        row_len = jax.ops.segment_sum(kept.astype(jnp.int32), meta.seq_ids, s)  # padding's seq_id S: dropped
    last = jnp.clip(cu[:-1] + row_len - 1, 0, token_slots.shape[0] - 1)
    row_slot = jnp.where(row_len > 0, token_slots[last], dummy)
    updates = token_slots != dummy if kept is None else kept & (token_slots != dummy)
    row = jnp.where(updates, meta.seq_ids, s)
    return Rows(offset, row, row_slot, row_len, last)


def _window(x: Float[Array, "T C"], saved: Float[Array, "N K1 C"], t: Int[Array, "N"], offset: Int[Array, "N"],
            lag: int) -> Float[Array, "N C"]:
    """The input `lag` tokens before token t of its row: from this step (lag <= offset), else from its slot's
    saved inputs (`saved`, gathered for each of the N)."""
    k1 = saved.shape[1]
    n = jnp.arange(saved.shape[0])
    from_slot = saved[n, jnp.clip(k1 - (lag - offset), 0, k1 - 1)]
    return jnp.where((lag <= offset)[:, None], x[jnp.clip(t - lag, 0, x.shape[0] - 1)], from_slot)


def causal_conv(x: Float[Array, "T C"], weight: Float[Array, "K C"], conv: Float[Array, "L R K1 C"],
                layer: Int[Array, ""], rows: Rows, token_slots: Int[Array, "T"]
                ) -> tuple[Float[Array, "T C"], Float[Array, "L R K1 C"]]:
    """SiLU of the depthwise causal convolution of each token's last K inputs (HF's conv1d: weight[K - 1]
    takes the token's own), and the slots' saved inputs of `layer` updated to each row's last K - 1
    (written in place: only the step's rows)."""
    kernel = weight.shape[0]
    t = jnp.arange(x.shape[0], dtype=jnp.int32)
    # Each read of the saved inputs gathered once, before the write: XLA then updates the state in place
    # (with the reads fused into several consumers, it copied the whole state every layer instead).
    by_token, by_row = jax.lax.optimization_barrier((conv[layer, token_slots], conv[layer, rows.row_slot]))
    acc = jnp.zeros(x.shape, jnp.float32)
    for i in range(kernel):
        acc = acc + weight[i].astype(jnp.float32) * _window(x, by_token, t, rows.offset,
                                                           kernel - 1 - i).astype(jnp.float32)
    out = jax.nn.silu(acc).astype(x.dtype)
    saved = jnp.stack([_window(x, by_row, rows.last, rows.row_len - 1, kernel - 2 - i) for i in range(kernel - 1)],
                      axis=1)
    return out, conv.at[layer, rows.row_slot].set(saved.astype(conv.dtype))


def l2_norm(x: Float[Array, "... D"], eps: float = 1e-6) -> Float[Array, "... D"]:
    """x / sqrt(sum x^2 + eps), as the FLA kernels and transformers compute it."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _delta_step(state: Float[Array, "... Hv Dk Dv"], q, k, v, g, beta):
    """One token's update of its state and its output (float32; q, k [.., Hv, Dk], v [.., Hv, Dv])."""
    state = state * jnp.exp(g)[..., None, None]
    memory = jnp.einsum("...hkv,...hk->...hv", state, k)
    delta = (v - memory) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return state, jnp.einsum("...hkv,...hk->...hv", state, q)


def gated_delta_rule(q: Float[Array, "T Hk Dk"], k: Float[Array, "T Hk Dk"], v: Float[Array, "T Hv Dv"],
                     g: Float[Array, "T Hv"], beta: Float[Array, "T Hv"], recurrent: Float[Array, "L R Hv Dk Dv"],
                     layer: Int[Array, ""], rows: Rows, token_slots: Int[Array, "T"]
                     ) -> tuple[Float[Array, "T Hv Dv"], Float[Array, "L R Hv Dk Dv"]]:
    """Each token's output and the slots' states of `layer` after the step (float32 throughout; written in
    place, only the step's rows)."""
    f32 = jnp.float32
    group = v.shape[1] // q.shape[1]
    q = jnp.repeat(l2_norm(q.astype(f32)), group, axis=1) * q.shape[-1] ** -0.5
    k = jnp.repeat(l2_norm(k.astype(f32)), group, axis=1)
    v, g, beta = v.astype(f32), g.astype(f32), beta.astype(f32)
    if is_decode_only():  # one token a row: every row's state at once
        # The rows' states gathered once, before the write (as `causal_conv`'s): fused into several consumers,
        # the read made XLA copy the layer's whole state before writing it (on a tp mesh, for an H100).
        start = jax.lax.optimization_barrier(recurrent[layer, token_slots])
        state, out = _delta_step(start, q, k, v, g, beta)
        return out, recurrent.at[layer, token_slots].set(state)
    s = rows.row_slot.shape[0]
    carry = jnp.concatenate([recurrent[layer, rows.row_slot], jnp.zeros((1, *recurrent.shape[2:]), f32)])
    out, carry = chunked_delta_rule(q, k, v, g, beta, carry, rows.row, CHUNK)
    return out, recurrent.at[layer, rows.row_slot].set(carry[:s])


def _segments(row: Int[Array, "C"]) -> tuple[Int[Array, "C"], Int[Array, "C"]]:
    """The index of the first and of the last token of each token's run of equal rows in a chunk."""
    c = row.shape[0]
    i = jnp.arange(c)
    starts = jnp.concatenate([jnp.ones(1, bool), row[1:] != row[:-1]])
    ends = jnp.concatenate([row[1:] != row[:-1], jnp.ones(1, bool)])
    first = jax.lax.cummax(jnp.where(starts, i, 0))
    last = jax.lax.cummin(jnp.where(ends, i, c - 1), reverse=True)
    return first, last


def unit_lower_inverse(strict: Float[Array, "... C C"]) -> Float[Array, "... C C"]:
    """(I + L)^-1 for a strictly lower-triangular L, by matmuls alone: L^C = 0, so the inverse is
    I - L + L^2 - ... = (I - L)(I + L^2)(I + L^4)...(I + L^(2^(m-1))), 2^m >= C. No triangular solve: on
    CPU that is a LAPACK call whose functions jaxlib binds only when such a program is traced, so a
    warm start running a cached executable crashed in it; on a GPU, cuBLAS' solve. Full float32."""
    c = strict.shape[-1]
    eye = jnp.eye(c, dtype=strict.dtype)
    matmul = functools.partial(jnp.matmul, precision=jax.lax.Precision.HIGHEST)
    inverse, power = eye - strict, strict
    for _ in range(max(1, math.ceil(math.log2(c))) - 1):
        power = matmul(power, power)
        inverse = matmul(inverse, eye + power)
    return inverse


def chunked_delta_rule(q: Float[Array, "T H Dk"], k: Float[Array, "T H Dk"], v: Float[Array, "T H Dv"],
                       g: Float[Array, "T H"], beta: Float[Array, "T H"], states: Float[Array, "S1 H Dk Dv"],
                       row: Int[Array, "T"], chunk: int) -> tuple[Float[Array, "T H Dv"], Float[Array, "S1 H Dk Dv"]]:
    """The delta rule over packed rows, a chunk of tokens at a time (the chunked form of the FLA kernels and
    transformers' torch_chunk_gated_delta_rule, with the chunk's rows kept apart): `states` holds each row's
    state (row S1 - 1: tokens that update none), continued from chunk to chunk. Within a chunk, with G the
    cumulative decay of each token's run of its row and D[i, j] = exp(G_i - G_j) between tokens of one row:
        T = (I + strictly_lower(beta_i k_i.k_j D_ij))^-1,  U = T (beta v),  W = T (beta exp(G) k),
        V' = U - W S0,  o = exp(G) q S0 + lower(q_i.k_j D_ij) V',
        S_row <- exp(G_last) S0 + sum over the row's tokens of exp(G_last - G_t) k_t V'_t^T,
    with S0 the state of the token's row when the chunk starts, written by the run's last token."""
    t, h = g.shape
    chunk = min(chunk, t)
    n = -(-t // chunk)
    pad = n * chunk - t
    dummy = states.shape[0] - 1

    def chunks(a, fill=0):
        if pad:
            a = jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1), constant_values=fill)
        return a.reshape(n, chunk, *a.shape[1:])

    q, k, v, g, beta, row = chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta), chunks(row, dummy)
    # What does not depend on the state, for every chunk at once: only the state's recurrence is a loop.
    first, last = jax.vmap(_segments)(row)  # [n, C]
    cum = jnp.cumsum(g, axis=1)  # [n, C, H]
    base = jnp.where((first > 0)[..., None], jnp.take_along_axis(cum, jnp.maximum(first - 1, 0)[..., None], 1), 0.0)
    seg = cum - base  # the decay since the token's run began, through the token
    lower = jnp.tril(jnp.ones((chunk, chunk), bool))
    same = (row[:, :, None] == row[:, None, :]) & lower
    decay = jnp.exp(jnp.where(same[..., None], seg[:, :, None] - seg[:, None], -jnp.inf))  # [n, C, C, H]
    decay = jnp.moveaxis(decay, 3, 1)  # [n, H, C, C]: 0 across rows and above the diagonal
    eye = jnp.eye(chunk, dtype=jnp.float32)
    kb = k * beta[..., None]
    strict = jnp.einsum("nihd,njhd->nhij", kb, k) * decay * (1 - eye)
    solve = unit_lower_inverse(strict)
    u = jnp.einsum("nhij,njhd->nihd", solve, v * beta[..., None])
    w = jnp.einsum("nhij,njhd->nihd", solve, kb * jnp.exp(seg)[..., None])
    attn = jnp.einsum("nihd,njhd->nhij", q, k) * decay
    q_decayed = q * jnp.exp(seg)[..., None]
    k_to_end = k * jnp.exp(jnp.take_along_axis(seg, last[..., None], 1) - seg)[..., None]
    is_last = jnp.arange(chunk) == last
    run = jnp.where(is_last[:, :, None], same, False).astype(jnp.float32)  # [n, C, C]: a run's last token, its run
    # Each run's last token writes its row's state; the others write nowhere (an index past the rows, dropped).
    dest = jnp.where(is_last, row, states.shape[0])

    def body(states, xs):
        row, dest, u, w, attn, q_decayed, k_to_end, run, seg = xs
        start = states[row]  # [C, H, Dk, Dv]: each token's row's state
        v_new = u - jnp.einsum("thk,thkv->thv", w, start)
        out = jnp.einsum("thk,thkv->thv", q_decayed, start) + jnp.einsum("hij,jhd->ihd", attn, v_new)
        end = start * jnp.exp(seg)[..., None, None] + jnp.einsum("tj,jhk,jhv->thkv", run, k_to_end, v_new)
        return states.at[dest].set(end, mode="drop"), out

    states, out = jax.lax.scan(body, states, (row, dest, u, w, attn, q_decayed, k_to_end, run, seg))
    return out.reshape(n * chunk, h, -1)[:t], states


def delta_net(qkv: Float[Array, "T C"], decay: Float[Array, "T Hv"], beta: Float[Array, "T Hv"],
              conv_weight: Float[Array, "K C"], state: LinearState, layer: Int[Array, ""], rows: Rows,
              token_slots: Int[Array, "T"], g: GatedDeltaNetConfig) -> tuple[Float[Array, "T Hv Dv"], LinearState]:
    """A DeltaNet's core after its projections: the convolution, then the delta rule over this device's heads
    (the channels grouped by k head, `qkv_order`: each group its q, its k, then its v heads' v). Each token's
    output and the state of linear layer `layer` after the step."""
    t, dk, dv = qkv.shape[0], g.k_head_dim, g.v_head_dim
    mixed, conv = causal_conv(qkv, conv_weight, state.conv, layer, rows, token_slots)
    grouped = mixed.reshape(t, -1, 2 * dk + g.num_v_heads // g.num_k_heads * dv)
    q, k = grouped[..., :dk], grouped[..., dk:2 * dk]
    v = grouped[..., 2 * dk:].reshape(t, -1, dv)
    out, recurrent = gated_delta_rule(q, k, v, decay, beta, state.recurrent, layer, rows, token_slots)
    return out, LinearState(conv, recurrent)


def replay_kept(inputs: LinearInputs, conv_weights: Float[Array, "L K C"], state: LinearState,
                meta: AttentionMetadata, token_slots: Int[Array, "T"], kept: Bool[Array, "T"],
                g: GatedDeltaNetConfig) -> LinearState:
    """Every linear layer's state advanced, from where a verifying step found it, over the tokens the verifier
    kept (`kept`: a prefix of each row), from the step's recorded inputs: the state the step would have left
    had it held those tokens alone."""
    rows = step_rows(meta, token_slots, state.conv.shape[1] - 1, kept)

    def layer(state, xs):
        qkv, decay, beta, weight, i = xs
        return delta_net(qkv, decay, beta, weight, state, i, rows, token_slots, g)[1], None

    index = jnp.arange(conv_weights.shape[0], dtype=jnp.int32)
    state, _ = jax.lax.scan(layer, state, (*inputs, conv_weights, index))
    return state
