"""The contract between the runner and every attention implementation.

A step processes a flat, padded batch of T tokens that belong to S sequences (decodes and
prefill chunks mixed). Tokens of one sequence are contiguous and in position order.
"""

from __future__ import annotations

from typing import NamedTuple

from jaxtyping import Array, Int


class AttentionMetadata(NamedTuple):
    positions: Int[Array, "T"]  # position of each token in its sequence
    slot_mapping: Int[Array, "T"]  # flat cache slot (page * page_size + offset); padding -> null page 0
    seq_ids: Int[Array, "T"]  # row of each token's sequence; padding tokens -> S (out of range)
    page_table: Int[Array, "S P"]  # pages of each sequence; unused entries -> null page 0
    kv_lens: Int[Array, "S"]  # cached tokens after this step; 0 for padding rows
    cu_q_lens: Int[Array, "S1"]  # S + 1 offsets of each sequence's tokens in the flat batch
    num_seqs: Int[Array, ""]  # number of valid rows


# Page 0 of the pool is never handed out: padding tokens write there and unused
# page-table entries point there, so every gather stays in bounds.
NULL_PAGE = 0
