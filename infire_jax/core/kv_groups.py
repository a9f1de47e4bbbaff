"""The layers of a model grouped by what their attention sees, for the hybrid KV cache. No jax here.

A global layer sees every earlier key; a chunked layer (chunk C) sees its own chunk; a sliding-window
layer (window W) the last W keys (`pallas_kernels.metadata.LocalMask`). A bounded layer has no use for
older pages, so the layers are grouped by kind, each group with its own page table, and the groups
draw their pages from one pool (vLLM's hybrid KV cache manager, adapted to a stacked pool):

- Every group has the same number of layers, `page_layers` (s). The pool is [s, pages, page_size,
  heads, dim]: page n of group g is the memory of g's s layers, and layer l lives at index `index[l]`
  of the pool's leading axis, addressed through group `group[l]`'s page table.
- s is chosen per model: the layer counts of the kinds are cut into groups of s, the last group of a
  kind padded where s does not divide its count. s minimises the padding, then the groups, within
  MAX_GROUPS (Llama 4 Scout: 12 global + 36 chunked layers, s = 12, 4 groups, no padding; Qwen2 with
  21 global and 7 window layers: s = 7, 4 groups). A padding layer costs its share of every page of
  its group: `describe` says how many there are.
- A model whose layers are all global, or an engine that keeps every page (`hybrid=False`), has one
  global group of every layer: the pool and the programs are those of a plain model.
- On a pipeline of `stages` stages (the layers: the stacked slots, each stage's contiguous), the pool's
  leading axis is split over the stages like the layers, s / stages indices each, and each group holds
  at stage k's indices layers of stage k only: the layout is made per stage (each stage's layers of a
  kind cut into groups of s / stages, a group empty where a stage has fewer), and a layer's index is
  its stage's (`layer_table`), the one it reads in its stage's shard of the pool.

Group 0 is a global group whenever the model has global layers.

Pure arithmetic on the layers' kinds, in the base layer, so that the memory plan (`infire-jax plan`)
counts the tokens that fit (`KVCapacity`) as the engine does.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

MAX_GROUPS = 8  # more groups than kinds only up to this: each is a page table per step


@dataclasses.dataclass(frozen=True)
class KVGroup:
    """Layers of one kind: chunk C > 0 and / or window W > 0 (both 0: global), and the model layer at
    each index of the group's pages (fewer than `page_layers` where the group is padded at its end;
    -1 at an index that holds no layer before others that do, on a pipeline)."""

    chunk: int
    window: int
    layers: tuple[int, ...]

    @property
    def bounded(self) -> bool:
        """Whether the group's pages before a query's chunk or window may be freed."""
        return self.chunk > 0 or self.window > 0

    @property
    def kind(self) -> str:
        parts = ([f"chunk {self.chunk}"] if self.chunk else []) + ([f"window {self.window}"] if self.window else [])
        return " + ".join(parts) or "global"

    @property
    def span(self) -> int:
        """The most consecutive positions one query sees (0: unbounded)."""
        return min(x for x in (self.chunk, self.window) if x > 0) if self.bounded else 0

    def first_visible(self, pos: int) -> int:
        """The first key position a query at `pos` sees: `pallas_kernels.metadata.first_visible`."""
        start = pos - pos % self.chunk if self.chunk else 0
        if self.window:
            start = max(start, pos - self.window + 1)
        return max(start, 0)

    def first_block(self, pos: int, page_size: int) -> int:
        """The first block a step whose first computed token is at `pos` reads: earlier blocks of a
        bounded group are never read again by this sequence (positions only grow)."""
        return self.first_visible(pos) // page_size

    def max_blocks(self, num_tokens: int, page_size: int, step_tokens: int = 1) -> int:
        """The most blocks one sequence of `num_tokens` holds in this group while it computes steps of
        up to `step_tokens` tokens: every block for a global group; for a bounded one the blocks from
        the first visible key of a step's first token to its last token (vLLM's bound,
        min(span + step tokens, length)), one more for a span that does not start on a page."""
        blocks = -(-num_tokens // page_size)
        if not self.bounded:
            return blocks
        return min(blocks, -(-(self.span - 1 + step_tokens) // page_size) + 1)


@dataclasses.dataclass(frozen=True)
class KVGroupLayout:
    """Which index of a page and which group's page table each layer uses (see the module docstring)."""

    groups: tuple[KVGroup, ...]
    page_layers: int
    num_layers: int
    stages: int = 1  # pipeline stages: each holds page_layers / stages indices of every page

    @classmethod
    def single(cls, num_layers: int) -> "KVGroupLayout":
        """One global group of every layer: a plain model's pool, every page kept."""
        return cls((KVGroup(0, 0, tuple(range(num_layers))),), num_layers, num_layers)

    @classmethod
    def of(cls, local_attention: Sequence[tuple[int, int]], num_layers: int, *, hybrid: bool = True,
           max_groups: int = MAX_GROUPS, stages: int = 1) -> "KVGroupLayout":
        """The layout of a model whose layer l has `local_attention[l]` = (chunk, window) (empty: all
        global, ModelConfig.local_attention). `hybrid=False` keeps every page: one global group.
        `stages`: pipeline stages, each of num_layers / stages consecutive layers (module docstring)."""
        if not hybrid or not any(c or w for c, w in local_attention):
            return cls.single(num_layers)
        if num_layers % stages:
            raise ValueError(f"{num_layers} layers do not split into {stages} equal pipeline stages")
        per_stage = num_layers // stages
        kinds: dict[tuple[int, int], list[list[int]]] = {}  # each kind's layers in each stage
        for layer, (c, w) in enumerate(local_attention):
            kinds.setdefault((c, w), [[] for _ in range(stages)])[layer // per_stage].append(layer)
        order = sorted(kinds, key=lambda k: (k != (0, 0), k))  # the global kind first
        counts = [[len(in_stage) for in_stage in kinds[k]] for k in order]
        size = choose_page_layers(counts, max(max_groups, len(counts)))
        groups = []
        for kind in order:
            for i in range(max(-(-len(in_stage) // size) for in_stage in kinds[kind])):
                slots = [in_stage[i * size:(i + 1) * size] for in_stage in kinds[kind]]
                layers = sum((part + [-1] * (size - len(part)) for part in slots), [])
                while layers[-1] < 0:
                    layers.pop()
                groups.append(KVGroup(*kind, tuple(layers)))
        return cls(tuple(groups), size * stages, num_layers, stages)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def bounded(self) -> bool:
        """Whether some group frees pages a sequence can no longer see (the hybrid cache manager)."""
        return any(g.bounded for g in self.groups)

    @property
    def padding_layers(self) -> int:
        """Layer places in the pages that hold no layer (groups smaller than `page_layers`)."""
        return self.num_groups * self.page_layers - self.num_layers

    def layer_table(self) -> np.ndarray:
        """[L, 2] int32: each layer's (index in the pool's leading axis, group): `AttentionMetadata.layer_kv`.
        On a pipeline the index is within the layer's stage's share of the axis (split like the layers)."""
        table = np.zeros((self.num_layers, 2), np.int32)
        share = self.page_layers // self.stages
        for g, group in enumerate(self.groups):
            for index, layer in enumerate(group.layers):
                if layer >= 0:
                    table[layer] = (index % share, g)
        return table

    def seq_blocks(self, num_tokens: int, page_size: int, step_tokens: int = 1) -> int:
        """Pages (each `page_layers` layers) one sequence of `num_tokens` holds at most, over every group."""
        return sum(g.max_blocks(num_tokens, page_size, step_tokens) for g in self.groups)

    def context_tokens(self, usable_pages: int, page_size: int, max_len: int, num_seqs: int = 1,
                       step_tokens: int = 0) -> int:
        """The longest context (at most `max_len`) each of `num_seqs` sequences can hold at once in
        `usable_pages`, decoding, each paying its bounded groups' pages, while one step of
        `step_tokens` tokens in all takes its bounded groups' transient pages."""
        transient = sum(-(-step_tokens // page_size) for g in self.groups if g.bounded)
        budget = usable_pages - transient

        def fits(tokens: int) -> bool:
            return num_seqs * self.seq_blocks(tokens, page_size) <= budget

        lo, hi = 0, max_len
        while lo < hi:  # the largest length that fits (the blocks grow with the length)
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo

    def describe(self) -> str:
        """The groups, for the start-up log."""
        kinds: dict[str, list[int]] = {}
        for g in self.groups:
            kinds.setdefault(g.kind, []).append(sum(layer >= 0 for layer in g.layers))
        parts = [f"{len(n)} x {g} ({sum(n)} layers)" for g, n in kinds.items()]
        padding = f" ({self.padding_layers} of them padding)" if self.padding_layers else ""
        return f"KV groups: {', '.join(parts)}; a page holds {self.page_layers} layers{padding}"


@dataclasses.dataclass(frozen=True)
class KVCapacity:
    """What a pool of `num_pages` holds: the tokens of context that fit, one sequence's and each of
    several sequences', with each sequence paying its bounded groups' pages (chunks, windows) and one
    step of `step_tokens` their transient ones. The engine's pool (kv_pool.py) and the memory plan
    (memplan/plan.py) report it."""

    groups: KVGroupLayout
    num_pages: int
    page_size: int
    step_tokens: int
    SEQUENCES = (1, 8, 64)

    def context_tokens(self, num_seqs: int = 1) -> int | None:
        """Tokens of context each of `num_seqs` sequences can hold at once; None: any length (every
        group is bounded and their pages fit)."""
        usable = self.num_pages - 1
        most = usable * self.page_size  # no sequence holds more tokens than the pool has slots
        tokens = self.groups.context_tokens(usable, self.page_size, most + 1, num_seqs, self.step_tokens)
        if tokens > most:
            return None if any(g.bounded for g in self.groups.groups) else most
        return tokens

    def describe(self) -> str:
        fits = []
        for n in self.SEQUENCES:
            tokens = self.context_tokens(n)
            each = "any length" if tokens is None else f"{tokens:,}"
            fits.append(f"{n} sequence{'s' if n > 1 else ''}: {each}{' each' if n > 1 else ''}")
        groups = f"{self.groups.describe()}; " if self.groups.bounded else ""
        return f"{groups}KV tokens that fit: {', '.join(fits)}"


def choose_page_layers(counts: Sequence[int | Sequence[int]], max_groups: int) -> int:
    """The group size s (a stage's share of it, on a pipeline) for kinds of `counts` layers (a count
    per pipeline stage each, or one count): the least padding, then the fewest groups, among the
    sizes that make at most `max_groups` groups (s = the largest count always does when there are no
    more kinds than that). A kind has as many groups as its stage with the most of its layers needs."""
    counts = [(n,) if isinstance(n, int) else tuple(n) for n in counts]
    stages, total = len(counts[0]), sum(map(sum, counts))
    best = None
    for s in range(1, max(map(max, counts)) + 1):
        groups = sum(max(-(-n // s) for n in per_stage) for per_stage in counts)
        if groups <= max_groups:
            key = (groups * s * stages - total, groups)
            if best is None or key < best[0]:
                best = (key, s)
    return best[1]
