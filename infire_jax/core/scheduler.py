"""Continuous batching: which requests run in the next step, and how many tokens each.

Pure Python, no jax. Every step, running requests go first (a decode is one token, an unfinished
prompt continues with a chunk), then waiting requests are admitted while the token budget, the
sequence limit and free KV pages allow, keeping pages for the growth the running requests are
expected to need. When a running request cannot get a page all the same, the lowest priority
running request is preempted by recompute: its pages are freed and it waits again.

Scheduling runs one step ahead of the results (asynchronous scheduling): a request whose last
token was sampled on the device but not yet read back is scheduled with that token taken from
the device (`from_device`). `Request.num_pending_tokens` counts such tokens.

A request that asks for prompt logprobs takes from the prefix cache only the positions whose
logprobs an earlier step already computed (after a preemption); a prefill-only request
(max_tokens 0) runs its prompt and samples nothing.

When every row of a step is a plain decode and nobody waiting could be admitted, the step may
become a decode burst: each row takes up to `num_decode_steps` decode steps in one device launch
(`ScheduledSeq.num_steps`), its pages allocated for all of them, so the host plans, launches and
reads back once for several tokens.

With a linear-state cache (core/state_cache.py: models with linear-attention layers), a prefix hit is
cut back to the deepest block whose state is kept, which the admitted row restores into its slot
(`ScheduledSeq.state_restore`), and prompt chunks end at the request's save points, where the row's
state is then kept (`ScheduledSeq.state_save`).

A request that speculates waits instead (`spec_wait`): its proposals need its last token. Its
proposed tokens (`spec_drafts`) ride in its row after its last known token; they are not part of
the request until the step accepts them, so only the known token counts as computed on commit.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from typing import Protocol

from infire_jax.core.hybrid_kv_cache import HybridKVCacheManager
from infire_jax.core.kv_cache import KVCacheManager
from infire_jax.core.request import Request, Status
from infire_jax.core.state_cache import LinearStateCache

# Admission control (after SGLang's new_token_ratio): a running request is expected to generate
# GROWTH_RATIO of the tokens it may still generate. Each preemption raises the ratio, each step
# without one lowers it a little, so the pool is neither over-admitted (a preemption storm: 101
# on the first H100 run at concurrency 256) nor left idle when requests stop early.
GROWTH_RATIO_INIT = 0.5
GROWTH_RATIO_MIN = 0.1
GROWTH_RATIO_STEP = 0.2  # added per preempted request
GROWTH_RATIO_DECAY = 0.002  # subtracted per step without a preemption
GROWTH_CLIP_TOKENS = 4096  # max_tokens beyond this (an unset limit) counts as this much


class AdmissionGate(Protocol):
    """Something a request needs besides pages and a slot (LoRA: its adapter in a device slot,
    lora/adapters.py): `acquire` at admission (False: the request waits, others may go first),
    `release` when it is preempted or finished."""

    def acquire(self, req: Request) -> bool: ...

    def release(self, req: Request, finished: bool) -> None: ...


@dataclasses.dataclass
class ScheduledSeq:
    req: Request
    start: int  # first position computed in this step
    num_tokens: int
    samples: bool  # the step reaches the end of the known tokens, so it samples the next one
    from_device: bool  # the single token of this step is the one the device sampled last step
    reset_slot: bool  # first step since (re)admission: clear the slot's device-side history
    gen_index: int  # tokens generated before this step's sample (the seed's draw index)
    drafts: list[int] = dataclasses.field(default_factory=list)  # proposed tokens to verify, after the known ones
    num_steps: int = 1  # decode steps the row takes in this step (> 1: a decode burst)
    state_restore: int | None = None  # the linear-state snapshot the admitted row starts from (None: zeros)
    state_save: int | None = None  # the snapshot that keeps the row's linear state after this step


@dataclasses.dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq]
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def is_burst(self) -> bool:
        return any(s.num_steps > 1 for s in self.seqs)


class Scheduler:
    def __init__(self, kv: KVCacheManager | HybridKVCacheManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 num_decode_steps: int = 1, gate: AdmissionGate | None = None,
                 states: LinearStateCache | None = None):
        self.kv = kv
        self.gate = gate
        self.states = states
        self.num_decode_steps = num_decode_steps
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Request] = []  # sorted by Request.sort_key
        self.running: list[Request] = []
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.num_preemptions = 0
        self.growth_ratio = GROWTH_RATIO_INIT

    # ---- queue management -------------------------------------------------------------------
    def add(self, req: Request) -> None:
        bisect.insort(self.waiting, req, key=Request.sort_key)

    def finish(self, req: Request, status: Status) -> None:
        """Ends a request wherever it is and releases its pages and slot."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req, finished=True)
        req.status = status

    def _release(self, req: Request, finished: bool = False) -> None:
        if self.gate is not None:
            self.gate.release(req, finished)
        self.kv.free(req)
        req.spec_drafts = []
        if req.slot is not None:
            self._free_slots.append(req.slot)
            req.slot = None

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.add(req)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- the step plan ----------------------------------------------------------------------
    def _wants_tokens(self, req: Request) -> int:
        """Tokens the request could compute now (0 once its last allowed token is sampled)."""
        if req.prefill_only:
            return req.num_prompt_tokens - req.num_computed_tokens
        if len(req.output_token_ids) + req.num_pending_tokens >= req.max_tokens:
            return 0
        return req.num_tokens - req.num_computed_tokens + len(req.spec_drafts)

    @staticmethod
    def _to_save_point(req: Request, start: int, n: int) -> int:
        """`n` tokens from `start`, cut so the chunk ends at the request's next linear-state save point."""
        for point in req.state_saves:
            if point > start:
                return min(n, point - start)
        return n

    def _plan(self, req: Request, n: int, reset: bool, restore: int | None = None) -> ScheduledSeq:
        start = req.num_computed_tokens
        drafts, req.spec_drafts = req.spec_drafts, []
        save = None
        if req.state_saves and start + n == req.state_saves[0]:
            save = self.states.claim(req.block_hashes[(start + n) // self.kv.page_size - 1])
            req.state_saves.pop(0)
        return ScheduledSeq(
            req=req, start=start, num_tokens=n, drafts=drafts,
            samples=start + n - len(drafts) == req.num_tokens and not req.prefill_only,
            from_device=start >= len(req.prompt_token_ids) + len(req.output_token_ids),
            reset_slot=reset,
            gen_index=len(req.output_token_ids) + req.num_pending_tokens,
            state_restore=restore, state_save=save,
        )

    def _expected_pages(self, req: Request, num_pages_held: int) -> int:
        """Pages the request is expected to need beyond `num_pages_held`: the rest of its prompt
        and `growth_ratio` of the tokens it may still generate (at most GROWTH_CLIP_TOKENS), as many
        as a sequence that long holds (a hybrid cache's bounded groups hold their chunk or window)."""
        left = min(req.max_tokens - len(req.output_token_ids) - req.num_pending_tokens, GROWTH_CLIP_TOKENS)
        total = req.num_tokens + math.ceil(self.growth_ratio * max(left, 0))
        return max(0, self.kv.seq_pages(total) - num_pages_held)

    def _adapt_growth_ratio(self, num_preempted: int) -> None:
        """Up after a preemption (admission was too optimistic), slowly down otherwise."""
        if num_preempted:
            self.growth_ratio = min(1.0, self.growth_ratio + GROWTH_RATIO_STEP * num_preempted)
        else:
            self.growth_ratio = max(GROWTH_RATIO_MIN, self.growth_ratio - GROWTH_RATIO_DECAY)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        seqs: list[ScheduledSeq] = []
        preempted: list[Request] = []
        scheduled: set[int] = set()

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.spec_wait and req.num_pending_tokens:  # its proposals wait for its last token
                i += 1
                continue
            n = self._to_save_point(req, req.num_computed_tokens, min(self._wants_tokens(req), budget))
            if req.spec_drafts and (n < 1 + len(req.spec_drafts) or not self.kv.can_allocate(req, n)):
                req.spec_drafts = []  # never preempt anyone, or split a row, for proposed tokens
                n = min(self._wants_tokens(req), budget)
            if n <= 0:
                i += 1
                continue
            evicted = False
            while not self.kv.can_allocate(req, n):
                candidates = [r for r in self.running if id(r) not in scheduled]
                victim = max(candidates, key=Request.sort_key)
                self._preempt(victim)
                preempted.append(victim)
                evicted = True
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                continue  # it preempted itself; `running` shifted, so i points at the next one
            if evicted:
                i = self.running.index(req)  # victims may have stood before it
            self.kv.allocate(req, n)
            seqs.append(self._plan(req, n, reset=False))
            scheduled.add(id(req))
            budget -= n
            i += 1

        # Admit waiting requests, unless this step already had to preempt, while the pool keeps
        # room for what the running ones and the newcomer are expected to grow into.
        self._adapt_growth_ratio(len(preempted))
        j = 0
        reserve = None
        while (j < len(self.waiting) and budget > 0 and not preempted
               and len(self.running) < self.max_num_seqs):
            req = self.waiting[j]
            if req.num_pending_tokens:  # preempted before its last sample was read back
                j += 1
                continue
            if reserve is None:
                reserve = sum(self._expected_pages(r, self.kv.held_pages(r)) for r in self.running)
            cached, restore = self.kv.find_cached_prefix(req), None
            if self.states is not None:  # a hit needs the linear state after it: cut to the deepest kept one
                blocks, restore = self.states.lookup(req, len(cached))
                req.state_saves = self.states.save_points(req, len(cached), blocks)
                cached = cached[:blocks]
            start = len(cached) * self.kv.page_size
            n = self._to_save_point(req, start, min(req.num_tokens - start, budget))
            own = self._expected_pages(req, self.kv.seq_pages(len(cached) * self.kv.page_size + n))
            if self.gate is not None and not self.gate.acquire(req):
                j += 1  # its adapter has no device slot free: it waits, others may still fit
                continue
            if not self.kv.allocate(req, n, cached, reserve=reserve + own):
                if self.gate is not None:
                    self.gate.release(req, finished=False)
                break
            reserve += own
            if req.num_preemptions == 0:
                req.num_cached_tokens = len(cached) * self.kv.page_size
                self.kv.record_query(req.num_tokens, req.num_cached_tokens)
            self.waiting.pop(j)
            req.status = Status.RUNNING
            req.slot = self._free_slots.pop()
            self.running.append(req)
            seqs.append(self._plan(req, n, reset=True, restore=restore))
            budget -= n
        if self.num_decode_steps > 1 and not preempted:
            self._plan_burst(seqs)
        return SchedulerOutput(seqs, preempted)

    def _plan_burst(self, seqs: list[ScheduledSeq]) -> None:
        """Turns a step of plain decodes into a burst when nobody waiting could join instead: each
        row takes as many steps as max_tokens allows (and min_tokens, whose stop-id suppression is
        fixed for the burst), with pages for all of them, or the step stays a single one."""
        if not seqs or (self.waiting and len(self.running) < self.max_num_seqs):
            return
        steps = []
        for sq in seqs:
            req = sq.req
            if sq.num_tokens != 1 or not sq.samples or sq.drafts or req.masked_by_output \
                    or req.allowed_mask is not None:
                return
            left = req.max_tokens - sq.gen_index
            if sq.gen_index < req.params.min_tokens:
                left = min(left, req.params.min_tokens - sq.gen_index)
            steps.append(min(self.num_decode_steps, left))
        pages = sum(self.kv.new_pages(sq.req, n) for sq, n in zip(seqs, steps))
        if max(steps) == 1 or pages > self.kv.num_free_pages:
            return
        for sq, n in zip(seqs, steps):
            self.kv.allocate(sq.req, n)
            sq.num_steps = n

    def commit(self, out: SchedulerOutput) -> None:
        """Records that the planned step was dispatched: its tokens are (about to be) cached, and so are
        the linear states it keeps."""
        if self.states is not None:
            self.states.publish()
        for s in out.seqs:
            if s.req.wants_prompt_logprobs:  # the step computes these positions' logits (prompt_logprobs.py)
                s.req.prompt_logprobs_next = max(s.req.prompt_logprobs_next, s.start + s.num_tokens)
            if s.req.pooling is not None:  # and pools their states (infire_jax/pooling/plan.py)
                s.req.pool_next = max(s.req.pool_next, s.start + s.num_tokens)
            # The engine adds accepted proposals; a burst computes each of its samples but the last.
            s.req.num_computed_tokens += s.num_tokens - len(s.drafts) + s.num_steps - 1
            if s.samples:
                s.req.num_pending_tokens += s.num_steps
            self.kv.register_full_blocks(s.req)
