"""Incremental detokenization with stop strings, and single tokens' text (logprobs).

`tokenizers.decoders.DecodeStream` turns one token at a time into text and holds back bytes of a
UTF-8 character split across tokens. On top of it, text that could be the start of a stop string
is held back until it is known not to be one, so a stream never shows text a stop string cuts.
"""

from __future__ import annotations

import functools

from tokenizers.decoders import DecodeStream

from infire_jax.sample.sampling_params import SamplingParams
from infire_jax.loaders.tokenizer import Tokenizer

# Prompt tokens given to the decoder as context (some decoders strip a leading space without it).
_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self._tk = tokenizer.tk
        self._stream = DecodeStream(ids=list(prompt_token_ids[-_CONTEXT_TOKENS:]),
                                    skip_special_tokens=params.skip_special_tokens)
        self._stop = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""  # all output text so far (after stop-string truncation)
        self._emitted = 0

    def add(self, token_id: int, *, check_stop: bool = True) -> tuple[str, str | None]:
        """Feeds one token; returns (text now safe to show, the stop string it completed or None)."""
        chunk = self._stream.step(self._tk, token_id) or ""
        if not chunk:
            return "", None
        start = max(0, len(self.text) - self._hold)
        self.text += chunk
        if check_stop and self._stop:
            hit = min(((i, s) for s in self._stop if (i := self.text.find(s, start)) >= 0), default=None)
            if hit is not None:
                i, s = hit
                self.text = self.text[:i + len(s) if self._include_stop else i]
                return self.flush(), s
        safe = len(self.text) - self._hold if self._stop else len(self.text)
        if safe <= self._emitted:
            return "", None
        out = self.text[self._emitted:safe]
        self._emitted = safe
        return out, None

    def flush(self) -> str:
        """The held-back rest, once the request is finished."""
        out = self.text[self._emitted:]
        self._emitted = len(self.text)
        return out


class TokenText:
    """The text of single tokens, for logprobs (special tokens included); cached, since the same
    tokens recur."""

    def __init__(self, tokenizer: Tokenizer):
        self._text = functools.lru_cache(maxsize=1 << 16)(
            lambda t: tokenizer.decode([t], skip_special_tokens=False))

    def __call__(self, token_id: int) -> str:
        return self._text(token_id)
