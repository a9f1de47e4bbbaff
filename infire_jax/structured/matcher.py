"""One request's grammar state: which tokens may come next (a bitmask row), and the tokens accepted so far.

The engine fills the masks of a step's constrained rows on the host before dispatching it, and
advances each matcher with the token read back. `accept_tokens` and `rollback` are what
speculative decoding needs: check several proposed tokens at once, and undo rejected ones.
"""

from __future__ import annotations

import time

import llguidance
import llguidance.numpy
import numpy as np
from jaxtyping import Int32

_EXECUTOR = llguidance.LLExecutor(2)  # fills several rows' masks at once, outside the GIL


class GrammarClock:
    """Host seconds spent in the grammar engine (masks and accepts) by one engine's requests: the
    grammar's share of the host time, in /metrics. Only the engine thread touches it."""

    def __init__(self):
        self.seconds = 0.0


class GrammarMatcher:
    """Wraps an llguidance matcher; it never raises on a bad token, it enters an error state instead."""

    def __init__(self, matcher: llguidance.LLMatcher, clock: GrammarClock):
        self._m = matcher
        self.clock = clock

    def fill_bitmask(self, mask: Int32[np.ndarray, "S W"], row: int) -> None:
        """Writes the allowed next tokens into `mask[row]` (bit t of word t // 32 set: token t allowed)."""
        llguidance.numpy.fill_next_token_bitmask(self._m, mask, row)

    def accept_token(self, token: int) -> bool:
        """Advances past `token`; False if the grammar does not allow it (the matcher is then stopped)."""
        start = time.perf_counter()
        ok = self._m.consume_token(token)
        self.clock.seconds += time.perf_counter() - start
        return ok

    def accept_tokens(self, tokens: list[int]) -> int:
        """Advances past the longest allowed prefix of `tokens`; returns its length."""
        return self._m.try_consume_tokens(tokens)

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last `num_tokens` accepted tokens."""
        if not self._m.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self._m.get_error()}")

    def is_terminated(self) -> bool:
        """Nothing but the end of the output may follow (the grammar is complete, or it failed)."""
        return self._m.is_stopped()

    @property
    def error(self) -> str:
        return self._m.get_error()


def token_bitmask(token_ids: list[int], words: int) -> np.ndarray:
    """A set of token ids as one bitmask row ([W] int32, bit t % 32 of word t // 32), the layout of
    the grammar masks (allowed_token_ids' mask)."""
    ids = np.asarray(token_ids, np.int64)
    mask = np.zeros(words, np.uint32)
    np.bitwise_or.at(mask, ids // 32, (np.uint32(1) << (ids % 32).astype(np.uint32)))
    return mask.view(np.int32)


def fill_bitmasks(rows: list[tuple[GrammarMatcher, int]], mask: Int32[np.ndarray, "S W"]) -> None:
    """Fills several rows at once, on llguidance's threads (the GIL is released)."""
    start = time.perf_counter()
    if len(rows) == 1:
        rows[0][0].fill_bitmask(mask, rows[0][1])
    else:
        llguidance.numpy.fill_next_token_bitmask_par(_EXECUTOR, [(m._m, row) for m, row in rows], mask)
    rows[0][0].clock.seconds += time.perf_counter() - start
