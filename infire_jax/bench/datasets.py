"""Benchmark prompts: random token ids of fixed lengths, or a JSONL file read through `grain`.

A JSONL record is `{"prompt": "text" | [token ids], "output_len": N}`; `output_len` is optional
and falls back to `--output-len`. Random prompts are token ids, so they mean the same to every
server and skip tokenization; each run draws fresh ones so the prefix cache never serves them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Sequence

import numpy as np

from infire_jax.bench.common import BenchError


@dataclasses.dataclass(frozen=True)
class BenchPrompt:
    prompt: str | list[int]
    output_len: int


def random_prompts(num: int, input_len: int, output_len: int, vocab_size: int,
                   seed: int | Sequence[int]) -> list[BenchPrompt]:
    """`num` prompts of `input_len` token ids drawn uniformly from [0, vocab_size)."""
    if num < 1 or input_len < 1 or output_len < 1:
        raise BenchError("--num-prompts, --input-len and --output-len must be positive")
    ids = np.random.default_rng(seed).integers(0, vocab_size, size=(num, input_len))
    return [BenchPrompt(row.tolist(), output_len) for row in ids]


class JsonlSource:
    """Random access to the non-blank lines of a JSONL file (grain's data-source protocol).

    Only line offsets are kept in memory; a record is read when it is asked for.
    """

    def __init__(self, path: str):
        self.path = path
        self._lines: list[tuple[int, int]] = []  # (line number, byte offset)
        with open(path, "rb") as f:
            offset = 0
            for number, line in enumerate(f, 1):
                if line.strip():
                    self._lines.append((number, offset))
                offset += len(line)

    def __len__(self) -> int:
        return len(self._lines)

    def __getitem__(self, index: int) -> tuple[int, bytes]:
        number, offset = self._lines[index]
        with open(self.path, "rb") as f:
            f.seek(offset)
            return number, f.readline()


def _parse(record: tuple[int, bytes], *, path: str, default_output_len: int) -> BenchPrompt:
    number, raw = record
    where = f"{path}:{number}"
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        raise BenchError(f"{where}: not valid JSON ({e.msg})") from None
    prompt = obj.get("prompt") if isinstance(obj, dict) else None
    ids_ok = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    if not ((isinstance(prompt, str) or ids_ok) and prompt):
        raise BenchError(f"{where}: \"prompt\" must be a non-empty string or list of token ids")
    output_len = obj.get("output_len", default_output_len)
    if not isinstance(output_len, int) or isinstance(output_len, bool) or output_len < 1:
        raise BenchError(f"{where}: \"output_len\" must be a positive integer, got {output_len!r}")
    return BenchPrompt(prompt, output_len)


def read_jsonl(path: str, num_prompts: int | None, default_output_len: int) -> list[BenchPrompt]:
    """The first `num_prompts` records of `path` (all of them when None), in file order."""
    try:
        import grain
    except ImportError:
        raise BenchError("reading a --dataset needs the `grain` package: pip install grain") from None
    if not os.path.isfile(path):
        raise BenchError(f"dataset {path!r} is not a file")
    ds = grain.MapDataset.source(JsonlSource(path))
    if num_prompts is not None:
        ds = ds[:num_prompts]
    ds = ds.map(lambda r: _parse(r, path=path, default_output_len=default_output_len))
    prompts = list(ds)
    if not prompts:
        raise BenchError(f"dataset {path!r} holds no records")
    return prompts
