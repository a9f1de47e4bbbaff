"""Fixed step shapes. Every step is padded to one of a few token counts, so nothing recompiles."""

from __future__ import annotations

import bisect
import dataclasses


def default_token_buckets(max_num_batched_tokens: int, smallest: int = 1) -> tuple[int, ...]:
    """Powers of two from `smallest`, capped by (and ending at) the token budget."""
    out, b = [], smallest
    while b < max_num_batched_tokens:
        out.append(b)
        b *= 2
    out.append(max_num_batched_tokens)
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class StepShape:
    num_tokens: int  # T: flat tokens of the step
    num_rows: int  # S: sequences of the step (rows of logits and sampling)


@dataclasses.dataclass(frozen=True)
class Buckets:
    token_buckets: tuple[int, ...]
    max_num_seqs: int

    def __post_init__(self):
        if list(self.token_buckets) != sorted(set(self.token_buckets)) or self.token_buckets[0] < 1:
            raise ValueError(f"token buckets must be distinct, increasing and positive: {self.token_buckets}")

    @property
    def shapes(self) -> list[StepShape]:
        return [self.shape_for(t, 1) for t in self.token_buckets]

    @property
    def decode_shapes(self) -> list[StepShape]:
        """The shapes a step of decodes alone (a token per row) takes: those a decode burst runs in."""
        return sorted({self.shape_for(n, n) for n in range(1, self.max_num_seqs + 1)}, key=lambda s: s.num_tokens)

    def shape_for(self, num_tokens: int, num_seqs: int) -> StepShape:
        """Smallest bucket holding the step. Rows follow tokens: a step never has more rows than tokens."""
        i = bisect.bisect_left(self.token_buckets, num_tokens)
        if i == len(self.token_buckets) or num_seqs > self.max_num_seqs:
            raise ValueError(f"step of {num_tokens} tokens / {num_seqs} seqs exceeds the largest bucket")
        t = self.token_buckets[i]
        return StepShape(t, min(t, self.max_num_seqs))
