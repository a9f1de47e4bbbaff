"""vLLM's scoring endpoints over an embedding model (`--runner pooling`): `POST /score` (and
`/v1/score`) scores text pairs, `POST /rerank` (and `/v1/rerank`, `/v2/rerank`: Jina's and Cohere's
shape) orders documents by their score against a query. Scores are cosine similarities of the
texts' embeddings (infire_jax/pooling/scoring.py), as vLLM gives them for an embedding model; each
text is embedded once, so usage counts every text's tokens once."""

from __future__ import annotations

import time
import uuid

import numpy as np
from aiohttp import web

from infire_jax.errors import InvalidRequestError
from infire_jax.pooling.config import PoolingParams
from infire_jax.pooling.scoring import cosine_scores, pairs
from server.embeddings import checked_priority, checked_prompts, embed
from server.endpoints import STATE, read_json, response_model, served_model
from server.protocol import bad

_COMMON = frozenset({"model", "user", "truncate_prompt_tokens", "priority", "use_activation", "add_special_tokens"})
# vLLM's names for the two sides of /score, any one pair of them
_SIDES = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))
_SIDE_NAMES = frozenset(name for side in _SIDES for name in side)


def _texts(value, param: str) -> list[str]:
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
        raise bad(f"{param} must be a non-empty string or a non-empty array of them", param)
    return texts


def _common(body, allowed: frozenset[str]) -> dict:
    """The fields both endpoints share, checked; unknown fields are 400s naming them."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    unknown = sorted(set(body) - _COMMON - allowed)
    if unknown:
        raise bad(f"unknown field(s) {', '.join(unknown)}", unknown[0])
    truncate = body.get("truncate_prompt_tokens")
    if truncate is not None and (type(truncate) is not int or not (truncate == -1 or truncate >= 1)):
        raise bad(f"truncate_prompt_tokens must be -1 or a positive integer, got {truncate!r}", "truncate_prompt_tokens")
    for name in ("use_activation", "add_special_tokens"):
        if not isinstance(body.get(name, True), bool):
            raise bad(f"{name} must be true or false", name)
    return dict(model=body.get("model"), truncate=truncate, priority=checked_priority(body),
                special=body.get("add_special_tokens", True))


async def _embed_texts(request: web.Request, c: dict, texts: list[str],
                       param: str) -> tuple[list[np.ndarray], int, str]:
    """Every text's embedding, the tokens they took, and the model the response names."""
    m, lora = served_model(request.app[STATE], c["model"])
    prompts = checked_prompts(m, [m.tokenizer.encode(t, add_special_tokens=c["special"]) for t in texts],
                              c["truncate"], param)
    vectors = await embed(request, m, lora, prompts, PoolingParams(), c["priority"], param)
    return vectors, sum(map(len, prompts)), response_model(m, lora)


async def score(request: web.Request) -> web.Response:
    body = await read_json(request)
    c = _common(body, _SIDE_NAMES)
    named = [side for side in _SIDES if side[0] in body and side[1] in body]
    if len(named) != 1 or len(_SIDE_NAMES & set(body)) != 2:
        raise bad("give the two sides as one of " + ", ".join(f"{a}/{b}" for a, b in _SIDES), "text_1")
    (a, b), = named
    first, second = _texts(body[a], a), _texts(body[b], b)
    try:
        pairs(len(first), len(second), (a, b))
    except InvalidRequestError as e:
        raise bad(str(e), e.param) from e
    vectors, tokens, model = await _embed_texts(request, c, first + second, a)
    scores = cosine_scores(vectors[:len(first)], vectors[len(first):])
    return web.json_response({
        "id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def rerank(request: web.Request) -> web.Response:
    body = await read_json(request)
    c = _common(body, frozenset({"query", "documents", "top_n"}))
    if not isinstance(body.get("query"), str) or not body["query"]:
        raise bad("query must be a non-empty string", "query")
    documents = _texts(body.get("documents"), "documents")
    top_n = body.get("top_n", 0)
    if type(top_n) is not int or top_n < 0:
        raise bad(f"top_n must be a non-negative integer (0: every document), got {top_n!r}", "top_n")
    vectors, tokens, model = await _embed_texts(request, c, [body["query"], *documents], "documents")
    scores = cosine_scores(vectors[:1], vectors[1:])
    order = sorted(range(len(documents)), key=lambda i: -scores[i])[:top_n or None]
    return web.json_response({
        "id": f"rerank-{uuid.uuid4().hex}", "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "results": [{"index": i, "document": {"text": documents[i]}, "relevance_score": scores[i]} for i in order]})
