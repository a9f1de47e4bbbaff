"""Scores of text pairs from an embedding model, as vLLM's bi-encoder scoring gives them (`LLM.score`,
`POST /score`, `POST /rerank`): each text embedded once, a pair's score the cosine similarity of its
two embeddings. One first text scores against every second text; otherwise they pair up in order."""

from __future__ import annotations

import numpy as np

from infire_jax.errors import InvalidRequestError

_EPS = 1e-8  # torch's cosine_similarity: each norm at least this


def pairs(num_first: int, num_second: int, names: tuple[str, str] = ("data_1", "data_2")) -> list[tuple[int, int]]:
    """The (first, second) index of each pair: one first text against all, else one to one."""
    if num_first < 1 or num_second < 1:
        raise InvalidRequestError(f"{names[0]} and {names[1]} must each hold at least one text", param=names[0])
    if num_first == 1:
        return [(0, j) for j in range(num_second)]
    if num_first != num_second:
        raise InvalidRequestError(f"{names[0]} has {num_first} texts and {names[1]} {num_second}: give one "
                                  f"{names[0]} text, or as many as {names[1]}", param=names[1])
    return [(i, i) for i in range(num_first)]


def cosine_scores(first: list[np.ndarray], second: list[np.ndarray]) -> list[float]:
    """Each pair's cosine similarity (float64), pairs as `pairs` makes them."""
    out = []
    for i, j in pairs(len(first), len(second)):
        a, b = np.asarray(first[i], np.float64), np.asarray(second[j], np.float64)
        out.append(float(a @ b / (max(np.linalg.norm(a), _EPS) * max(np.linalg.norm(b), _EPS))))
    return out
