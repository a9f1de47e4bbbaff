"""What the engine reports: per-step deltas, and the finished outputs of the offline API."""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from infire_jax.sample.prompt_logprobs import Logprob, PromptLogprobs


@dataclasses.dataclass
class Delta:
    """New results of one sequence from one step. `index` is its place among the prompt's n samples."""

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None  # "stop", "length" or "abort" once finished
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # whole, with the sequence's first delta (when asked for)
    embedding: np.ndarray | None = None  # an embedding request's (PoolingParams), float32, with its one delta

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class CompletionOutput:
    """One sample's output, as vLLM's: with `logprobs` asked for, each token's entry maps the top
    alternatives (and the token itself) to their `Logprob`, and `cumulative_logprob` sums the tokens'."""

    index: int
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, d: Delta, top: int = 0, token_text: Callable[[int], str] | None = None) -> None:
        """`top`: the alternatives asked for (an entry's first `top` are ranked 1.., the token after them,
        where it is not among them, has no rank known); `token_text`: each entry's decoded_token."""
        self.text += d.text
        self.token_ids.extend(d.token_ids)
        if d.logprobs is not None:
            if self.logprobs is None:
                self.logprobs, self.cumulative_logprob = [], 0.0
            for token, entry in zip(d.token_ids, d.logprobs):
                self.logprobs.append({i: Logprob(lp, k + 1 if k < top else None,
                                                 token_text(i) if token_text is not None else None)
                                      for k, (i, lp) in enumerate(entry.items())})
                self.cumulative_logprob += entry[token]
        if d.finished:
            self.finish_reason, self.stop_reason = d.finish_reason, d.stop_reason


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # with SamplingParams.prompt_logprobs

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)

    # The first sample's fields, for the common n=1 case.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def logprobs(self) -> list[dict[int, Logprob]] | None:
        return self.outputs[0].logprobs


@dataclasses.dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclasses.dataclass
class EmbeddingRequestOutput:
    """One prompt's embedding, as vLLM's `LLM.embed` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclasses.dataclass
class ScoringOutput:
    score: float


@dataclasses.dataclass
class ScoringRequestOutput:
    """One pair's score, as vLLM's `LLM.score` returns it (the pair's prompt token ids, concatenated)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True
