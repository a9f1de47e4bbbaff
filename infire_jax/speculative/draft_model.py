"""The draft-model proposer: a smaller model with the target's tokenizer guesses the next k tokens.

The draft keeps a KV pool with the target's page count and page size and writes it through the
target's page tables, so its KV for position p sits in the same page slot as the target's. On a
target with a hybrid KV cache (chunked or sliding-window layers) those are the pages of its group 0,
a global group that keeps every page (speculative/setup.py refuses a target without one): the step's
`page_table` and `slot_mapping` and `Request.pages` are that group's, and the other groups' tables
are dropped from what the draft sees. Two programs keep it in step, with no bookkeeping of its own:

* `observe`: every target step's tokens (as its forward resolved them) also go through the
  draft's layers (no LM head), on the same slots. Its KV therefore covers every position the target computed, prefill chunks and
  shared prefix-cache pages included; KV of rejected proposals is overwritten later, as in the
  target's pool.
* `propose`: for the requests that speculate, k greedy one-token steps from each one's last
  token, in one program (`lax.scan`). It writes positions n-1 .. n+k-2, inside the pages the
  engine reserved for the verifying step, and the verifying step's `observe` rewrites them with
  the same tokens.

Drafts are the draft's argmax, so their distribution is one-hot and the verifier's rejection
sampling against them is lossless (as vLLM does for greedy drafters).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Int

from infire_jax.runner.batch import StepBatch
from infire_jax.runner.device_memory import kv_bytes_per_page
from infire_jax.errors import ConfigError
from infire_jax.loaders.load import load_config, load_placed
from infire_jax.models.config import ModelConfig
from infire_jax.models.kv_entry import kv_entry
from infire_jax.core.request import Request
from infire_jax.runner.config import RunnerConfig
from infire_jax.runner.step_programs import StepForward, matmul_precision
from pallas_kernels.attention import decode_only_steps
from pallas_kernels.metadata import NULL_PAGE, AttentionMetadata, group0_only
from pallas_kernels.reference import pool_storage_dtype


def _observe(graphdef, attn_impl: str, precision: str, state, kv, tokens: Int[Array, "T"],
             meta: AttentionMetadata) -> tuple[Array, Array]:
    """The draft's layers over the target step's tokens: only the KV it writes is kept. Every draft
    layer reads and writes through the step's `page_table` and `slot_mapping` (the target's group 0's)."""
    meta = group0_only(meta)
    with jax.default_matmul_precision(precision):
        model = nnx.merge(graphdef, state)
        _, kv = model.run_layers(model.embed_tokens(tokens), kv, meta, attn_impl=attn_impl)
    return kv


def _propose(graphdef, attn_impl: str, precision: str, k: int, page_size: int, state, kv,
             tokens: Int[Array, "R"], positions: Int[Array, "R"], page_table: Int[Array, "R P"],
             num_rows: Int[Array, ""]) -> tuple[tuple[Array, Array], Int[Array, "R k"]]:
    """k greedy steps of one token per row; rows past `num_rows` are padding (null page)."""
    rows = tokens.shape[0]
    r = jnp.arange(rows)
    valid = r < num_rows

    def one(carry, _):
        kv, tok, pos = carry
        page = page_table[r, jnp.clip(pos // page_size, 0, page_table.shape[1] - 1)]
        meta = AttentionMetadata(
            positions=pos, slot_mapping=jnp.where(valid, page * page_size + pos % page_size,
                                                  NULL_PAGE * page_size + r % page_size),
            seq_ids=jnp.where(valid, r, rows), page_table=page_table, kv_lens=jnp.where(valid, pos + 1, 0),
            cu_q_lens=jnp.minimum(jnp.arange(rows + 1), num_rows).astype(jnp.int32), num_seqs=num_rows)
        h, kv = model.run_layers(model.embed_tokens(tok), kv, meta, attn_impl=attn_impl)
        nxt = jnp.argmax(model.logits(h), axis=-1).astype(jnp.int32)
        return (kv, nxt, pos + 1), nxt

    with jax.default_matmul_precision(precision), decode_only_steps():  # a token a row: no prefill kernel
        model = nnx.merge(graphdef, state)
        (kv, _, _), drafts = jax.lax.scan(one, (kv, tokens, positions), None, length=k)
    return kv, drafts.T


def check_vocabulary(spec: str, target: ModelConfig) -> None:
    """Refuses a draft whose vocabulary is not the target's, from its config alone: at engine setup,
    before the target's weights are loaded or its steps compiled."""
    cfg = load_config(spec)
    if cfg.vocab_size != target.vocab_size:
        raise ConfigError(f"speculative_config.model: the draft's vocabulary ({cfg.vocab_size} tokens) differs "
                          f"from the target's ({target.vocab_size}); a draft needs the target's tokenizer")


class DraftModel:
    """Loads the draft, allocates its pool beside the target's, and compiles its two programs."""

    def __init__(self, spec: str, rc: RunnerConfig, *, dtype, k: int, max_rows: int,
                 reserve: Callable[[Request, int], bool]):
        """`reserve(req, n)` gives the request pages for its next n tokens, or says it cannot."""
        self.reserve = reserve
        cfg = load_config(spec)
        placed = load_placed(spec, dtype, None)
        self.rc, self.max_rows = rc, max_rows
        self.state = placed.state
        entry = kv_entry(cfg)  # the draft model's own pool layout
        pages = (cfg.num_layers, rc.num_pages, rc.page_size, entry.heads)
        stored = pool_storage_dtype(dtype, rc.attn_impl)
        self.kv = (jnp.zeros((*pages, entry.k_dim), stored), jnp.zeros((*pages, entry.v_dim), stored))
        precision = matmul_precision(dtype)
        self._observe = jax.jit(functools.partial(_observe, placed.graphdef, rc.attn_impl, precision),
                                donate_argnums=(1,))
        self._propose = jax.jit(functools.partial(_propose, placed.graphdef, rc.attn_impl, precision, k,
                                                  rc.page_size), donate_argnums=(1,))
        self._compiled_observe: dict[int, jax.stages.Compiled] = {}
        self._compiled_propose = None

    @staticmethod
    def page_bytes(spec: str, page_size: int, dtype) -> int:
        """One page of the draft's pool (for sizing the target's pool around it)."""
        return kv_bytes_per_page(load_config(spec), page_size, dtype)

    def warmup(self, batches: list[StepBatch]) -> None:
        """Compiles `observe` for every token bucket and `propose` once: nothing compiles later."""
        for b in batches:
            self._compiled_observe[b.token_ids.shape[0]] = self._observe.lower(
                self.state, self.kv, b.token_ids, b.meta).compile()
        rows, pages = self.max_rows, self.rc.pages_per_seq
        self._compiled_propose = self._propose.lower(
            self.state, self.kv, np.zeros(rows, np.int32), np.zeros(rows, np.int32),
            np.zeros((rows, pages), np.int32), np.int32(0)).compile()

    def observe(self, work, batch: StepBatch, fwd: StepForward, out) -> None:
        """The runner's observer: called with every target step, once it is launched."""
        self.kv = self._compiled_observe[batch.token_ids.shape[0]](self.state, self.kv, fwd.tokens, batch.meta)

    def propose(self, reqs: list[Request], ks: list[int]) -> list[list[int]]:
        """k greedy tokens after each request's last token, read back at once (the verifying step
        needs them on the host). A request whose verifying step cannot get its pages gets none."""
        wanted = {id(r): k for r, k in zip(reqs, ks) if self.reserve(r, 1 + k)}
        todo = [r for r in reqs if id(r) in wanted]
        drafts: dict[int, list[int]] = {}
        rows, pages = self.max_rows, self.rc.pages_per_seq
        for start in range(0, len(todo), rows):
            chunk = todo[start:start + rows]
            tokens, positions = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
            table = np.full((rows, pages), NULL_PAGE, np.int32)
            for i, req in enumerate(chunk):
                tokens[i] = req.token_at(req.num_tokens - 1)
                positions[i] = req.num_tokens - 1
                table[i, :len(req.pages)] = req.pages
            self.kv, out = self._compiled_propose(self.state, self.kv, tokens, positions, table, np.int32(len(chunk)))
            host = np.asarray(jax.device_get(out))
            for i, req in enumerate(chunk):
                drafts[id(req)] = host[i, :wanted[id(req)]].tolist()
        return [drafts.get(id(r), []) for r in reqs]

    def worth_waiting(self, req: Request, k: int) -> bool:
        return True  # a draft model always has a proposal; the back-off judges whether it pays
