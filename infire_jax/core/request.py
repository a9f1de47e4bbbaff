"""Host-side state of one sequence being generated."""

from __future__ import annotations

import enum
import time

from infire_jax.sample.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (Status.FINISHED_STOPPED, Status.FINISHED_LENGTH, Status.FINISHED_ABORTED)


class Request:
    """One sequence: its tokens, how many of them are in the KV cache, and its pages.

    `num_computed_tokens` counts tokens whose KV is in the pool (including prefix-cache hits).
    Preemption by recompute drops the pages and resets it to 0; the output tokens generated so
    far are then prefilled again together with the prompt.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        eos_token_ids: tuple[int, ...] = (),
        max_tokens: int,
        seed: int,
        priority: int = 0,
        cache_salt: str | None = None,
        prefix_hint_tokens: int = 0,
        session_id: str | None = None,
        arrival_time: float | None = None,
        min_tokens_stop_ids: tuple[int, ...] = (),
        parent_id: str | None = None,
        index: int = 0,
    ):
        self.request_id = request_id
        self.parent_id = parent_id or request_id  # the user's request; it has n sequences
        self.index = index  # which of the n
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.min_tokens_stop_ids = min_tokens_stop_ids  # masked on the device until min_tokens
        self.max_tokens = max_tokens
        self.seed = seed
        self.priority = priority
        self.cache_salt = cache_salt
        self.prefix_hint_tokens = prefix_hint_tokens
        self.session_id = session_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = Status.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prefix-cache hit at first admission, reported in usage
        self.pages: list[int] = []
        # The hybrid KV cache (hybrid_kv_cache.py): each group's page per block (the null page where a
        # bounded group freed it), `pages` being group 0's, and per group the blocks freed before.
        self.group_pages: list[list[int]] = []
        self.group_start: list[int] = []
        self.block_hashes: list[bytes] = []  # hashes of the full blocks of all_token_ids, grown lazily
        self.num_registered_blocks = 0  # full blocks already published to the prefix cache
        self.state_saves: list[int] = []  # positions whose linear state is to be kept (core/state_cache.py)
        self.slot: int | None = None  # row of the device-side per-request state
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        # Tokens sampled but not yet read back from the device (asynchronous scheduling).
        self.num_pending_tokens = 0
        self.detok = None  # the engine's IncrementalDetokenizer for this sequence
        # Speculative decoding (speculative/controller.py): tokens proposed for the next step, and
        # whether the request waits for its last token to be read back before it is scheduled.
        self.spec_drafts: list[int] = []
        self.spec_wait = False
        self.spec_state = None
        self.spec_head_drafts: list[int] = []  # EAGLE-3: what the head drafted in the request's last step
        self.grammar = None  # its structured.GrammarMatcher when the output is constrained
        self.allowed_mask = None  # allowed_token_ids and one-token bad_words as the sampler's bitmask row ([W] int32)
        self.bad_sequences: list = []  # longer bad_words (sample/bad_words.py): banned after their prefix
        self.lora = None  # its LoRA adapter (lora/adapters.py); None: the base model
        self.lora_slot = 0  # the adapter's device slot while the request runs (0: none)
        # Images (runner/image_pool.py): each prompt token's row of the device's image pool, -1 for text;
        # None without images.
        self.image_rows = None
        # Prompt logprobs (params.prompt_logprobs): the entries read back so far (the first position's
        # None first), and the first prompt position no dispatched step has computed logits for yet;
        # a prompt computed again after a preemption skips the positions before it.
        self.prompt_logprobs: list | None = [None] if params.prompt_logprobs is not None else None
        self.prompt_logprobs_next = 0
        # Embeddings (infire_jax/pooling/): the request's PoolingParams (None: it generates), its pooling
        # type (pooling/config.py), its pooled states summed so far, and the first prompt position no
        # dispatched step has pooled yet.
        self.pooling = None
        self.pooling_type: str | None = None
        self.pooled = None
        self.pool_next = 0

    @property
    def masked_by_output(self) -> bool:
        """Whether its next step's token mask depends on the tokens sampled so far (a grammar, a longer
        bad word): the engine reads each step back before planning the next, and it never bursts."""
        return self.grammar is not None or bool(self.bad_sequences)

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None

    @property
    def first_unscored(self) -> int | None:
        """The first prompt position this request must still compute itself (its prompt logprobs, or
        an embedding that pools every position), or None when a prefix-cache hit may skip any."""
        firsts = ([self.prompt_logprobs_next] if self.wants_prompt_logprobs else []) + \
            ([self.pool_next] if self.pooling_type in ("MEAN", "CLS") else [])
        return min(firsts) if firsts else None

    @property
    def prefill_only(self) -> bool:
        """max_tokens 0: the prompt runs (for its prompt logprobs) and nothing is sampled."""
        return self.max_tokens == 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        """Tokens known to exist, including ones the device has sampled but not yet reported."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    def token_at(self, pos: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[pos] if pos < n else self.output_token_ids[pos - n]

    def token_slice(self, start: int, count: int) -> list[int]:
        """Known tokens [start, start + count) without building the whole token list."""
        n = len(self.prompt_token_ids)
        if start + count <= n:
            return self.prompt_token_ids[start:start + count]
        if start >= n:
            return self.output_token_ids[start - n:start - n + count]
        return self.prompt_token_ids[start:] + self.output_token_ids[:start + count - n]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def sort_key(self) -> tuple:
        """Scheduling order: lower priority value first, then first come first served."""
        return (self.priority, self.arrival_time)
