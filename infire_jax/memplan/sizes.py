"""vLLM's human-readable token counts (`--max-model-len 32k`, `--max-num-batched-tokens 8K`), for every
command that takes one: `infire-jax plan` (cli.py) and `infire-jax serve` (engine/args.py, a layer above)."""

from __future__ import annotations

import argparse
import re
from fractions import Fraction

_SIZE = re.compile(r"(\d+(?:\.\d+)?)([kmgKMG]?)")
_SIZE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def size(text: str) -> int:
    """vLLM's human-readable sizes: `1k` 1000 and `1K` 1024 (lower case decimal, upper case binary; m/M,
    g/G alike), `25.6k` 25600; a positive whole number of tokens."""
    match = _SIZE.fullmatch(text.strip())
    value = Fraction(match[1]) * _SIZE_UNITS[match[2]] if match else Fraction(0)
    if value.denominator != 1 or value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number such as 4096, 1k (1000), 1K (1024) "
                                         f"or 25.6k, got {text!r}")
    return int(value)
