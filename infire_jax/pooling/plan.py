"""Which tokens of a step an embedding pools, and the embedding they add up to. Host side, numpy.

A pooling request is a prompt run with nothing sampled (max_tokens 0), in as many prompt chunks as
the scheduler gives it. Each step's forward leaves every token's hidden state on the device; the
pooling program (step_programs.pool_rows) weighs them by this plan and sums them per row of the
step, so only [rows, hidden] float32 comes back. The request adds its rows up (`Request.pooled`)
and, once its last chunk is back, `embedding` finishes it: a mean divides, `dimensions` cuts a
matryoshka prefix, `use_activation` scales to unit length (in that order, as vLLM's pooler head does).

Positions a dispatched step already pooled (`Request.pool_next`) are never weighed again, so a
prompt computed again after a preemption adds nothing twice. MEAN and CLS take no prefix-cache hit
past that position (`Request.first_unscored`); LAST takes any, as a step always computes the last
prompt token.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from infire_jax.core.scheduler import ScheduledSeq
from infire_jax.pooling.config import PoolerConfig


class PoolingPlan(NamedTuple):
    rows: list[int]  # the step's rows whose requests pool
    weights: np.ndarray  # [T] float32: each token's weight in its row's sum (0: padding, other rows)
    token_rows: np.ndarray  # [T] int32: each token's row in the step


def plan_pooling(seqs: list[ScheduledSeq], num_tokens: int) -> PoolingPlan | None:
    """The weights of this step's tokens (a bucket of `num_tokens`), or None when no row pools."""
    if all(sq.req.pooling is None for sq in seqs):  # most steps, decode ones included: no arrays built
        return None
    rows, offset = [], 0
    weights = np.zeros(num_tokens, np.float32)
    token_rows = np.zeros(num_tokens, np.int32)
    for row, sq in enumerate(seqs):
        req = sq.req
        token_rows[offset:offset + sq.num_tokens] = row
        if req.pooling is not None:
            positions = np.arange(sq.start, sq.start + sq.num_tokens)
            if req.pooling_type == "LAST":
                take = positions == req.num_prompt_tokens - 1
            elif req.pooling_type == "CLS":
                take = positions == 0
            else:
                take = positions < req.num_prompt_tokens
            take &= positions >= req.pool_next
            if take.any():
                rows.append(row)
                weights[offset:offset + sq.num_tokens] = take
        offset += sq.num_tokens
    return PoolingPlan(rows, weights, token_rows) if rows else None


def record_pooling(seqs: list[ScheduledSeq], plan: PoolingPlan, sums: np.ndarray) -> None:
    """Adds each pooled row's sum ([rows of the bucket, hidden] float32) to its request's."""
    for row in plan.rows:
        req = seqs[row].req
        part = sums[row].astype(np.float64)
        req.pooled = part if req.pooled is None else req.pooled + part


def embedding(pooled: np.ndarray, num_tokens: int, pooler: PoolerConfig, dimensions: int | None,
              use_activation: bool | None) -> np.ndarray:
    """A request's embedding (float32) from its summed states."""
    out = pooled / num_tokens if pooler.pooling_type == "MEAN" else pooled
    if dimensions is not None:
        out = out[:dimensions]
    if pooler.use_activation if use_activation is None else use_activation:
        out = out / max(float(np.linalg.norm(out)), 1e-12)  # torch's F.normalize: eps 1e-12
    return out.astype(np.float32)
