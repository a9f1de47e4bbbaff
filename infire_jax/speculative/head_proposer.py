"""A draft head's proposer in the engine (EAGLE-3's, MTP's): it watches every target step and drafts for
every row.

The head reads a state of the target per token: EAGLE-3 its low, middle and high residual-stream states,
which the target's forward then also returns (`RunnerConfig.aux_layers`); MTP the last layer's output
(`StepForward.hidden`, which mtp.py norms as the target's head does). Once a step is launched, `observe`
(one program per token bucket, for plain and for verifying steps) runs on the device:

* the head's catch-up input for each token of the step is the token after it: the next token of
  its row in the batch; at a sampling row's last accepted position, the token the step sampled
  (the bonus or the correction of a verifying row); at the end of a prompt chunk that does not
  finish the prompt, the next prompt token (from the host);
* the head's `draft` (chain.py's `chain_propose`) writes its KV for every position the target
  computed (rejected ones are scratch that the next catch-up overwrites) and drafts k tokens from
  each sampling row's last accepted position.

The drafts come back with the step's tokens (`PendingStep.drafts`), so a request that speculates
has its proposals without another program or read. Drafts are the head's argmax (one-hot), so
verification stays lossless.

On a target with a hybrid KV cache (chunked or sliding-window layers) the head's one layer is global:
its KV sits on the pages of the target's group 0, a global group that keeps every page (as the draft
model's, draft_model.py; speculative/setup.py refuses a target without one). The step's `page_table`
and `slot_mapping` are that group's, and the other groups' tables are dropped from what the head sees.

Known limits: chained draft positions past a row's pages write to the null page, where rows can
collide (drafts get worse, output stays exact); a prefix-cache hit reuses the head's KV of the
last cached position, computed with the earlier request's next token.
"""

from __future__ import annotations

import functools
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from infire_jax.runner.batch import StepBatch
from infire_jax.models.config import ModelConfig
from infire_jax.models.kv_entry import KVEntry
from infire_jax.core.request import Request
from infire_jax.runner.config import RunnerConfig
from infire_jax.runner.step_programs import StepForward, matmul_precision
from infire_jax.sample.sampler import SamplerOutput
from infire_jax.core.scheduler import SchedulerOutput
from infire_jax.speculative.chain import KVPages, Proposal
from infire_jax.speculative.verify import VerifyOutput
from pallas_kernels.metadata import AttentionMetadata, group0_only
from sharding.plan import ShardPlan


def catch_up_tokens(tokens: Int[Array, "T"], meta: AttentionMetadata, sample_rows: Bool[Array, "S"],
                    next_tokens: Int[Array, "S"], num_drafts: Int[Array, "S"], final: Int[Array, "S"],
                    num_out: Int[Array, "S"]) -> tuple[Int[Array, "T"], Int[Array, "S"]]:
    """(the token after each of the step's tokens, each row's last accepted flat index).

    A row's tokens end with its `num_drafts` proposals; the step accepted `num_out - 1` of them."""
    t, s = tokens.shape[0], sample_rows.shape[0]
    idx = jnp.arange(t)
    row = jnp.clip(meta.seq_ids, 0, s - 1)
    ends = meta.cu_q_lens[1:]
    following = tokens[jnp.minimum(idx + 1, t - 1)]
    row_next = jnp.where(sample_rows, final, next_tokens)
    shifted = jnp.where(idx + 1 == ends[row], row_next[row], following)
    last = jnp.where(sample_rows, ends - 1 - num_drafts + num_out - 1, ends - 1)
    shifted = shifted.at[jnp.where(sample_rows, last, t)].set(final, mode="drop")
    return shifted, jnp.clip(last, 0, t - 1)


class DraftHead(Protocol):
    """What the proposer asks of a head (an nnx module: eagle3.py's `Eagle3Head`, mtp.py's `MTPHead`)."""

    @property
    def kv_entry(self) -> KVEntry:
        """What a token stores in the head's one-layer pool."""

    def pool_sharding(self, plan: ShardPlan) -> jax.sharding.Sharding:
        """Where the one-layer pool lies on the target's mesh."""

    def aux_layers(self, target_num_layers: int) -> tuple[int, ...] | None:
        """The target's states the head reads (`RunnerConfig.aux_layers`); None: the last layer's output."""

    def draft(self, target, kv: KVPages, tokens: Int[Array, "T"], states: Float[Array, "T N"],
              meta: AttentionMetadata, last_index: Int[Array, "S"], *, num_draft: int, attn_impl: str,
              plan: ShardPlan | None = None) -> Proposal:
        """Catch-up and greedy drafts (`chain_propose`); `target` is the target model, merged; `plan` the
        target's mesh (a head split over it runs there: MTP's decoder layer)."""


def _observe(head_graphdef, target_graphdef, attn_impl: str, precision: str, k: int, plan: ShardPlan | None,
             head_state, target_state,
             kv, tokens: Int[Array, "T"], states: Float[Array, "T N"], meta: AttentionMetadata,
             sample_rows: Bool[Array, "S"], next_tokens: Int[Array, "S"], num_drafts: Int[Array, "S"],
             out_tokens: Int[Array, "..."], out_num: Int[Array, "S"]) -> tuple[tuple[Array, Array], Int[Array, "S k"]]:
    """The head's catch-up over one target step and k drafts per row (see the module docstring)."""
    if out_tokens.ndim == 1:  # a plain step: one sampled token per row
        final = out_tokens
    else:
        final = jnp.take_along_axis(out_tokens, (out_num - 1)[:, None], axis=1)[:, 0]
    shifted, last = catch_up_tokens(tokens, meta, sample_rows, next_tokens, num_drafts, final, out_num)
    meta = group0_only(meta)  # the head's KV is on group 0's pages
    with jax.default_matmul_precision(precision):
        head = nnx.merge(head_graphdef, head_state)
        target = nnx.merge(target_graphdef, target_state)
        prop = head.draft(target, kv, shifted, states, meta, last, num_draft=k, attn_impl=attn_impl, plan=plan)
    return prop.kv, prop.token_ids


class HeadProposer:
    """Holds the head and its one-layer pool (on the target's pages), and observes the runner's steps. On a
    mesh the head is whole on every device (placed so by its loader), but for MTP's decoder layer, split as
    the target's layers and run in the mesh's shard_map, its pool split as the target's (`pool_sharding`):
    the head's program reads the target's replicated states and its vocabulary-split embedding and head as
    GSPMD places them, and its drafts stay replicated."""

    def __init__(self, head: DraftHead, target: ModelConfig, runner, rc: RunnerConfig, *, dtype, k: int):
        self.runner, self.k = runner, k
        head_graphdef, self.state = nnx.split(head)
        entry = head.kv_entry
        plan = runner.plan
        self._placed = None if plan is None else plan.replicated
        pool = None if plan is None else head.pool_sharding(plan)
        self.kv = tuple(jnp.zeros((1, rc.num_pages, rc.page_size, entry.heads, dim), dtype, device=pool)
                        for dim in (entry.k_dim, entry.v_dim))
        self._observe = jax.jit(functools.partial(_observe, head_graphdef, runner.graphdef, rc.attn_impl,
                                                  matmul_precision(dtype), k, plan), donate_argnums=(2,),
                                out_shardings=None if plan is None else ((pool, pool), self._placed))
        aux = head.aux_layers(target.num_layers)
        self._reads_aux = aux is not None
        self._state_width = (len(aux) if aux else 1) * target.hidden_size
        self._dtype = dtype
        self._compiled: dict[tuple[int, bool], jax.stages.Compiled] = {}

    def warmup(self, batches: list[StepBatch]) -> None:
        """Compiles `observe` for every token bucket, after plain and after verifying steps."""
        for b in batches:
            t, s = b.token_ids.shape[0], b.row_slots.shape[0]
            for verifying in (False, True):
                out = np.zeros((s, self.k + 1) if verifying else s, np.int32)
                self._compiled[t, verifying] = self._observe.lower(
                    self.state, self.runner.state, self.kv, b.token_ids,
                    jax.ShapeDtypeStruct((t, self._state_width), self._dtype, sharding=self._placed), b.meta,
                    b.sample_rows,
                    np.zeros(s, np.int32), np.zeros(s, np.int32), out, np.ones(s, np.int32)).compile()

    @staticmethod
    def page_bytes(head: DraftHead, page_size: int, dtype, plan: ShardPlan | None = None) -> int:
        """What the head's pool adds to a page of the target's, on each device of `plan`."""
        entry = head.kv_entry
        if plan is None:
            return entry.bytes_per_page(1, page_size, dtype)
        sharding = head.pool_sharding(plan)
        return sum(int(np.prod(sharding.shard_shape((1, 1, page_size, entry.heads, dim)))) * np.dtype(dtype).itemsize
                   for dim in (entry.k_dim, entry.v_dim))

    def observe(self, work: SchedulerOutput, batch: StepBatch, fwd: StepForward,
                out: SamplerOutput | VerifyOutput) -> Int[Array, "S k"]:
        """The runner's observer; returns the step's drafts per row (read back with its tokens)."""
        next_tokens = np.zeros(batch.row_slots.shape[0], np.int32)
        num_drafts = np.zeros(batch.row_slots.shape[0], np.int32)
        for i, sq in enumerate(work.seqs):
            num_drafts[i] = len(sq.drafts)
            if not sq.samples:  # a prompt chunk that does not end the prompt
                next_tokens[i] = sq.req.token_at(sq.start + sq.num_tokens)
        verifying = isinstance(out, VerifyOutput)
        num = out.num_tokens if verifying else np.ones(batch.row_slots.shape[0], np.int32)
        self.kv, drafts = self._compiled[batch.token_ids.shape[0], verifying](
            self.state, self.runner.state, self.kv, fwd.tokens, fwd.aux if self._reads_aux else fwd.hidden,
            batch.meta, batch.sample_rows, next_tokens, num_drafts, out.tokens, num)
        return drafts

    def propose(self, reqs: list[Request], ks: list[int]) -> list[list[int]]:
        """The drafts the head made in each request's last step (`Request.spec_head_drafts`)."""
        return [list(r.spec_head_drafts[:k]) for r, k in zip(reqs, ks)]

    def worth_waiting(self, req: Request, k: int) -> bool:
        return True  # the head always drafts; the back-off judges whether that pays
