"""Turns the work of one scheduler step into the fixed-shape host arrays of one jitted step (numpy only)."""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from infire_jax.runner.buckets import StepShape
from infire_jax.core.kv_groups import KVGroupLayout
from infire_jax.sample.bad_words import banned_after
from infire_jax.sample.sampler import SamplingInputs
from infire_jax.sample.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS
from infire_jax.core.scheduler import SchedulerOutput
from infire_jax.structured.matcher import fill_bitmasks
from pallas_kernels.metadata import NULL_PAGE, AttentionMetadata

# A token's role, for the device-side penalty history: prompt and output tokens are recorded
# there as they go through the model; proposed tokens only once verification accepts them.
TOKEN_PAD, TOKEN_PROMPT, TOKEN_OUTPUT, TOKEN_DRAFT = 0, 1, 2, 3


class StepBatch(NamedTuple):
    token_ids: np.ndarray  # [T] int32
    from_device: np.ndarray  # [T] bool: use the device's last sample for this token's slot
    token_kind: np.ndarray  # [T] int32: TOKEN_PAD / TOKEN_PROMPT / TOKEN_OUTPUT
    meta: AttentionMetadata
    logits_indices: np.ndarray  # [S] int32: the last token of each row; [S * (K + 1)] when verifying K proposals
    row_slots: np.ndarray  # [S] int32: device-side request slot of each row (padding -> dummy slot)
    reset_rows: np.ndarray  # [S] bool
    sample_rows: np.ndarray  # [S] bool: rows whose sample is a real next token
    sampling: SamplingInputs
    lora_slots: np.ndarray | None = None  # [T] int32: each token's LoRA adapter slot (0: none); None: LoRA off
    image_rows: np.ndarray | None = None  # [T] int32: an image patch token's row of the image pool (-1: none)


class DraftInputs(NamedTuple):
    """The proposed tokens of a verifying step (speculative/verify.py)."""

    tokens: np.ndarray  # [S, K] int32; -1 past a row's proposals
    num: np.ndarray  # [S] int32


class BurstInputs(NamedTuple):
    """Per row of a decode burst (step_programs.decode_burst)."""

    num_steps: np.ndarray  # [S] int32: decode steps the row may take (0: padding)
    stop_ids: np.ndarray  # [S, MAX_STOP_TOKEN_IDS] int32: samples that end the row early; -1 = none


def burst_inputs(work: SchedulerOutput, num_rows: int) -> BurstInputs:
    """The device stops a row early on its EOS and stop token ids (the first MAX_STOP_TOKEN_IDS of
    them; the host's checks decide, so a row with more, or with stop strings, only stops later)."""
    num_steps = np.zeros(num_rows, np.int32)
    stop_ids = np.full((num_rows, MAX_STOP_TOKEN_IDS), -1, np.int32)
    for i, sq in enumerate(work.seqs):
        num_steps[i] = sq.num_steps
        ids = (tuple(sq.req.eos_token_ids) + tuple(sq.req.params.stop_token_ids or ()))[:MAX_STOP_TOKEN_IDS]
        stop_ids[i, :len(ids)] = ids
    return BurstInputs(num_steps, stop_ids)


def draft_inputs(work: SchedulerOutput, shape: StepShape, num_spec: int) -> DraftInputs:
    tokens = np.full((shape.num_rows, num_spec), -1, np.int32)
    num = np.zeros(shape.num_rows, np.int32)
    for i, sq in enumerate(work.seqs):
        tokens[i, :len(sq.drafts)] = sq.drafts
        num[i] = len(sq.drafts)
    return DraftInputs(tokens, num)


def _column(values: list, size: int, fill, dtype) -> np.ndarray:
    """A row column: the rows' values, then `fill` for the padding rows (one conversion per column)."""
    out = np.full(size, fill, dtype)
    out[:len(values)] = values
    return out


@functools.cache
def _no_logit_bias(num_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """A row bucket's logit_bias columns when no row has any: made once, read-only (a step's inputs are
    copied to the device, never written)."""
    ids, bias = np.full((num_rows, MAX_LOGIT_BIAS), -1, np.int32), np.zeros((num_rows, MAX_LOGIT_BIAS), np.float32)
    ids.flags.writeable = bias.flags.writeable = False
    return ids, bias


def _logit_bias(num_rows: int, biased: list[tuple[int, dict[int, float]]]) -> tuple[np.ndarray, np.ndarray]:
    """The sampler's logit_bias columns ([S, MAX_LOGIT_BIAS] ids, -1 for none, and biases) of the rows
    `biased` names, each with its request's map."""
    if not biased:
        return _no_logit_bias(num_rows)
    ids, bias = (a.copy() for a in _no_logit_bias(num_rows))
    for i, token_bias in biased:
        ids[i, :len(token_bias)] = list(token_bias)
        bias[i, :len(token_bias)] = list(token_bias.values())
    return ids, bias


def build_batch(work: SchedulerOutput, shape: StepShape, *, page_size: int, pages_per_seq: int,
                dummy_slot: int, num_spec: int = 0, kv_groups: KVGroupLayout | None = None,
                lora: bool = False, images: bool = False) -> StepBatch:
    """Per-row values are gathered in Python lists and converted once per column: at batch 256 a
    numpy write per value cost more host time than the device step has to spare.

    With `num_spec` = K > 0 (a verifying step) each row has logits at K + 1 positions: its known
    token and its proposals, repeating its last token past them. With `kv_groups` of several groups
    (a hybrid KV cache) every group gets its page table and slot mapping from the rows'
    `group_pages`, and the metadata the layers' (pool index, group) table. With `lora`, each token
    carries its request's adapter slot (lora/adapters.py; padding: 0). With `images`, each prompt token
    its image pool row (`Request.image_rows`; -1 for text, outputs and padding)."""
    t, s = shape.num_tokens, shape.num_rows
    num_groups = kv_groups.num_groups if kv_groups is not None else 1
    lora_slots = np.zeros(t, np.int32) if lora else None
    image_rows = np.full(t, -1, np.int32) if images else None
    tokens = np.zeros(t, np.int32)
    from_device = np.zeros(t, bool)
    kind = np.zeros(t, np.int32)
    positions = np.zeros(t, np.int32)
    slot_mappings = np.tile(np.arange(t, dtype=np.int32) % page_size + NULL_PAGE * page_size, (num_groups, 1))
    seq_ids = np.full(t, s, np.int32)
    page_tables = np.full((num_groups, s, pages_per_seq), NULL_PAGE, np.int32)
    suppress = np.full((s, MAX_STOP_TOKEN_IDS), -1, np.int32)
    biased = [(i, sq.req.params.logit_bias) for i, sq in enumerate(work.seqs) if sq.req.params.logit_bias]
    bias_ids, bias = _logit_bias(s, biased)
    rows: dict[str, list] = {k: [] for k in (
        "kv_lens", "ends", "slots", "reset", "sample", "temperature", "top_k", "top_p", "min_p", "rep", "pres",
        "freq", "seed", "gen", "want_lp", "drafts")}

    off = 0
    for i, sq in enumerate(work.seqs):
        req, n, st = sq.req, sq.num_tokens, sq.start
        end = off + n
        group_pages = req.group_pages if num_groups > 1 else (req.pages,)
        nd = len(sq.drafts)
        if sq.from_device:
            from_device[off] = True
        elif nd:
            tokens[off:end] = req.token_slice(st, n - nd) + sq.drafts
        else:
            tokens[off:end] = req.token_slice(st, n)
        if n == 1:  # a decode: scalars, no per-token arrays
            positions[off] = st
            kind[off] = TOKEN_PROMPT if st < req.num_prompt_tokens else TOKEN_OUTPUT
            for g, pages in enumerate(group_pages):
                slot_mappings[g, off] = pages[st // page_size] * page_size + st % page_size
        else:
            pos = np.arange(st, st + n, dtype=np.int32)
            positions[off:end] = pos
            kind[off:end] = np.where(pos < req.num_prompt_tokens, TOKEN_PROMPT, TOKEN_OUTPUT)
            kind[end - nd:end] = TOKEN_DRAFT
            for g, pages in enumerate(group_pages):
                slot_mappings[g, off:end] = np.asarray(pages, np.int32)[pos // page_size] * page_size + pos % page_size
        seq_ids[off:end] = i
        if lora_slots is not None:
            lora_slots[off:end] = req.lora_slot
        if image_rows is not None and req.image_rows is not None and st < req.num_prompt_tokens:
            prompt_end = min(st + n, req.num_prompt_tokens)
            image_rows[off:off + prompt_end - st] = req.image_rows[st:prompt_end]
        for g, pages in enumerate(group_pages):
            page_tables[g, i, :len(pages)] = pages
        p = req.params
        rows["kv_lens"].append(st + n)
        rows["ends"].append(end)
        rows["drafts"].append(nd)
        rows["slots"].append(req.slot)
        rows["reset"].append(sq.reset_slot and st == 0)  # with a cached prefix the runner loads the history first
        rows["sample"].append(sq.samples)
        rows["temperature"].append(p.temperature)
        rows["top_k"].append(p.top_k)
        rows["top_p"].append(p.top_p)
        rows["min_p"].append(p.min_p)
        rows["rep"].append(p.repetition_penalty)
        rows["pres"].append(p.presence_penalty)
        rows["freq"].append(p.frequency_penalty)
        rows["seed"].append((req.seed & 0xFFFFFFFF, (req.seed >> 32) & 0xFFFFFFFF))
        rows["gen"].append(sq.gen_index)
        rows["want_lp"].append(p.logprobs is not None)
        if sq.gen_index < p.min_tokens:
            ids = req.min_tokens_stop_ids
            suppress[i, :len(ids)] = ids
        off = end

    nrows = len(work.seqs)
    cu = np.full(s + 1, off, np.int32)
    cu[0] = 0
    cu[1:nrows + 1] = rows["ends"]
    seed = np.zeros((s, 2), np.uint32)
    if nrows:
        seed[:nrows] = rows["seed"]
    groups = num_groups > 1
    meta = AttentionMetadata(
        positions=positions, slot_mapping=slot_mappings[0], seq_ids=seq_ids, page_table=page_tables[0],
        kv_lens=_column(rows["kv_lens"], s, 0, np.int32), cu_q_lens=cu, num_seqs=np.int32(nrows),
        group_page_tables=page_tables if groups else None, group_slot_mappings=slot_mappings if groups else None,
        layer_kv=kv_groups.layer_table() if groups else None)
    sampling = SamplingInputs(
        _column(rows["temperature"], s, 0.0, np.float32), _column(rows["top_k"], s, 0, np.int32),
        _column(rows["top_p"], s, 1.0, np.float32), _column(rows["min_p"], s, 0.0, np.float32),
        _column(rows["rep"], s, 1.0, np.float32), _column(rows["pres"], s, 0.0, np.float32),
        _column(rows["freq"], s, 0.0, np.float32), seed, _column(rows["gen"], s, 0, np.int32),
        _column(rows["want_lp"], s, False, bool), suppress, bias_ids, bias)
    if num_spec:  # row i: its known token's index, then its proposals', then its last again
        ends = _column(rows["ends"], s, 1, np.int32)
        first = ends - 1 - _column(rows["drafts"], s, 0, np.int32)
        # int32 as the executables were compiled for (an int64 arange made a warm start rebuild them)
        offsets = np.arange(num_spec + 1, dtype=np.int32)
        logits_indices = np.minimum(first[:, None] + offsets, ends[:, None] - 1).reshape(-1)
    else:
        logits_indices = _column([e - 1 for e in rows["ends"]], s, 0, np.int32)
    return StepBatch(tokens, from_device, kind, meta, logits_indices, _column(rows["slots"], s, dummy_slot, np.int32),
                     _column(rows["reset"], s, False, bool), _column(rows["sample"], s, False, bool), sampling,
                     lora_slots, image_rows)


def grammar_bitmask(work: SchedulerOutput, num_rows: int, words: int, positions: int = 1) -> np.ndarray | None:
    """Structured outputs, allowed_token_ids and bad_words: each constrained sampling row's allowed next tokens
    as bits ([S, W] int32, every bit set for the other rows; a row with both has what both allow), or
    None when no row is constrained, so an unconstrained step copies no mask (the runner passes a
    device-resident all-allowed one).

    A verifying step (`positions` = K + 1) has a mask per position, [S * (K + 1), W]: position j
    of a row allows what its grammar allows after the row's first j proposals. The matcher walks
    the proposals and is rolled back; the engine advances it by the tokens the step accepts."""
    rows = [(sq, i) for i, sq in enumerate(work.seqs)
            if sq.samples and (sq.req.masked_by_output or sq.req.allowed_mask is not None)]
    if not rows:
        return None
    mask = np.full((num_rows * positions, words), -1, np.int32)
    grammars = [(sq, i) for sq, i in rows if sq.req.grammar is not None]
    if positions == 1 and grammars:
        fill_bitmasks([(sq.req.grammar, i) for sq, i in grammars], mask)
    elif grammars:
        for sq, i in grammars:
            grammar = sq.req.grammar
            for j, tok in enumerate([*sq.drafts, None]):
                fill_bitmasks([(grammar, i * positions + j)], mask)
                if tok is not None:
                    grammar.accept_token(tok)
            grammar.rollback(len(sq.drafts))
    for sq, i in rows:
        if sq.req.allowed_mask is not None:
            mask[i * positions:(i + 1) * positions] &= sq.req.allowed_mask
        if sq.req.bad_sequences:  # position j follows the output and the row's first j proposals
            bits = mask.view(np.uint32)
            tail = sq.req.output_token_ids[-max(len(prefix) for prefix, _ in sq.req.bad_sequences):]
            for j in range(positions):
                for token in banned_after(sq.req.bad_sequences, tail + list(sq.drafts[:j])):
                    bits[i * positions + j, token // 32] &= ~np.uint32(1 << (token % 32))
    return mask
