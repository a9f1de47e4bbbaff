"""Prompt logprobs (vLLM's `SamplingParams.prompt_logprobs`): which positions of a step need them, and
what comes back, as the requests' entries (`Logprob`). Host side, numpy only: the runner plans with
it, the engine records with it, outputs.py names its types.

The logits at prompt position p predict prompt token p + 1, so a request's chunk [start, start + n)
contributes positions up to the prompt's second-to-last (the last one's logits are the first
sample's). Positions a dispatched step already covered (`Request.prompt_logprobs_next`) are never
planned again, so a prompt computed again after a preemption reports nothing twice.

The device never holds the whole prompt's logits: the step's forward returns every token's final
hidden state, and the planned positions go through the LM head in fixed blocks of BLOCK rows
(step_programs.prompt_logprobs_block), each bringing back only the prompt token's logprob and rank
and the top k, so nothing compiles per prompt and a block's [BLOCK, V] logits are the most held.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import numpy as np

from infire_jax.core.scheduler import ScheduledSeq

# Prompt positions per launch of the head (a block's logits: BLOCK x vocab float32), or fewer where a
# step has fewer tokens (RunnerConfig.prompt_logprobs_block).
BLOCK = 128


@dataclasses.dataclass(frozen=True)
class Logprob:
    """One token's log-probability at one position, as vLLM reports prompt logprobs: its rank in the
    model's distribution there (1 = the most likely; ties share the worst rank) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's layout: an entry per prompt token, None for the first (nothing predicts it), else the
# prompt token's Logprob and the top k alternatives' by token id (prompt token first, then by rank).
PromptLogprobs = list[dict[int, Logprob] | None]


class PromptLogprobPlan(NamedTuple):
    """The prompt positions of one step, in blocks (padding: token 0, target 0)."""

    spans: list[tuple[int, int, int]]  # (row, first prompt position, count) per row, in block order
    token_index: np.ndarray  # [blocks, block] int32: the position's index among the step's tokens
    targets: np.ndarray  # [blocks, block] int32: the prompt token its logits predict


class PromptLogprobResult(NamedTuple):
    """What the blocks brought back, the planned positions first (numpy)."""

    logprob: np.ndarray  # [P] float32: of the prompt token
    rank: np.ndarray  # [P] int32: tokens at least as likely as the prompt token, itself included
    top_ids: np.ndarray  # [P, K] int32, K = the engine's max_prompt_logprobs
    top_logprobs: np.ndarray  # [P, K] float32


def plan_prompt_logprobs(seqs: list[ScheduledSeq], block: int) -> PromptLogprobPlan | None:
    """The positions of this step whose prompt logprobs are wanted, or None when there are none."""
    spans, index, targets = [], [], []
    offset = 0
    for row, sq in enumerate(seqs):
        req = sq.req
        first = max(sq.start, req.prompt_logprobs_next)
        end = min(sq.start + sq.num_tokens, req.num_prompt_tokens - 1)
        if req.wants_prompt_logprobs and end > first:
            spans.append((row, first, end - first))
            index.append(np.arange(offset + first - sq.start, offset + end - sq.start, dtype=np.int32))
            targets.append(np.asarray(req.prompt_token_ids[first + 1:end + 1], np.int32))
        offset += sq.num_tokens
    if not spans:
        return None
    n = sum(count for _, _, count in spans)
    padded = -(-n // block) * block
    flat_index = np.zeros(padded, np.int32)
    flat_targets = np.zeros(padded, np.int32)
    flat_index[:n] = np.concatenate(index)
    flat_targets[:n] = np.concatenate(targets)
    return PromptLogprobPlan(spans, flat_index.reshape(-1, block), flat_targets.reshape(-1, block))


def record_prompt_logprobs(seqs: list[ScheduledSeq], plan: PromptLogprobPlan, result: PromptLogprobResult,
                           token_text: Callable[[int], str]) -> None:
    """Appends each planned position's entry to its request's `prompt_logprobs`: the prompt token's
    Logprob, then the top k's (k: the request's own prompt_logprobs), by token id."""
    i = 0
    for row, first, count in plan.spans:
        req = seqs[row].req
        k = req.params.prompt_logprobs
        prompt = req.prompt_token_ids
        for j in range(i, i + count):
            target = prompt[first + 1 + j - i]
            entry = {target: Logprob(float(result.logprob[j]), int(result.rank[j]), token_text(target))}
            for r, (tok, lp) in enumerate(zip(result.top_ids[j, :k].tolist(), result.top_logprobs[j, :k].tolist())):
                if tok not in entry:
                    entry[tok] = Logprob(lp, r + 1, token_text(tok))
            req.prompt_logprobs.append(entry)
        i += count
