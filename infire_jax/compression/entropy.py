"""The entropy-coded format for disk and transfer: rANS over the exponents, in independent blocks.

Where the best ratio matters and decoding happens once (at load), the exponent stream is coded to
its entropy with the `constriction` library's rANS coder and a per-tensor categorical model (the
exponent counts, stored exactly, so the decoder rebuilds the same quantized model). It was chosen
over zstd on the exponent bytes: on SmolLM2's gate/up weights (entropy 2.587 bits) rANS takes
2.587 bits per exponent and encodes 53M in 0.28 s, zstd level 3 takes 3.26 bits, level 19 2.65
bits in 31 s. Sign+mantissa bytes are stored raw (zstd gains nothing on them: 8.0002 bits).

Blocks of BLOCK exponents (C order) are coded separately, so a reader decodes any block, or
all of them in parallel, without the others.
"""

from __future__ import annotations

import dataclasses
import math

import constriction
import numpy as np
from jaxtyping import Int64, Shaped, UInt8, UInt32

from infire_jax.compression.bf16 import merge_bf16, split_bf16

BLOCK = 1 << 20  # exponents per independently decodable block


@dataclasses.dataclass(frozen=True)
class EntropyTensor:
    """One entropy-coded bfloat16 tensor."""

    symbols: UInt8[np.ndarray, "S"]  # exponent values that occur, ascending
    counts: Int64[np.ndarray, "S"]  # how often each occurs: the coding model
    stream: UInt32[np.ndarray, "W"]  # every block's rANS words, one block after another
    block_words: Int64[np.ndarray, "B"]  # words per block
    sign_mantissa: UInt8[np.ndarray, "..."]  # the weight's shape

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.sign_mantissa.shape)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays().values())

    def arrays(self) -> dict[str, np.ndarray]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def _model(counts: np.ndarray):
    return constriction.stream.model.Categorical(counts / counts.sum(), perfect=False)


def encode_entropy(x: Shaped[np.ndarray, "..."]) -> EntropyTensor:
    """rANS-codes the exponents of a bfloat16 array. Deterministic."""
    exponent, sign_mantissa = split_bf16(x)
    flat = exponent.ravel()
    hist = np.bincount(flat, minlength=256)
    symbols = np.flatnonzero(hist).astype(np.uint8)
    counts = hist[symbols].astype(np.int64)
    stream, words = [], []
    if len(symbols) > 1:  # a single symbol costs nothing: no stream at all
        model = _model(counts)
        lut = np.zeros(256, np.int32)
        lut[symbols] = np.arange(len(symbols), dtype=np.int32)
        index = lut[flat]
        for start in range(0, flat.size, BLOCK):
            coder = constriction.stream.stack.AnsCoder()
            coder.encode_reverse(index[start:start + BLOCK], model)
            stream.append(coder.get_compressed())
            words.append(stream[-1].size)
    return EntropyTensor(symbols=symbols, counts=counts,
                         stream=np.concatenate(stream).astype(np.uint32) if stream else np.zeros(0, np.uint32),
                         block_words=np.asarray(words, np.int64), sign_mantissa=sign_mantissa)


def decode_entropy(t: EntropyTensor) -> np.ndarray:
    """The bfloat16 array `t` encodes, bit for bit; ValueError if its parts do not fit together."""
    n = math.prod(t.shape)
    symbols, counts = t.symbols, t.counts
    if symbols.shape != counts.shape or not symbols.size or (counts <= 0).any() or counts.sum() != n:
        raise ValueError(f"exponent counts {counts.tolist()[:8]} do not describe {n} weights")
    if (np.diff(symbols.astype(np.int64)) <= 0).any():
        raise ValueError("exponent symbols are not strictly ascending")
    if len(symbols) == 1:
        exponent = np.full(n, symbols[0], np.uint8)
    else:
        blocks = -(-n // BLOCK)
        if t.block_words.shape != (blocks,) or (t.block_words < 0).any() or t.block_words.sum() != t.stream.size:
            raise ValueError(f"{t.block_words.size} blocks of {t.block_words.sum()} words do not fit "
                             f"{blocks} blocks in {t.stream.size} words")
        model = _model(counts)
        offsets = np.concatenate([[0], np.cumsum(t.block_words)])
        parts = []
        for b in range(blocks):
            coder = constriction.stream.stack.AnsCoder(t.stream[offsets[b]:offsets[b + 1]].copy())
            parts.append(coder.decode(model, min(BLOCK, n - b * BLOCK)))
            if not coder.is_empty():
                raise ValueError(f"block {b} of the exponent stream has data left over")
        exponent = symbols[np.concatenate(parts)]
    return merge_bf16(exponent.reshape(t.shape), t.sign_mantissa)
