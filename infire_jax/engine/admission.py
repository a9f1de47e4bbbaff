"""What a request's parameters come to before it is queued, checked against the model: an embedding
request's sampling parameters, its token masks (allowed_token_ids, bad_words) and its stop ids."""

from __future__ import annotations

import functools

import numpy as np

from infire_jax.errors import InvalidRequestError
from infire_jax.loaders.tokenizer import Tokenizer
from infire_jax.pooling.config import PoolerConfig, PoolingParams
from infire_jax.runner import multihost
from infire_jax.sample import bad_words
from infire_jax.sample.sampling_params import MAX_STOP_TOKEN_IDS, SamplingParams
from infire_jax.structured.matcher import token_bitmask


def pooling_run(params: PoolingParams, pooler: PoolerConfig | None, model_name: str,
                hidden_size: int) -> SamplingParams:
    """An embedding request runs its prompt and samples nothing (infire_jax/pooling/)."""
    if pooler is None:
        raise InvalidRequestError(f"{model_name} serves no embeddings: start it with runner='pooling' "
                                  "(--runner pooling)", param="prompt")
    params.check(pooler, hidden_size)
    return SamplingParams(max_tokens=0)


def token_masks(params: SamplingParams, tokenizer: Tokenizer, vocab: int) -> tuple[np.ndarray | None, list]:
    """The sampler's bitmask row of allowed_token_ids and one-token bad_words (None: every token), and
    the longer bad words, banned after their prefix (sample/bad_words.py)."""
    for name, tokens in (("logit_bias", params.logit_bias), ("allowed_token_ids", params.allowed_token_ids or ())):
        if any(t >= vocab for t in tokens):
            raise InvalidRequestError(f"{name} token id {max(tokens)} is out of the vocabulary "
                                      f"(ids 0 to {vocab - 1})", param=name)
    allowed, bad_sequences, words = None, [], -(-vocab // 32)
    for name in ("allowed_token_ids", "bad_words"):
        if getattr(params, name) and multihost.is_multiprocess():  # masks ride with the grammars'
            raise InvalidRequestError(f"{name} is not supported across several processes yet", param=name)
    if params.allowed_token_ids:
        allowed = token_bitmask(params.allowed_token_ids, words)
    if params.bad_words:
        encode = functools.partial(tokenizer.encode, add_special_tokens=False)
        banned, bad_sequences = bad_words.split_bans(bad_words.word_sequences(params.bad_words, encode), words)
        if banned is not None:
            allowed = banned if allowed is None else allowed & banned
    return allowed, bad_sequences


def stop_ids(params: SamplingParams, eos_token_ids: tuple[int, ...]) -> tuple[int, ...]:
    """The ids that end the request (EOS unless ignored, then stop_token_ids), which min_tokens holds back."""
    ids = tuple(dict.fromkeys((*eos_token_ids, *params.stop_token_ids)))
    if params.min_tokens and len(ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError(f"min_tokens supports at most {MAX_STOP_TOKEN_IDS} stop token ids "
                                  f"(eos included), got {len(ids)}", param="stop_token_ids")
    return ids
