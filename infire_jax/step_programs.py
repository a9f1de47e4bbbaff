"""The device programs of a step, as pure functions of the weights, the pool and the step's
batch; the runner (runner.py) jits, compiles and launches them.

- `forward`: the model over the step's tokens (embed, the decoder layers over the paged pool,
  the LM head at each row's last token), and each slot's token history for the penalties;
- `sample_step` / `verify_step`: the sampler, or the verifier of a step carrying proposals;
- `read_pages` / `write_pages`: a prompt's KV pages out of and into the pool (KV transfer);
- `load_history`: one slot's token history rebuilt (a preempted request coming back).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from infire_jax.batch import TOKEN_OUTPUT, TOKEN_PROMPT, DraftInputs, StepBatch
from infire_jax.sampler import SamplerOutput, SamplingInputs, sample
from infire_jax.speculative.verify import VerifyOutput, count_accepted, verify
from pallas_kernels.reference import from_storage, to_storage
from sharding.plan import ShardPlan


class DeviceCache(NamedTuple):
    """State that lives on the device across steps; donated to every step."""

    k_pages: Float[Array, "L N ps Hkv Dk"]  # shapes: models/kv_entry.py (MLA: the latent)
    v_pages: Float[Array, "L N ps Hkv Dv"]  # (MLA: the rotary key)
    counts: Int[Array, "R V"]  # output-token counts per request slot (penalties)
    prompt_mask: Bool[Array, "R V"]  # prompt tokens per request slot (repetition penalty)
    last_tokens: Int[Array, "R"]  # last sampled token per slot (asynchronous scheduling)


def matmul_precision(dtype) -> str:
    """float32 means float32: full-precision dots, where XLA on a GPU would otherwise use TF32."""
    return "highest" if jnp.dtype(dtype) == jnp.float32 else "default"


class StepForward(NamedTuple):
    """What the forward of a step leaves on the device for the sampler and the step's observer."""

    cache: DeviceCache
    logits: Float[Array, "S V"]  # float32, at each row's logits_indices
    tokens: Int[Array, "T"]  # the step's token ids, the device's last samples filled in
    aux: Float[Array, "T N"] | None  # residual-stream states at RunnerConfig.aux_layers (EAGLE-3), else None


def forward(graphdef: nnx.GraphDef, attn_impl: str, plan: ShardPlan | None, precision: str,
             aux_layers: tuple[int, ...] | None, state: nnx.State, cache: DeviceCache, b: StepBatch) -> StepForward:
    """The model over this step's tokens: updated pool and history, and each row's float32 logits."""
    with jax.default_matmul_precision(precision):
        return forward_body(graphdef, attn_impl, plan, aux_layers, state, cache, b)


def token_slots(b: StepBatch, num_slots: int) -> Int[Array, "T"]:
    """The request slot of each token of the step (padding: the dummy slot)."""
    rows = b.row_slots.shape[0]
    valid = b.meta.seq_ids < rows
    return jnp.where(valid, b.row_slots[jnp.clip(b.meta.seq_ids, 0, rows - 1)], num_slots - 1)


def step_tokens(b: StepBatch, last_tokens: Int[Array, "R"]) -> Int[Array, "T"]:
    """The step's token ids, with the device's last samples where the host did not know them yet."""
    return jnp.where(b.from_device, last_tokens[token_slots(b, last_tokens.shape[0])], b.token_ids)


def forward_body(graphdef, attn_impl, plan, aux_layers, state, cache: DeviceCache, b: StepBatch) -> StepForward:
    model = nnx.merge(graphdef, state)
    dummy = cache.last_tokens.shape[0] - 1
    tok_slot = token_slots(b, cache.last_tokens.shape[0])
    tokens = step_tokens(b, cache.last_tokens)

    # Each slot's token history, for the penalties: reset on admission, then add this step's tokens.
    reset = jnp.where(b.reset_rows, b.row_slots, dummy)
    counts = cache.counts.at[reset].set(0)
    prompt_mask = cache.prompt_mask.at[reset].set(False)
    counts = counts.at[jnp.where(b.token_kind == TOKEN_OUTPUT, tok_slot, dummy), tokens].add(1)
    prompt_mask = prompt_mask.at[jnp.where(b.token_kind == TOKEN_PROMPT, tok_slot, dummy), tokens].set(True)

    aux = None
    if aux_layers is None:
        logits, (k_pages, v_pages) = model(
            tokens, (cache.k_pages, cache.v_pages), b.meta, b.logits_indices, attn_impl=attn_impl, plan=plan)
    else:
        logits, (k_pages, v_pages), aux = model(tokens, (cache.k_pages, cache.v_pages), b.meta, b.logits_indices,
                                                attn_impl=attn_impl, plan=plan, aux_layers=aux_layers)
    if plan is not None:  # gather the vocab-split logits once, so the sampler holds no collectives
        logits = jax.lax.with_sharding_constraint(logits, plan.replicated)
    return StepForward(DeviceCache(k_pages, v_pages, counts, prompt_mask, cache.last_tokens), logits, tokens, aux)


def sample_step(variant: str, last_tokens: Int[Array, "R"], counts: Int[Array, "R V"], prompt_mask: Bool[Array, "R V"],
            logits: Float[Array, "S V"], sampling: SamplingInputs, row_slots: Int[Array, "S"],
            sample_rows: Bool[Array, "S"], grammar_mask: Int[Array, "S W"]) -> tuple[Int[Array, "R"], SamplerOutput]:
    """Samples every row and records the sampled tokens per slot (read by the next forward)."""
    out = sample(logits, sampling, counts, prompt_mask, row_slots, variant, grammar_mask)
    dummy = last_tokens.shape[0] - 1
    return last_tokens.at[jnp.where(sample_rows, row_slots, dummy)].set(out.tokens), out


def verify_step(branch: bool, last_tokens: Int[Array, "R"], counts: Int[Array, "R V"], prompt_mask: Bool[Array, "R V"],
            logits: Float[Array, "SP V"], sampling: SamplingInputs, row_slots: Int[Array, "S"],
            sample_rows: Bool[Array, "S"], drafts: DraftInputs,
            grammar_mask: Int[Array, "S W"]) -> tuple[Int[Array, "R"], Int[Array, "R V"], VerifyOutput]:
    """The sampler of a verifying step: accepts proposals, samples the token after them, and
    records the accepted proposals in the slots' histories. The grammar mask has a row per position."""
    out = verify(logits, sampling, counts, prompt_mask, row_slots, drafts.tokens, drafts.num, None, branch,
                 grammar_mask)
    dummy = last_tokens.shape[0] - 1
    last = jnp.take_along_axis(out.tokens, (out.num_tokens - 1)[:, None], axis=1)[:, 0]
    last_tokens = last_tokens.at[jnp.where(sample_rows, row_slots, dummy)].set(last)
    return last_tokens, count_accepted(counts, jnp.where(sample_rows, row_slots, dummy), drafts.tokens, out), out


def read_pages(k_pages: Array, v_pages: Array, pages: Int[Array, "P"]) -> tuple[Array, Array]:
    return from_storage(k_pages[:, pages]), from_storage(v_pages[:, pages])


def write_pages(cache: DeviceCache, pages: Int[Array, "P"], k: Array, v: Array) -> DeviceCache:
    return cache._replace(k_pages=cache.k_pages.at[:, pages].set(to_storage(k, cache.k_pages.dtype)),
                          v_pages=cache.v_pages.at[:, pages].set(to_storage(v, cache.v_pages.dtype)))


def load_history(cache: DeviceCache, slot: Int[Array, ""], prompt_ids: Int[Array, "M"],
                  output_ids: Int[Array, "M"]) -> DeviceCache:
    """Rebuilds one slot's token history (ids >= vocab are padding and dropped)."""
    counts = cache.counts.at[slot].set(0).at[slot, output_ids].add(1, mode="drop")
    prompt_mask = cache.prompt_mask.at[slot].set(False).at[slot, prompt_ids].set(True, mode="drop")
    return cache._replace(counts=counts, prompt_mask=prompt_mask)
