"""Which sequences speculate, and with what: the engine's per-request speculation policy (host only).

A speculating request waits for its last token before its next step (`Request.spec_wait`), so
its proposals can continue from it; that costs the overlap of host work with the device step
which plain decoding has. So a request speculates only while it pays:

* it waits only when the proposer has something for it: with its last token still in flight,
  a proposal from the tokens known so far predicts that;
* a step whose proposals were mostly rejected (accepted fraction below the threshold) backs off:
  the request decodes without waiting for the next `backoff` steps, and each failure in a row
  doubles `backoff` (up to MAX_BACKOFF), so proposals that keep failing cost at most one wasted
  step per MAX_BACKOFF;
* nobody speculates while more than `disable_by_batch_size` sequences run: large batches are
  compute-bound, and verifying k extra tokens per row costs more than it saves.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from infire_jax.request import Request
from infire_jax.speculative.config import SpeculativeConfig
from infire_jax.speculative.ngram import propose_ngram

MAX_BACKOFF = 64  # steps


@dataclasses.dataclass
class SpecStats:
    """vLLM's spec-decode counters: steps with proposals, proposed and accepted tokens, accepted by position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = dataclasses.field(default_factory=list)

    def copy(self) -> SpecStats:
        return dataclasses.replace(self, accepted_per_pos=list(self.accepted_per_pos))


@dataclasses.dataclass
class _SeqState:
    backoff_left: int = 0  # steps to decode without speculating
    next_backoff: int = 1  # the length of the next back-off


class SpecController:
    def __init__(self, config: SpeculativeConfig, max_batch: int):
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_batch = max_batch
        self.stats = SpecStats(accepted_per_pos=[0] * self.k)

    def _back_off(self, st: _SeqState) -> None:
        st.backoff_left = st.next_backoff
        st.next_backoff = min(2 * st.next_backoff, MAX_BACKOFF)

    @staticmethod
    def _state(req: Request) -> _SeqState:
        if req.spec_state is None:
            req.spec_state = _SeqState()
        return req.spec_state

    def record(self, req: Request, num_proposed: int, num_accepted: int) -> None:
        """How a step's proposals for `req` fared; mostly rejected ones make it back off."""
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += num_proposed
        s.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            s.accepted_per_pos[i] += 1
        st = self._state(req)
        if num_accepted < self.config.acceptance_threshold * num_proposed:
            self._back_off(st)
        else:
            st.next_backoff = 1

    def plan(self, req: Request, num_running: int) -> None:
        """After a step's tokens for `req` were read back (it still runs): what its next step carries."""
        st = self._state(req)
        if st.backoff_left:
            st.backoff_left -= 1
            req.spec_wait = False
            return
        if num_running > self.max_batch or len(req.output_token_ids) < req.params.min_tokens or req.grammar:
            # min_tokens: stop ids are held back on the device at position 0 only; a grammar's mask
            # is filled for the next token only (its matcher would have to walk the proposals)
            req.spec_wait = False
            return
        k = min(self.k, req.max_tokens - len(req.output_token_ids) - 1)
        drafts = self._propose(req, k) if k > 0 else []
        # With a token still in flight, the proposal from the tokens known so far only predicts
        # whether waiting for it pays: a request with nothing to propose keeps decoding unhindered.
        req.spec_wait = bool(drafts)
        if not req.num_pending_tokens:
            req.spec_drafts = drafts

    def _propose(self, req: Request, k: int) -> list[int]:
        c = self.config
        tokens = np.asarray(req.all_token_ids, np.int32)
        return propose_ngram(tokens, k, c.prompt_lookup_min, c.prompt_lookup_max)
