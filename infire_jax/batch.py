"""Turns the work of one scheduler step into the fixed-shape host arrays of one jitted step (numpy only)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from infire_jax.buckets import StepShape
from infire_jax.sampler import SamplingInputs
from infire_jax.sampling_params import MAX_STOP_TOKEN_IDS
from infire_jax.scheduler import SchedulerOutput
from pallas_kernels.metadata import NULL_PAGE, AttentionMetadata

TOKEN_PAD, TOKEN_PROMPT, TOKEN_OUTPUT = 0, 1, 2


class StepBatch(NamedTuple):
    token_ids: np.ndarray  # [T] int32
    from_device: np.ndarray  # [T] bool: use the device's last sample for this token's slot
    token_kind: np.ndarray  # [T] int32: TOKEN_PAD / TOKEN_PROMPT / TOKEN_OUTPUT
    meta: AttentionMetadata
    logits_indices: np.ndarray  # [S] int32: the last token of each row
    row_slots: np.ndarray  # [S] int32: device-side request slot of each row (padding -> dummy slot)
    reset_rows: np.ndarray  # [S] bool
    sample_rows: np.ndarray  # [S] bool: rows whose sample is a real next token
    sampling: SamplingInputs


def build_batch(work: SchedulerOutput, shape: StepShape, *, page_size: int, pages_per_seq: int,
                dummy_slot: int) -> StepBatch:
    t, s = shape.num_tokens, shape.num_rows
    tokens = np.zeros(t, np.int32)
    from_device = np.zeros(t, bool)
    kind = np.zeros(t, np.int32)
    positions = np.zeros(t, np.int32)
    slot_mapping = np.arange(t, dtype=np.int32) % page_size + NULL_PAGE * page_size
    seq_ids = np.full(t, s, np.int32)
    page_table = np.full((s, pages_per_seq), NULL_PAGE, np.int32)
    kv_lens = np.zeros(s, np.int32)
    cu = np.zeros(s + 1, np.int32)
    logits_indices = np.zeros(s, np.int32)
    row_slots = np.full(s, dummy_slot, np.int32)
    reset = np.zeros(s, bool)
    sample_rows = np.zeros(s, bool)
    temperature = np.zeros(s, np.float32)
    top_k = np.zeros(s, np.int32)
    top_p = np.ones(s, np.float32)
    min_p = np.zeros(s, np.float32)
    rep = np.ones(s, np.float32)
    pres = np.zeros(s, np.float32)
    freq = np.zeros(s, np.float32)
    seed = np.zeros((s, 2), np.uint32)
    gen = np.zeros(s, np.int32)
    want_lp = np.zeros(s, bool)
    suppress = np.full((s, MAX_STOP_TOKEN_IDS), -1, np.int32)

    off = 0
    for i, sq in enumerate(work.seqs):
        req, n, st = sq.req, sq.num_tokens, sq.start
        end = off + n
        if sq.from_device:
            from_device[off] = True
        else:
            tokens[off:end] = req.token_slice(st, n)
        pos = np.arange(st, st + n, dtype=np.int32)
        positions[off:end] = pos
        kind[off:end] = np.where(pos < req.num_prompt_tokens, TOKEN_PROMPT, TOKEN_OUTPUT)
        pages = np.asarray(req.pages, np.int32)
        slot_mapping[off:end] = pages[pos // page_size] * page_size + pos % page_size
        seq_ids[off:end] = i
        page_table[i, :len(pages)] = pages
        kv_lens[i] = st + n
        cu[i + 1] = end
        logits_indices[i] = end - 1
        row_slots[i] = req.slot
        reset[i] = sq.reset_slot and st == 0  # with a cached prefix the runner loads the history first
        sample_rows[i] = sq.samples
        p = req.params
        temperature[i], top_k[i], top_p[i], min_p[i] = p.temperature, p.top_k, p.top_p, p.min_p
        rep[i], pres[i], freq[i] = p.repetition_penalty, p.presence_penalty, p.frequency_penalty
        seed[i] = (req.seed & 0xFFFFFFFF, (req.seed >> 32) & 0xFFFFFFFF)
        gen[i] = sq.gen_index
        want_lp[i] = p.logprobs is not None
        if sq.gen_index < p.min_tokens:
            ids = req.min_tokens_stop_ids
            suppress[i, :len(ids)] = ids
        off = end
    cu[len(work.seqs) + 1:] = off

    meta = AttentionMetadata(
        positions=positions, slot_mapping=slot_mapping, seq_ids=seq_ids, page_table=page_table,
        kv_lens=kv_lens, cu_q_lens=cu, num_seqs=np.int32(len(work.seqs)))
    sampling = SamplingInputs(temperature, top_k, top_p, min_p, rep, pres, freq, seed, gen, want_lp, suppress)
    return StepBatch(tokens, from_device, kind, meta, logits_indices, row_slots, reset, sample_rows, sampling)
