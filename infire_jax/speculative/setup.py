"""An engine's speculation, set up: the checks, the proposer, its pool and its programs."""

from __future__ import annotations

from infire_jax.errors import ConfigError
from infire_jax.core.kv_cache import KVCacheManager
from infire_jax.core.kv_groups import KVGroupLayout
from infire_jax.models.config import ModelConfig
from infire_jax.core.request import Request
from infire_jax.runner.model_runner import ModelRunner
from infire_jax.speculative.config import SpeculativeConfig
from infire_jax.speculative.controller import NgramProposer, SpecController
from infire_jax.speculative.draft_model import DraftModel, check_vocabulary
from infire_jax.speculative.eagle3_loader import load_eagle3
from infire_jax.speculative.head_proposer import DraftHead, HeadProposer
from infire_jax.speculative.mtp_loader import load_mtp
from sharding.plan import ShardPlan

# Speculation stops when more sequences than this run (SpeculativeConfig.disable_by_batch_size):
# past it decode is compute-bound on this device, and checking proposals costs more than it saves.
MAX_BATCH_CPU = 4
MAX_BATCH_GPU = 32


def parse_speculation(value, target: ModelConfig, *, dtype, multiprocess: bool, model: str | None = None,
                      plan: ShardPlan | None = None, compressed: bool = False,
                      kv_groups: KVGroupLayout | None = None) -> tuple[SpeculativeConfig | None, DraftHead | None]:
    """The engine's `speculative_config`, checked; a draft head (EAGLE-3's, or MTP's from the target's
    checkpoint `model`) is loaded now: the target's forward must be compiled to return the states
    EAGLE-3 reads, and the pool is sized with the head's weights on the device. On a mesh (`plan`) a head
    is replicated on every device, its one-layer pool too (but MTP's decoder layer and pool, split as the
    target's: mtp_loader.py `build_mtp_head`), and runs beside the target's program (head_proposer.py), on
    the states the target's tp / ep shard_map returns whole (not across pipeline stages, whose layers'
    states live on different devices). A draft model runs on one device. `compressed`: palette-compressed
    weights, which only n-grams serve (weights kept quantized serve every method: a draft model has its own
    weights, an EAGLE-3 head and MTP read the target's hidden states, whatever form its layer weights are
    kept in);
    `kv_groups`: the target's hybrid KV cache (None: one group, every page kept)."""
    sc = SpeculativeConfig.parse(value)
    if sc is None:
        return None, None
    if multiprocess:
        raise ConfigError("speculative decoding runs in one process; drop speculative_config for multi-host")
    if sc.method != "ngram" and compressed:
        raise ConfigError(f"speculative_config.method {sc.method!r} runs with uncompressed weights (n-grams serve "
                          "palette-compressed ones)")
    if sc.method == "draft_model" and plan is not None:
        raise ConfigError("speculative_config.method 'draft_model' runs on one device; on a mesh use eagle3, mtp "
                          "or ngram")
    if sc.method in ("eagle3", "mtp") and plan is not None and plan.num_stages > 1:
        raise ConfigError(f"speculative_config.method {sc.method!r} reads the target's states on one device or a "
                          f"mesh without pipeline stages (tp, ep); this mesh has pp={plan.num_stages}")
    if sc.method != "ngram" and kv_groups is not None and kv_groups.groups[0].bounded:
        raise ConfigError(f"speculative_config.method {sc.method!r} keeps its KV on the pages of the target's global "
                          "layers (a group that keeps every page); every layer of this model is chunked or "
                          "sliding-window, so no group keeps them: set hybrid_kv_cache=False, or use ngram")
    if sc.method == "draft_model":
        check_vocabulary(sc.model, target)
    if sc.method == "eagle3":
        return sc, load_eagle3(sc.model, target, dtype=dtype, sharding=None if plan is None else plan.replicated)
    if sc.method == "mtp":
        if sc.model is not None and sc.model != model:
            raise ConfigError(f"speculative_config.model: method 'mtp' reads the target's own checkpoint "
                              f"({model!r}); drop model (got {sc.model!r})")
        return sc, load_mtp(model, target, dtype=dtype, plan=plan)
    return sc, None


def extra_page_bytes(sc: SpeculativeConfig | None, head: DraftHead | None, page_size: int, dtype,
                     plan: ShardPlan | None = None) -> int:
    """What a draft model's or draft head's pool adds to each page of the target's, on each device of `plan`."""
    if sc is not None and sc.method == "draft_model":
        return DraftModel.page_bytes(sc.model, page_size, dtype)
    if head is not None:
        return HeadProposer.page_bytes(head, page_size, dtype, plan)
    return 0


def build_speculation(sc: SpeculativeConfig, head: DraftHead | None, target: ModelConfig, runner: ModelRunner,
                      kv: KVCacheManager, *, max_num_seqs: int, dtype,
                      on_gpu: bool) -> tuple[SpecController, DraftModel | HeadProposer | None]:
    """The speculation policy and its proposer. A draft model or draft head gets a pool beside the
    target's, is compiled here, and watches every step of the runner from now on."""
    max_batch = sc.disable_by_batch_size or (MAX_BATCH_GPU if on_gpu else MAX_BATCH_CPU)
    if sc.method == "ngram":
        return SpecController(sc, max_batch, NgramProposer(sc)), None

    def reserve(req: Request, num_tokens: int) -> bool:
        """Pages for a request's next tokens, if the pool has them free (never by preempting)."""
        return kv.can_allocate(req, num_tokens) and kv.allocate(req, num_tokens)

    if head is not None:
        draft = HeadProposer(head, target, runner, runner.rc, dtype=dtype, k=sc.num_speculative_tokens)
    else:
        draft = DraftModel(sc.model, runner.rc, dtype=dtype, k=sc.num_speculative_tokens,
                           max_rows=min(max_batch, max_num_seqs), reserve=reserve)
    draft.warmup(runner.empty_batches())
    runner.observer = draft.observe
    return SpecController(sc, max_batch, draft), draft
