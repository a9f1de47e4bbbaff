"""vLLM's `bad_words`: words the output may not contain, as token sequences the sampler bans.

A word becomes the token sequences it is written with: alone and after a space (" word") where the
tokenizer spells that differently. vLLM adds the spaced one only when it has as many tokens, which
leaves " Berlin" (one token) free when "Berlin" is two, as SmolLM2's tokenizer writes them; here both
are banned. A one-token sequence bans its token at every step: a constant bitmask row, ANDed with
allowed_token_ids'. A longer one bans its last token wherever the output so far ends with the rest
(`banned_after`): the scheduler's mask for that step, so such a request decodes a step at a time (no
bursts), and the engine reads each of its tokens back before planning the next step, as for a grammar.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
from jaxtyping import Int32

from infire_jax.structured.matcher import token_bitmask

# A ban that needs context: the output must end with `prefix` for `token` to be banned.
Ban = tuple[tuple[int, ...], int]


def word_sequences(words: Sequence[str], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """Each word's token sequences (`encode`: text to ids without special tokens)."""
    out: list[list[int]] = []
    for word in words:
        plain, spaced = encode(word.lstrip()), encode(" " + word.lstrip())
        out += [plain] if spaced == plain else [plain, spaced]
    return out


def split_bans(sequences: list[list[int]], words: int) -> tuple[Int32[np.ndarray, "W"] | None, list[Ban]]:
    """The one-token bans as a bitmask row of what stays allowed (None: none), and the longer ones."""
    single = sorted({s[0] for s in sequences if len(s) == 1})
    allowed = ~token_bitmask(single, words) if single else None
    longer = sorted({(tuple(s[:-1]), s[-1]) for s in sequences if len(s) > 1})
    return allowed, longer


def banned_after(bans: list[Ban], output: Sequence[int]) -> list[int]:
    """The tokens the next step may not sample after `output` (the tokens generated so far)."""
    return [token for prefix, token in bans
            if len(output) >= len(prefix) and tuple(output[len(output) - len(prefix):]) == prefix]
