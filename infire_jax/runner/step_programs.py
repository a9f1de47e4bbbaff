"""The device programs of a step, as pure functions of the weights, the pool and the step's
batch; compiled_steps.py jits and compiles them, the runner (model_runner.py) launches them.

- `forward`: the model over the step's tokens (embed, the decoder layers over the paged pool,
  the LM head at each row's last token), and each slot's token history for the penalties;
- `sample_step` / `verify_step`: the sampler, or the verifier of a step carrying proposals;
- `commit_linear_state`: after the verifier, a linear-attention model's state advanced over the kept tokens;
- `decode_burst`: several decode steps of the same rows in one launch (forward and sampler in a
  loop on the device, each step feeding its samples to the next), stopping rows on their stop ids;
- `read_pages` / `write_pages`: a prompt's KV pages out of and into the pool (KV transfer);
- `load_history`: one slot's token history rebuilt (a preempted request coming back);
- `gather_rows` / `prompt_logprobs_block`: prompt logprobs, a block of positions at a time from the
  forward's hidden states (prompt_logprobs.py);
- `pool_rows`: embeddings, the forward's hidden states normed and summed per row by the host's
  weights (infire_jax/pooling/plan.py).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from infire_jax.runner.batch import (TOKEN_DRAFT, TOKEN_OUTPUT, TOKEN_PAD, TOKEN_PROMPT, BurstInputs, DraftInputs,
                                    StepBatch)
from infire_jax.lora.batched import LoRAStep
from infire_jax.models.gated_delta import LinearInputs, LinearState, LinearStep
from infire_jax.models.layers import rms_norm
from infire_jax.sample.sampler import SamplerOutput, SamplingInputs, no_logprobs, sample
from infire_jax.speculative.verify import VerifyOutput, count_accepted, verify
from pallas_kernels.attention import decode_only_steps
from pallas_kernels.reference import from_storage, to_storage
from sharding.plan import ShardPlan


class DeviceCache(NamedTuple):
    """State that lives on the device across steps; donated to every step."""

    k_pages: Float[Array, "L N ps Hkv Dk"]  # shapes: models/kv_entry.py (MLA: the latent); a hybrid cache's [s, ...]
    v_pages: Float[Array, "L N ps Hkv Dv"]  # (MLA: the rotary key)
    counts: Int[Array, "R V"]  # output-token counts per request slot (penalties)
    prompt_mask: Bool[Array, "R V"]  # prompt tokens per request slot (repetition penalty)
    last_tokens: Int[Array, "R"]  # last sampled token per slot (asynchronous scheduling)
    kv_scales: Float[Array, "L 2 Hkv"] | None = None  # an fp8 pool's scales (pallas_kernels/kv_quant.py)
    lora: dict[str, Array] | None = None  # LoRA adapters' device slots (lora/layout.py), written between steps
    images: Float[Array, "P E"] | None = None  # images' encoder outputs awaiting prefill (runner/image_pool.py)
    linear: LinearState | None = None  # linear-attention layers' state per request slot (models/gated_delta.py)
    linear_snapshots: LinearState | None = None  # kept copies of a slot's, for the prefix cache (core/state_cache.py)


def matmul_precision(dtype) -> str:
    """float32 means float32: full-precision dots, where XLA on a GPU would otherwise use TF32."""
    return "highest" if jnp.dtype(dtype) == jnp.float32 else "default"


class StepForward(NamedTuple):
    """What the forward of a step leaves on the device for the sampler and the step's observer."""

    cache: DeviceCache
    logits: Float[Array, "S V"]  # float32, at each row's logits_indices
    tokens: Int[Array, "T"]  # the step's token ids, the device's last samples filled in
    aux: Float[Array, "T N"] | None  # residual-stream states at RunnerConfig.aux_layers (EAGLE-3), else None
    hidden: Float[Array, "T E"]  # every token's last hidden state, before the final norm (prompt logprobs)
    # A verifying step's inputs to the linear layers' states (Qwen3.5), for `commit_linear_state`; else None
    linear_inputs: LinearInputs | None = None


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
    meta = b.meta._replace(kv_scales=cache.kv_scales)
    # Each token's LoRA adapter slot (lora/batched.py); without LoRA the program is the plain one.
    lora = {} if cache.lora is None else {"lora": LoRAStep(cache.lora, b.lora_slots)}
    h, kv = model.embed_tokens(tokens), (cache.k_pages, cache.v_pages)
    if b.image_rows is not None:  # an image's patch tokens take its encoder's outputs (runner/image_pool.py)
        h = jnp.where((b.image_rows >= 0)[:, None], cache.images[jnp.maximum(b.image_rows, 0)].astype(h.dtype), h)
    linear, inputs = cache.linear, None
    if linear is not None:  # zeroed for admitted rows (and the dummy slot); a token updates its slot's, if live
        linear = LinearState(*(a.at[:, reset].set(0) for a in linear))
        live_slots = jnp.where(b.token_kind != TOKEN_PAD, tok_slot, dummy)
        # A verifying step leaves the state as found; `commit_linear_state` advances it over the kept tokens.
        verifying = b.logits_indices.shape[0] > b.row_slots.shape[0]
        h, (k_pages, v_pages), updated = model.run_layers(h, kv, meta, attn_impl=attn_impl, plan=plan,
                                                          linear=LinearStep(linear, live_slots), record=verifying)
        linear, inputs = (linear, updated) if verifying else (updated, None)
    elif aux_layers is None:
        h, (k_pages, v_pages) = model.run_layers(h, kv, meta, attn_impl=attn_impl, plan=plan, **lora)
    else:
        h, (k_pages, v_pages), aux = model.run_layers(h, kv, meta, attn_impl=attn_impl, plan=plan,
                                                      aux_layers=aux_layers, **lora)
    logits = model.logits(h[b.logits_indices], plan)
    if plan is not None:  # gather the vocab-split logits once, so the sampler holds no collectives
        logits = jax.lax.with_sharding_constraint(logits, plan.replicated)
    return StepForward(cache._replace(k_pages=k_pages, v_pages=v_pages, counts=counts, prompt_mask=prompt_mask,
                                      linear=linear), logits, tokens, aux, h, inputs)


def commit_linear_state(graphdef: nnx.GraphDef, plan: ShardPlan | None, state: nnx.State, cache: DeviceCache,
                        b: StepBatch, inputs: LinearInputs, num_drafts: Int[Array, "S"],
                        num_tokens: Int[Array, "S"]) -> DeviceCache:
    """After a verifying step's verifier (`num_tokens`: each row's accepted proposals + 1): the linear layers'
    states advanced over the tokens kept, each row's own and the proposals it accepted (models/gated_delta.py
    `replay_kept`)."""
    model = nnx.merge(graphdef, state)
    dummy = cache.last_tokens.shape[0] - 1
    rows = b.row_slots.shape[0]
    row = jnp.clip(b.meta.seq_ids, 0, rows - 1)
    live_slots = jnp.where(b.token_kind != TOKEN_PAD, token_slots(b, dummy + 1), dummy)
    first_draft = b.meta.cu_q_lens[row + 1] - num_drafts[row]  # a row's proposals end it
    t = jnp.arange(b.token_kind.shape[0], dtype=jnp.int32)
    kept = (b.token_kind != TOKEN_PAD) & ((b.token_kind != TOKEN_DRAFT) | (t - first_draft < num_tokens[row] - 1))
    return cache._replace(linear=model.commit_kept(cache.linear, inputs, b.meta, live_slots, kept, plan))


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


class BurstOutput(NamedTuple):
    """Each row's samples of a decode burst, [S, K]: the first num_tokens of a row are valid."""

    tokens: Int[Array, "S K"]
    num_tokens: Int[Array, "S"]
    logprob: Float[Array, "S K"]
    top_ids: Int[Array, "S K L"]
    top_logprobs: Float[Array, "S K L"]


def burst_step_batch(b: StepBatch, k: Int[Array, ""], active: Bool[Array, "S"], limit: Int[Array, "S"],
                     page_size: int) -> StepBatch:
    """Step k of a burst over the decode batch `b` (step 0 is `b`): each row's token is the one the
    device sampled last, one position further on. A row no longer active (stopped, or at its
    `limit` of steps) writes to the null page and its samples are dropped; its position stops at
    its last allowed one, so it never reads past the pages the scheduler gave it."""
    rows, pages_per_seq = b.meta.page_table.shape
    real = b.meta.seq_ids < rows
    row = jnp.clip(b.meta.seq_ids, 0, rows - 1)
    advance = jnp.clip(jnp.minimum(k, limit - 1), 0)  # per row
    live = real & active[row]
    pos = b.meta.positions + advance[row]
    null_slot = jnp.arange(pos.shape[0], dtype=pos.dtype) % page_size  # in page 0, like padding tokens

    def slots(page_table):  # each token's slot in the pool through `page_table` [S, P]
        page = page_table[row, jnp.minimum(pos // page_size, pages_per_seq - 1)]
        return jnp.where(live, page * page_size + pos % page_size, null_slot)

    first = k == 0
    groups = b.meta.group_page_tables  # a hybrid KV cache's: every group's pages were given for the burst
    meta = b.meta._replace(positions=jnp.where(real, pos, b.meta.positions), slot_mapping=slots(b.meta.page_table),
                           kv_lens=jnp.where(b.meta.kv_lens > 0, b.meta.kv_lens + advance, 0),
                           group_slot_mappings=None if groups is None else jax.vmap(slots)(groups))
    return b._replace(
        from_device=jnp.where(first, b.from_device, real),
        token_kind=jnp.where(first, b.token_kind, jnp.where(live, TOKEN_OUTPUT, TOKEN_PAD)),
        meta=meta, reset_rows=b.reset_rows & first, sample_rows=b.sample_rows & active,
        sampling=b.sampling._replace(step=b.sampling.step + k))


def decode_burst(graphdef: nnx.GraphDef, attn_impl: str, plan: ShardPlan | None, precision: str, variant: str,
                 num_steps: int, early_exit: bool, state: nnx.State, cache: DeviceCache, b: StepBatch,
                 burst: BurstInputs) -> tuple[DeviceCache, BurstOutput]:
    """Up to `num_steps` decode steps of the rows of `b` (one token each, so attention runs its
    decode kernel alone: `decode_only_steps`) in one program: row i
    takes at most burst.num_steps[i] and stops after sampling one of its stop ids. With
    `early_exit` (CPU) the loop ends once no row is active; without it (GPU) the loop has a known
    trip count, which XLA GPU runs without copying a predicate to the host every trip."""
    rows = b.row_slots.shape[0]
    page_size = cache.k_pages.shape[2]

    def body(k, carry):
        cache, active, num, out = carry
        bk = burst_step_batch(b, k, active, burst.num_steps, page_size)
        # The weights tied to the step index: otherwise XLA hoists work on them out of the loop,
        # whole (on CPU it converted the bfloat16 embedding table to float32 once a burst, 113 MB,
        # where one step converts the rows it gathers), and the loop would stop being the step.
        weights, _ = jax.lax.optimization_barrier((state, k))
        fwd = forward_body(graphdef, attn_impl, plan, None, weights, cache, bk)
        c = fwd.cache
        last, got = sample_step(variant, c.last_tokens, c.counts, c.prompt_mask, fwd.logits, bk.sampling,
                                bk.row_slots, bk.sample_rows, None)

        def put(acc, x):  # column k of a row's outputs, while the row is active
            keep = active.reshape(rows, *[1] * (x.ndim - 1))
            return acc.at[:, k].set(jnp.where(keep, x, acc[:, k]))

        out = BurstOutput(put(out.tokens, got.tokens), None, put(out.logprob, got.logprob),
                          put(out.top_ids, got.top_ids), put(out.top_logprobs, got.top_logprobs))
        stopped = jnp.any(got.tokens[:, None] == burst.stop_ids, axis=1)
        return c._replace(last_tokens=last), active & ~stopped & (k + 1 < burst.num_steps), num + active, out

    lp, top_ids, top_lp = no_logprobs(rows)

    def columns(x):
        return jnp.zeros((rows, num_steps, *x.shape[1:]), x.dtype)

    out = BurstOutput(columns(jnp.zeros(rows, jnp.int32)), None, columns(lp), columns(top_ids), columns(top_lp))
    carry = (cache, burst.num_steps > 0, jnp.zeros(rows, jnp.int32), out)
    with jax.default_matmul_precision(precision), decode_only_steps():
        if early_exit:
            def going(c):
                return (c[0] < num_steps) & jnp.any(c[1][1])

            _, carry = jax.lax.while_loop(going, lambda c: (c[0] + 1, body(c[0], c[1])), (0, carry))
        else:
            carry = jax.lax.fori_loop(0, num_steps, body, carry)
    cache, _, num, out = carry
    return cache, out._replace(num_tokens=num)


class PromptLogprobs(NamedTuple):
    """A block of prompt positions (prompt_logprobs.py): each one's prompt token and top k."""

    logprob: Float[Array, "B"]  # of the prompt token the position predicts
    rank: Int[Array, "B"]  # tokens at least as likely as it (itself included: 1 = the most likely)
    top_ids: Int[Array, "B K"]
    top_logprobs: Float[Array, "B K"]


def gather_rows(hidden: Float[Array, "T E"], index: Int[Array, "B"]) -> Float[Array, "B E"]:
    """A block's hidden states out of the step's (one program per token bucket; the block's own is one)."""
    return hidden[index]


def prompt_logprobs_block(graphdef: nnx.GraphDef, plan: ShardPlan | None, precision: str, k: int, state: nnx.State,
                          rows: Float[Array, "B E"], targets: Int[Array, "B"]) -> PromptLogprobs:
    """The final norm and LM head over a block of hidden states, then each position's log-softmax
    reduced to its target's logprob and rank and the top k: only [B, k + 2] values leave."""
    model = nnx.merge(graphdef, state)
    with jax.default_matmul_precision(precision):
        logits = model.logits(rows, plan)
    if plan is not None:
        logits = jax.lax.with_sharding_constraint(logits, plan.replicated)
    lp = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(lp, targets[:, None], axis=-1)[:, 0]
    rank = jnp.sum(lp >= chosen[:, None], axis=-1, dtype=jnp.int32)
    if k:
        top_lp, top_ids = jax.lax.top_k(lp, k)
    else:
        top_lp, top_ids = jnp.zeros((rows.shape[0], 0), jnp.float32), jnp.zeros((rows.shape[0], 0), jnp.int32)
    return PromptLogprobs(chosen, rank, top_ids.astype(jnp.int32), top_lp)


def pool_rows(graphdef: nnx.GraphDef, num_rows: int, state: nnx.State, hidden: Float[Array, "T E"],
              weights: Float[Array, "T"], token_rows: Int[Array, "T"]) -> Float[Array, "S E"]:
    """Each row's weighted sum of its tokens' final hidden states (after the final norm, in the
    model's dtype, as HF's `last_hidden_state`), in float32: only [S, E] leaves the device."""
    model = nnx.merge(graphdef, state)
    states = rms_norm(hidden, model.final_norm[...], model.cfg.rms_norm_eps).astype(jnp.float32)
    return jax.ops.segment_sum(states * weights[:, None], token_rows, num_segments=num_rows)


def read_pages(k_pages: Array, v_pages: Array, pages: Int[Array, "P"]) -> tuple[Array, Array]:
    return from_storage(k_pages[:, pages]), from_storage(v_pages[:, pages])


def write_pages(cache: DeviceCache, pages: Int[Array, "P"], k: Array, v: Array) -> DeviceCache:
    return cache._replace(k_pages=cache.k_pages.at[:, pages].set(to_storage(k, cache.k_pages.dtype)),
                          v_pages=cache.v_pages.at[:, pages].set(to_storage(v, cache.v_pages.dtype)))


def save_linear_state(cache: DeviceCache, slot: Int[Array, ""], snapshot: Int[Array, ""]) -> DeviceCache:
    """Keeps a slot's linear-attention state, after a step, as snapshot `snapshot` (core/state_cache.py)."""
    return cache._replace(linear_snapshots=LinearState(*(
        s.at[:, snapshot].set(a[:, slot]) for a, s in zip(cache.linear, cache.linear_snapshots))))


def restore_linear_state(cache: DeviceCache, snapshot: Int[Array, ""], slot: Int[Array, ""]) -> DeviceCache:
    """Starts a slot, before a step, from snapshot `snapshot`: a prefix hit's state."""
    return cache._replace(linear=LinearState(*(
        a.at[:, slot].set(s[:, snapshot]) for a, s in zip(cache.linear, cache.linear_snapshots))))


def load_history(cache: DeviceCache, slot: Int[Array, ""], prompt_ids: Int[Array, "M"],
                  output_ids: Int[Array, "M"]) -> DeviceCache:
    """Rebuilds one slot's token history (ids >= vocab are padding and dropped)."""
    counts = cache.counts.at[slot].set(0).at[slot, output_ids].add(1, mode="drop")
    prompt_mask = cache.prompt_mask.at[slot].set(False).at[slot, prompt_ids].set(True, mode="drop")
    return cache._replace(counts=counts, prompt_mask=prompt_mask)
