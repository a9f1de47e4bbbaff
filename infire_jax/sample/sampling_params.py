"""Per-request sampling parameters, validated when they are made."""

from __future__ import annotations

import dataclasses
import numbers

from infire_jax.errors import InvalidRequestError
from infire_jax.structured.spec import StructuredOutputs

# Logprobs: how many alternatives one token may return (OpenAI allows 20).
MAX_LOGPROBS = 20
# Stop token ids that `min_tokens` can hold back on the device, per request.
MAX_STOP_TOKEN_IDS = 16
# Tokens one request's logit_bias may move: the sampler's inputs hold this many (id, bias) pairs a row.
MAX_LOGIT_BIAS = 300
# Words one request's bad_words may ban (each is checked against the output at every step it samples).
MAX_BAD_WORDS = 256


@dataclasses.dataclass
class SamplingParams:
    """What to generate. Semantics follow vLLM: temperature 0 is greedy; 0/-1 disable top_k."""

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    # vLLM's prompt_logprobs: each prompt token's logprob after the first, with the top k (0: its own
    # alone); at most the engine's max_prompt_logprobs (engine.py checks it).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # vLLM's; no effect here, as none in vLLM v1 with a fast tokenizer: special tokens decode without spaces
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputs | None = None  # the output must match it (infire_jax/structured/)
    # OpenAI's logit_bias: token id -> a bias in [-100, 100] added to its logit before penalties and
    # sampling (vLLM's order); logprobs stay those of the model's own distribution.
    logit_bias: dict[int, float] | None = None
    # vLLM's allowed_token_ids: only these tokens may be sampled (EOS too only if listed)
    allowed_token_ids: list[int] | None = None
    # vLLM's bad_words: the output never spells these words (as the tokenizer writes them, with or
    # without a leading space; sample/bad_words.py)
    bad_words: list[str] | None = None

    def __post_init__(self):
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, list, tuple) if name == "stop" else (list, tuple)):
                raise InvalidRequestError(f"{name} must be {'a string or ' if name == 'stop' else ''}a list, got "
                                          f"{value!r}", param=name)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is None:
            self.logit_bias = {}
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        def bad(msg: str, param: str):
            raise InvalidRequestError(msg, param=param)

        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be an integer >= 1, got {self.n!r}", "n")
        # max_tokens 0: the prompt alone runs (for its prompt logprobs); nothing is generated.
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 0):
            bad(f"max_tokens must be a non-negative integer, got {self.max_tokens!r}", "max_tokens")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}", "min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})", "min_tokens")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                bad(f"{name} must be a number, got {value!r}", name)
        if not self.temperature >= 0:
            bad(f"temperature must be >= 0, got {self.temperature!r}", "temperature")
        if not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not isinstance(self.top_k, int) or not 0 <= self.top_k < 2 ** 31:
            bad(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}", "top_k")
        if not 0 <= self.min_p <= 1:
            bad(f"min_p must be in [0, 1], got {self.min_p!r}", "min_p")
        if not self.repetition_penalty > 0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}", "repetition_penalty")
        if not -2 <= self.presence_penalty <= 2:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}", "presence_penalty")
        if not -2 <= self.frequency_penalty <= 2:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}", "frequency_penalty")
        if self.seed is not None and not isinstance(self.seed, int):
            bad(f"seed must be an integer, got {self.seed!r}", "seed")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS):
            bad(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}", "logprobs")
        if self.prompt_logprobs is not None and not (_is_int(self.prompt_logprobs) and self.prompt_logprobs >= 0):
            bad(f"prompt_logprobs must be an integer >= 0, got {self.prompt_logprobs!r}", "prompt_logprobs")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop must be a non-empty string or a list of non-empty strings", "stop")
        if any(not isinstance(t, int) or not 0 <= t < 2 ** 31 for t in self.stop_token_ids):
            bad("stop_token_ids must be non-negative 32-bit integers", "stop_token_ids")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            bad("structured_outputs must be a StructuredOutputs", "structured_outputs")
        if not isinstance(self.logit_bias, dict):
            bad("logit_bias must map token ids to biases", "logit_bias")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            bad(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}", "logit_bias")
        for token, bias in self.logit_bias.items():
            if not _is_int(token) or not 0 <= token < 2 ** 31:
                bad(f"logit_bias keys must be token ids (integers >= 0), got {token!r}", "logit_bias")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
                bad(f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {token}", "logit_bias")
        if self.allowed_token_ids is not None and not (
                isinstance(self.allowed_token_ids, list) and self.allowed_token_ids
                and all(_is_int(t) and 0 <= t < 2 ** 31 for t in self.allowed_token_ids)):
            bad("allowed_token_ids must be a non-empty list of token ids (integers >= 0)", "allowed_token_ids")
        if self.bad_words is not None and not (
                isinstance(self.bad_words, list) and len(self.bad_words) <= MAX_BAD_WORDS
                and all(isinstance(w, str) and w.strip() for w in self.bad_words)):
            bad(f"bad_words must be a list of at most {MAX_BAD_WORDS} words (non-blank strings)", "bad_words")
        if self.min_tokens and len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS - 2:
            bad(f"with min_tokens, at most {MAX_STOP_TOKEN_IDS - 2} stop_token_ids are supported", "stop_token_ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
