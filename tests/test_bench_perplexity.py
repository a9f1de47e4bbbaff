"""`bench perplexity`: the sliding-window perplexity of prompt logprobs equals HF's perplexity guide's
loop run on transformers' logits of the same weights, in float64; the flags are checked before any
engine is built."""

from __future__ import annotations

import argparse
import math
import weakref

import pytest

from infire_jax.bench.common import BenchError
from infire_jax.bench.perplexity import DEFAULT_TEXT, negative_log_likelihood, read_text, variant_args, windows

# Five windows, the last one shorter, each over the 64-token step budget (prefilled in two chunks):
# 382 tokens through each side (128, 48, 300 took 620).
WINDOW, STRIDE, TOKENS = 80, 32, 190


_perplexities: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def short_text_perplexity(llm) -> float:
    """The perplexity of 600 tokens of the default text (from its 1000th token), windows of 256 every
    128: the short text on which the lossy options' tests assert the quality issue's bounds (the full
    text's figures are in docs/PERFORMANCE.md). On it, in float32: fp8 cache +1.0%, int8 -0.4%, fp8
    weights +0.4%, int4 +38.5% (groups of 128). Once per engine (the shared float32 one is every
    lossy test's reference: ~10 s a computation)."""
    if llm not in _perplexities:
        text, _ = read_text(None)
        ids = llm.tokenizer.encode(text)[1000:1600]
        nll, count = negative_log_likelihood(llm, ids, 256, 128)
        assert count == len(ids) - 1
        _perplexities[llm] = math.exp(nll / count)
    return _perplexities[llm]


def hf_guide_perplexity(model, ids: list[int], window: int, stride: int) -> tuple[float, int]:
    """HF's perplexity guide's loop (labels of the positions before the window's last trg_len masked,
    then shifted), its log-softmax and sums in float64."""
    import torch

    nll, count, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + window, len(ids))
        trg_len = end - prev_end
        input_ids = torch.tensor([ids[begin:end]])
        labels = input_ids.clone()
        labels[:, :-trg_len] = -100
        with torch.no_grad():
            logits = model(input_ids).logits[0].double()
        lp = torch.log_softmax(logits[:-1], dim=-1)
        shifted = labels[0, 1:]
        scored = shifted != -100
        nll -= lp[scored].gather(-1, shifted[scored][:, None]).sum().item()
        count += int(scored.sum())
        prev_end = end
        if end == len(ids):
            break
    return nll, count


def test_perplexity_matches_hf_guide_in_float64(smol_llm, hf_smol):
    text, _ = read_text(None)
    ids = smol_llm.tokenizer.encode(text)[:TOKENS]
    assert len(windows(len(ids), WINDOW, STRIDE)) == 5
    nll, count = negative_log_likelihood(smol_llm, ids, WINDOW, STRIDE)
    ref_nll, ref_count = hf_guide_perplexity(hf_smol, ids, WINDOW, STRIDE)
    assert count == ref_count == TOKENS - 1  # every token after the first, once
    assert abs(math.exp(nll / count) / math.exp(ref_nll / ref_count) - 1) < 1e-4, (nll, ref_nll)


def _flags(**overrides) -> argparse.Namespace:
    from infire_jax.bench.__main__ import build_parser

    return build_parser().parse_args(["perplexity", *[f"--{k.replace('_', '-')}={v}" for k, v in overrides.items()]])


def test_variants_are_engine_flags_checked_before_any_engine():
    args = _flags(max_num_seqs=4)
    fp8 = variant_args(args, "kv-cache-dtype=fp8")
    assert (fp8.kv_cache_dtype, fp8.max_num_seqs, args.kv_cache_dtype) == ("fp8", 4, "auto")
    assert variant_args(args, "weights-quantization=int8").weights_quantization == "int8"
    for bad, says in [("kv-cache-dtype=fp9", "invalid choice"), ("no-such-flag=1", "not an engine flag"),
                      ("kv=fp8", "not an engine flag"), ("kv-cache-dtype", "NAME=VALUE"),
                      ("model=other.gguf", "keeps the model")]:
        with pytest.raises(BenchError, match=says):
            variant_args(args, bad)
    with pytest.raises(BenchError, match="longer than --window"):
        windows(100, 32, 33)
    with pytest.raises(BenchError, match="no text file /nonexistent"):
        read_text("/nonexistent")
    assert DEFAULT_TEXT == "/usr/share/common-licenses/GPL-3"


def test_vllm_scores_the_same_windows_where_it_has_the_option():
    """vLLM's side of a row: our windows' token ids and first scored positions (so the two NLL sums
    cover the same tokens), with its names for the dtypes; no row for our quantized or compressed
    weights, nor for a cache dtype vLLM cannot pair with the weights."""
    from infire_jax.bench.perplexity import peer_work

    args = _flags(dtype="float32")
    ids = list(range(300))
    work = peer_work(None, args, "float32", ids, WINDOW, STRIDE)
    spans = windows(len(ids), WINDOW, STRIDE)
    assert work["windows"] == [ids[s:e] for s, e, _ in spans] and work["max_model_len"] == WINDOW + 1
    assert [w[f] for w, f in zip(work["windows"], work["first"])] == [ids[f] for _, _, f in spans]
    assert sum(len(w) - f for w, f in zip(work["windows"], work["first"])) == len(ids) - 1
    assert (work["dtype"], work["kv_cache_dtype"]) == ("float32", "auto")
    fp8 = variant_args(args, "kv-cache-dtype=fp8")
    assert peer_work("kv-cache-dtype=fp8", fp8, "float32", ids, WINDOW, STRIDE)["kv_cache_dtype"] == "fp8"
    for variant in ("weights-quantization=int8", "weights-compression=palette", "max-num-seqs=4"):
        assert peer_work(variant, variant_args(args, variant), "float32", ids, WINDOW, STRIDE) is None, variant
    f32_cache = variant_args(_flags(dtype="bfloat16"), "kv-cache-dtype=float32")
    assert peer_work("kv-cache-dtype=float32", f32_cache, "bfloat16", ids, WINDOW, STRIDE) is None
