"""Prompt lookup: the next tokens are guessed by finding the sequence's latest n-gram earlier in its
own prompt and output, and proposing what followed it there. Host-only numpy, no model."""

from __future__ import annotations

import numpy as np


def propose_ngram(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix of
    `tokens` with min_n <= length <= max_n (vLLM's prompt lookup); [] when no suffix recurs.

    One pass finds where the last token occurred before; only those places are extended
    backwards, so a long context costs about one comparison per token.
    """
    total = len(tokens)
    ends = np.flatnonzero(tokens[:total - 1] == tokens[-1])  # earlier places the suffix could end
    length = np.ones(len(ends), np.int64)
    alive = np.ones(len(ends), bool)
    for j in range(1, min(max_n, total - 1)):
        at = ends - j
        alive &= at >= 0
        alive[alive] = tokens[at[alive]] == tokens[total - 1 - j]
        length += alive
    good = np.flatnonzero(length >= min_n)
    if not good.size:
        return []
    best = good[len(good) - 1 - np.argmax(length[good][::-1])]  # the longest; of those, the latest
    start = int(ends[best]) + 1
    return tokens[start:start + k].tolist()
