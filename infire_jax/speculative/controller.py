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
from typing import Protocol

import numpy as np

from infire_jax.core.request import Request
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


class Proposer(Protocol):
    def propose(self, reqs: list[Request], ks: list[int]) -> list[list[int]]:
        """Up to ks[i] tokens to follow each request's known tokens (all known: none in flight)."""

    def worth_waiting(self, req: Request, k: int) -> bool:
        """For a request with a token in flight: whether to wait for it and speculate next."""


class NgramProposer:
    """Prompt lookup (ngram.py), on the host."""

    def __init__(self, config: SpeculativeConfig):
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def _one(self, req: Request, k: int) -> list[int]:
        return propose_ngram(np.asarray(req.all_token_ids, np.int32), k, self.min_n, self.max_n)

    def propose(self, reqs: list[Request], ks: list[int]) -> list[list[int]]:
        return [self._one(r, k) for r, k in zip(reqs, ks)]

    def worth_waiting(self, req: Request, k: int) -> bool:
        """A proposal from the tokens known so far predicts one once the last is known too."""
        return bool(self._one(req, k))


class SpecController:
    def __init__(self, config: SpeculativeConfig, max_batch: int, proposer: Proposer):
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_batch = max_batch
        self.proposer = proposer
        self.stats = SpecStats(accepted_per_pos=[0] * self.k)
        self._queued: list[tuple[Request, int]] = []  # requests to propose for, once the step is read

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
        """After a step's tokens for `req` were read back (it still runs): whether it waits for its
        next token to speculate, or (all its tokens known) queue it for proposals (`propose_queued`)."""
        st = self._state(req)
        if st.backoff_left:
            st.backoff_left -= 1
            req.spec_wait = False
            return
        if num_running > self.max_batch or len(req.output_token_ids) < req.params.min_tokens:
            req.spec_wait = False  # min_tokens: stop ids are held back on the device at position 0 only
            return
        k = min(self.k, req.max_tokens - len(req.output_token_ids) - 1)
        if k <= 0:
            req.spec_wait = False
        elif req.num_pending_tokens:
            req.spec_wait = self.proposer.worth_waiting(req, k)
        else:
            req.spec_wait = True
            self._queued.append((req, k))

    def propose_queued(self) -> None:
        """Proposals for the requests `plan` queued; one with nothing proposed decodes without waiting."""
        if not self._queued:
            return
        reqs, ks = zip(*self._queued)
        self._queued = []
        for req, drafts in zip(reqs, self.proposer.propose(list(reqs), list(ks))):
            if req.grammar is not None and drafts:  # keep the prefix its grammar allows
                allowed = req.grammar.accept_tokens(drafts)
                req.grammar.rollback(allowed)
                drafts = drafts[:allowed]
            req.spec_drafts = drafts
            req.spec_wait = bool(drafts)
