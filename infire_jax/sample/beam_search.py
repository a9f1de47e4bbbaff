"""Beam search as vLLM runs it (`LLM.beam_search`, the OpenAI server's `use_beam_search`): on top of the
engine, one token at a time.

Each step runs every live beam of every prompt as a prompt of its own, generating one token with the
top 2 x beam_width log-probabilities (the prefix cache holds the beams' shared pages, so a step
computes about a page a beam). Each beam is extended by each of those tokens; a candidate ending in
the tokenizer's end-of-sequence token (unless `ignore_eos`) is set aside as completed, the others are
ranked and the best `beam_width` go on. After `max_tokens` steps the completed and live beams are
ranked together and the best `beam_width` are the result. A beam's score is its cumulative
log-probability over its length ** length_penalty, the length counting the prompt and not a final
end-of-sequence token, as vLLM's `get_beam_search_score`.

`BeamSearch` is the algorithm without the engine: the caller runs `step_prompts()` (one token each,
with `step_params()`), hands each one's top log-probabilities to `advance`, and repeats until `done`.
"""

from __future__ import annotations

import dataclasses

from infire_jax.errors import InvalidRequestError
from infire_jax.sample.prompt_logprobs import Logprob
from infire_jax.sample.sampling_params import MAX_LOGPROBS, SamplingParams

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # a step asks for 2 x beam_width log-probabilities


@dataclasses.dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        if not (isinstance(self.beam_width, int) and 1 <= self.beam_width <= MAX_BEAM_WIDTH):
            raise InvalidRequestError(f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}], got "
                                      f"{self.beam_width!r}", param="n")
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}",
                                      param="max_tokens")
        if not 0 <= self.temperature <= 2:
            raise InvalidRequestError(f"temperature must be in [0, 2], got {self.temperature}", param="temperature")


@dataclasses.dataclass
class BeamSearchSequence:
    """One beam (vLLM's): `tokens` hold the prompt's and the generated ones; `logprobs` each step's top
    log-probabilities (floats while searching; `LLM.beam_search` hands them out as vLLM's `Logprob`s);
    `text` is set on the results (the whole sequence decoded)."""

    tokens: list[int]
    logprobs: list[dict[int, float]] | list[dict[int, Logprob]] = dataclasses.field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclasses.dataclass
class BeamSearchOutput:
    """The best beams of one prompt, best first (vLLM's)."""

    sequences: list[BeamSearchSequence]


def beam_score(seq: BeamSearchSequence, eos_token_id: int | None, length_penalty: float) -> float:
    """vLLM's `get_beam_search_score`: the cumulative log-probability over length ** length_penalty, the
    length counting the prompt and not a final end-of-sequence token."""
    length = len(seq.tokens) - (bool(seq.tokens) and seq.tokens[-1] == eos_token_id)
    return seq.cum_logprob / (length ** length_penalty)


class BeamSearch:
    """The beams of several prompts, advanced one token a step."""

    def __init__(self, prompts: list[list[int]], params: BeamSearchParams, eos_token_id: int | None):
        self.params = params
        self.eos_token_id = eos_token_id
        self.beams = [[BeamSearchSequence(list(p))] for p in prompts]
        self.completed: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self.steps = 0

    @property
    def done(self) -> bool:
        return self.steps >= self.params.max_tokens or not any(self.beams)

    def step_params(self) -> SamplingParams:
        return SamplingParams(max_tokens=1, logprobs=2 * self.params.beam_width, temperature=self.params.temperature,
                              ignore_eos=True)

    def step_prompts(self) -> list[list[int]]:
        """Every live beam's tokens, prompt by prompt."""
        return [b.tokens for beams in self.beams for b in beams]

    def advance(self, tops: list[dict[int, float]]) -> None:
        """`tops`: each of `step_prompts()`' next-token log-probabilities (its top 2 x beam_width)."""
        p, rank = self.params, self._rank
        it = iter(tops)
        for i, beams in enumerate(self.beams):
            grown = []
            for beam in beams:
                top = next(it)
                for token, logprob in top.items():
                    seq = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [top], beam.cum_logprob + logprob)
                    if token == self.eos_token_id and not p.ignore_eos:
                        seq.finish_reason, seq.stop_reason = "stop", None
                        if not p.include_stop_str_in_output:
                            seq.tokens = beam.tokens
                        self.completed[i].append(seq)
                    else:
                        grown.append(seq)
            self.beams[i] = rank(grown)[:p.beam_width]
        self.steps += 1

    def results(self) -> list[BeamSearchOutput]:
        """Each prompt's best beam_width beams, completed and live ranked together; live ones finish by
        length."""
        out = []
        for beams, completed in zip(self.beams, self.completed):
            for b in beams:
                b.finish_reason = "length"
            out.append(BeamSearchOutput(self._rank(completed + beams)[:self.params.beam_width]))
        return out

    def _rank(self, seqs: list[BeamSearchSequence]) -> list[BeamSearchSequence]:
        return sorted(seqs, key=lambda s: beam_score(s, self.eos_token_id, self.params.length_penalty), reverse=True)
