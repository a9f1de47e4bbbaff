"""The runner's settings: the pool's pages, the token buckets, the sampler variants, speculation and
decode bursts. The step programs are compiled for them (compiled_steps.py), and a step's plan becomes
the host arrays those programs take through them (batch.py)."""

from __future__ import annotations

import dataclasses

from infire_jax.runner.batch import StepBatch, build_batch
from infire_jax.runner.buckets import Buckets, StepShape
from infire_jax.core.kv_groups import KVGroupLayout
from infire_jax.lora.config import LoRAConfig
from infire_jax.sample.prompt_logprobs import BLOCK
from infire_jax.sample.sampler import BRANCHING
from infire_jax.core.scheduler import SchedulerOutput


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    page_size: int
    num_pages: int
    max_model_len: int
    max_num_seqs: int
    buckets: Buckets
    attn_impl: str = "reference"
    # Compiled sampler variants: (BRANCHING,) where conditionals are free (CPU), else the branch-free ones.
    sampler_variants: tuple[str, ...] = (BRANCHING,)
    num_spec: int = 0  # speculative decoding: proposed tokens a row may carry (0: off)
    aux_layers: tuple[int, ...] | None = None  # EAGLE-3: the target states the forward also returns
    decode_steps: int = 1  # most steps of a decode burst (1: no bursts)
    kv_cache_dtype: str | None = None  # the KV pool's dtype (None: the model's); float8_e4m3fn takes scales
    lora: LoRAConfig | None = None  # LoRA adapters' device slots (infire_jax/lora/); None: off
    # A hybrid KV cache's layer groups (kv_groups.py): the pool holds `page_layers` layers a page, and with
    # several groups each step carries their page tables. None: one group of every layer, every page kept.
    kv_groups: KVGroupLayout | None = None
    max_prompt_logprobs: int = 20  # top alternatives a prompt position may ask for (prompt_logprobs.py)
    image_pool: tuple[int, int] | None = None  # (rows, width) of the images' encoder outputs (image_pool.py)
    pooling: bool = False  # embeddings: a pooling program per bucket (step_programs.pool_rows)
    linear_snapshots: int = 0  # linear-attention state snapshots for the prefix cache (core/state_cache.py)

    @property
    def pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)

    def pool_layers(self, num_layers: int) -> int:
        """The pool's leading axis: the layers (`num_layers`), or a hybrid cache's layers per page."""
        return num_layers if self.kv_groups is None else self.kv_groups.page_layers

    @property
    def multi_group(self) -> bool:
        """Whether steps carry several groups' page tables (AttentionMetadata.group_page_tables)."""
        return self.kv_groups is not None and self.kv_groups.num_groups > 1

    @property
    def num_slots(self) -> int:
        return self.max_num_seqs + 1  # the last slot absorbs padding rows

    @property
    def dummy_slot(self) -> int:
        return self.max_num_seqs

    @property
    def prompt_logprobs_block(self) -> int:
        """Prompt positions per launch of the head: BLOCK, or a step's most tokens if fewer."""
        return min(BLOCK, self.buckets.token_buckets[-1])

    @property
    def history_len(self) -> int:
        """Tokens of a slot's sampling history (penalties): every position its pages can hold."""
        return self.pages_per_seq * self.page_size

    def batch(self, work: SchedulerOutput, shape: StepShape, verify: bool = False) -> StepBatch:
        """A step's plan as the fixed-shape host arrays of its bucket (a verifying step's with room
        for the proposals)."""
        return build_batch(work, shape, page_size=self.page_size, pages_per_seq=self.pages_per_seq,
                           dummy_slot=self.dummy_slot, num_spec=self.num_spec if verify else 0,
                           kv_groups=self.kv_groups if self.multi_group else None, lora=self.lora is not None,
                           images=self.image_pool is not None)

    def empty_batch(self, shape: StepShape, verify: bool = False) -> StepBatch:
        """Padding only: what compiling a bucket's programs, or a follower's receive, takes."""
        return self.batch(SchedulerOutput([], []), shape, verify)
