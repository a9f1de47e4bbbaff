"""Qwen3.5 (models/qwen3_5.py, models/gated_delta.py) against HF transformers' Qwen3_5ForCausalLM, through
the real engine, and the Gated DeltaNet over packed rows against a float64 computation.

A tiny random checkpoint (8 layers: two groups of three Gated DeltaNets and a gated attention layer;
GQA in both kinds, k and v head dims apart, a partial rotation; random norm weights, so Qwen's 1 + w
counts, and random decays) is loaded by our HF loader and decoded greedily with chunked prefill, decode
bursts and a pool small enough that requests are preempted and computed again: tokens must equal HF's
`generate`, logprobs agree within 1e-3 (float32). Then: the multimodal checkpoint's names, the published
27b config against transformers' model, and what is refused.
"""

from __future__ import annotations

import contextlib
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from deepseek_models import VOCAB, _save_tokenizer, hf_greedy

from infire_jax.errors import ConfigError, UnsupportedModelError
from infire_jax.models.hf_config import config_from_hf

TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=24, linear_conv_kernel_dim=4, max_position_embeddings=2048,
            bos_token_id=256, eos_token_id=257, pad_token_id=0,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25})
NUM_TOKENS = 24
TINY_INTERVAL = 4  # a group: three Gated DeltaNets, then an attention layer
PROMPTS = [[5, 77, 200, 13, 42], list(range(60, 100)), [258, 3, 3, 190, 64, 99, 120, 7, 250, 11, 31, 17, 90, 200]]
# 22 pages of 4 tokens hold the longest sequence (64 tokens) and little more: the three preempt each other.
ENGINE = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(4, 32), max_model_len=64,
              page_size=4, num_kv_pages=22)


def hf_model():
    return hf_model_with()


def hf_model_with(**changes):
    """The tiny random Qwen3.5, its config changed by `changes`."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**{**TINY, **changes})).to(torch.float32).eval()
    with torch.no_grad():  # HF starts the norms at 0 (1 + w = 1): random ones count
        for name, p in model.named_parameters():
            if "norm" in name or "dt_bias" in name:
                p.copy_(torch.randn_like(p) * 0.5)
            if "A_log" in name:  # slow decays: a state lasts the whole sequence (a stale one would show)
                p.copy_(torch.empty_like(p).uniform_(-7.0, -3.0))
        model.get_input_embeddings().weight.mul_(4.0)  # a sharper head: no near-ties between engines
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = hf_model()
    path = tmp_path_factory.mktemp("qwen3_5")
    hf.save_pretrained(path, safe_serialization=True)
    _save_tokenizer(path)
    return hf, path


def _assert_as_hf(want: list, outs: list) -> None:
    """Each output's greedy tokens are HF's, and their logprobs within 1e-3 of HF's (float64)."""
    for (tokens, logprobs), out in zip(want, outs):
        got = out.outputs[0]
        assert got.token_ids == tokens
        np.testing.assert_allclose([lp[t].logprob for lp, t in zip(got.logprobs, tokens)], logprobs, atol=1e-3, rtol=0)


@pytest.mark.parametrize("attn_impl", ["reference", "pallas_interpret"])
def test_generate_matches_hf(checkpoint, attn_impl):
    """Through the CPU path and the GPU's Pallas kernels (in interpret mode), preempted and recomputed."""
    from infire_jax import LLM, SamplingParams

    hf, path = checkpoint
    want = [hf_greedy(hf, prompt, NUM_TOKENS) for prompt in PROMPTS]
    llm = LLM(model=str(path), attn_impl=attn_impl, **ENGINE)
    try:
        engine = llm.engine
        assert engine.model_config.architecture == "qwen3_5" and engine.model_config.num_kv_layers == 2
        assert engine.kv.enable_prefix_caching and engine.states.num_snapshots == 4  # min(16, max_num_seqs)
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True,
                                                    logprobs=1))
        assert engine.scheduler.num_preemptions > 0
        assert engine.kv.num_free_pages == engine.kv.num_pages - 1  # every page back (the null page aside)
        with pytest.raises(ConfigError, match="linear-attention layers keep their state outside"):
            engine.export_prompt_kv(PROMPTS[0])
    finally:
        llm.engine.close()
    _assert_as_hf(want, outs)


def test_prefix_cache_resumes_from_kept_states(checkpoint):
    """Prompts sharing a 42-token prefix, one after another and two at once, with 2 snapshots of the linear
    state: a hit resumes from the deepest block whose state is kept (none at first: the first branch point
    is saved), identical prompts in one step cannot use a state that step has yet to write, evicted states
    cut a hit back. Every output is HF's (tokens, logprobs within 1e-3)."""
    from infire_jax import LLM, SamplingParams
    from infire_jax.engine.setup import EngineConfig, linear_state_snapshots

    hf, path = checkpoint
    shared = [(7 * i + 3) % 250 for i in range(42)]  # 10 blocks of 4, and 2 tokens of the 11th
    a, b, c, d = ([shared + tail] for tail in ([5, 6, 7], [9, 10, 11, 12], [20, 21], [30, 31, 32, 33, 34]))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)
    llm = LLM(model=str(path), attn_impl="reference", **{**ENGINE, "num_kv_pages": 96}, linear_state_snapshots=2)
    try:
        outs = [llm.generate(p, params)[0] for p in (a, b, c)] + llm.generate(d * 2, params) \
            + [llm.generate(p, params)[0] for p in (d, b)]
        states = llm.engine.states
    finally:
        llm.engine.close()
    # a saves its end (44); b: a's KV up to block 10, but no state there (saves 40, its branch, and its
    # end, evicting a's); c: from b's branch state (its end is that block: nothing saved); the two d's: from
    # it too (d's end is saved by the first, in their step, evicting b's end); d again: from its end; b
    # again: from the branch, saving its end once more.
    assert [o.num_cached_tokens for o in outs] == [0, 0, 40, 40, 40, 44, 40]
    assert states.saves == 5 and len(states.by_hash) == 2
    for prompt, out in zip(a + b + c + d * 2 + d + b, outs):
        want, logprobs = hf_greedy(hf, prompt, 6)
        assert out.outputs[0].token_ids == want
        np.testing.assert_allclose([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, want)], logprobs, atol=1e-3)
    cfg = config_from_hf(dict(TINY, model_type="qwen3_5_text"))
    assert linear_state_snapshots(EngineConfig(max_num_seqs=64), cfg) == 16
    assert linear_state_snapshots(EngineConfig(enable_prefix_caching=False), cfg) == 0


_WARM = """
import json, sys
from infire_jax import LLM, SamplingParams
llm = LLM(model=sys.argv[1], attn_impl="reference", **json.loads(sys.argv[2]))
outs = llm.generate(json.loads(sys.argv[3]), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs], "loaded": llm.engine.boot.executables_loaded}))
"""


def test_a_new_process_serves_from_the_executable_cache(checkpoint):
    """A warm start: a new process loads the step programs this one stored (runner/executable_cache.py) and
    generates HF's tokens. The chunked delta rule's triangular solve was once a LAPACK call, whose
    functions jaxlib binds only while tracing such a program: a warm start crashed in it."""
    import subprocess
    import sys

    from infire_jax import LLM, SamplingParams

    hf, path = checkpoint
    llm = LLM(model=str(path), attn_impl="reference", **ENGINE)  # stores its programs, unless an earlier test did
    try:
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=1))
    finally:
        llm.engine.close()
    proc = subprocess.run([sys.executable, "-c", _WARM, str(path), json.dumps(ENGINE), json.dumps(PROMPTS[:2])],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["loaded"] > 0
    assert got["tokens"] == [hf_greedy(hf, prompt, 8)[0] for prompt in PROMPTS[:2]]


def test_multimodal_checkpoint_loads_its_language_model(checkpoint, tmp_path):
    """A `qwen3_5` config (text_config inside) with the published tensor names (`model.language_model.*`):
    its vision tower and multi-token-prediction layer skipped, the text model's weights exactly."""
    from safetensors.numpy import load_file, save_file

    from infire_jax.loaders.hf import load_hf_dir

    _, path = checkpoint
    tensors = load_file(str(path / "model.safetensors"))
    renamed = {k.replace("model.", "model.language_model.", 1): v for k, v in tensors.items()}
    renamed["model.visual.blocks.0.attn.qkv.weight"] = np.ones((4, 4), np.float32)
    renamed["mtp.layers.0.mlp.up_proj.weight"] = np.ones((4, 4), np.float32)
    (tmp_path / "mm").mkdir()
    save_file(renamed, str(tmp_path / "mm" / "model.safetensors"))
    _save_tokenizer(tmp_path / "mm")
    text = {k: v for k, v in TINY.items() if k != "eos_token_id"}
    with open(tmp_path / "mm" / "config.json", "w") as f:
        json.dump({"model_type": "qwen3_5", "text_config": text, "vision_config": {"depth": 1},
                   "eos_token_id": TINY["eos_token_id"], "image_token_id": 300, "tie_word_embeddings": False}, f)
    mm, plain = load_hf_dir(str(tmp_path / "mm")), load_hf_dir(str(path))
    assert mm.config == plain.config and mm.config.eos_token_ids == (TINY["eos_token_id"],)
    assert sorted(mm.weights) == sorted(plain.weights)
    for name, w in plain.weights.items():
        np.testing.assert_array_equal(mm.weights[name], w)


def test_fp8_checkpoint_is_dequantized_as_read(checkpoint, tmp_path):
    """A published-style fp8 checkpoint (every projection in e4m3 with 16 x 16 block scales, as Qwen ships
    Qwen3.5-*-FP8): the engine, which dequantizes it as read, gives HF's tokens on the weights the fp8
    blocks define."""
    import shutil

    from deepseek_models import quantize_checkpoint

    from infire_jax import LLM, SamplingParams

    hf, path = checkpoint
    shutil.copytree(path, tmp_path / "fp8")
    defined = quantize_checkpoint(str(tmp_path / "fp8"), "fp8", 16,
                                  lambda name, w: w.ndim == 2 and "_proj" in name and "lm_head" not in name)
    assert any("linear_attn.in_proj_qkv" in name for name in defined) and any("self_attn.q_proj" in name
                                                                             for name in defined)
    ref = hf_model()
    with torch.no_grad():
        params = dict(ref.named_parameters())
        for name, w in defined.items():
            params[name].copy_(torch.from_numpy(w).to(torch.float32))
    want = [hf_greedy(ref, prompt, NUM_TOKENS) for prompt in PROMPTS[:2]]
    llm = LLM(model=str(tmp_path / "fp8"), attn_impl="reference", **ENGINE)
    try:
        outs = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True,
                                                        logprobs=1))
    finally:
        llm.engine.close()
    _assert_as_hf(want, outs)

    from safetensors.torch import load_file, save_file  # a float8 tensor with no scales to dequantize it by

    tensors = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    tensors["model.layers.0.linear_attn.A_log"] = tensors["model.layers.0.linear_attn.A_log"].to(torch.float8_e4m3fn)
    save_file(tensors, str(tmp_path / "fp8" / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match="A_log.* is float8 without the block scales"):
        LLM(model=str(tmp_path / "fp8"), attn_impl="reference", **ENGINE)


def test_ngram_speculation_keeps_only_the_accepted_tokens_in_the_linear_state(checkpoint):
    """n-gram proposals (one device): a verifying step computes every proposal from the rows' linear state, leaves
    that state as it found it, and once the verifier has decided advances it over the tokens it kept
    (step_programs.commit_linear_state). Greedy, preempted and recomputed, the tokens are HF's, with proposals
    both accepted and rejected; a rejected one kept in the state would change the tokens after it."""
    from infire_jax import LLM, SamplingParams

    hf, path = checkpoint
    prompts = [[5, 77, 200, 13, 42] * 4, PROMPTS[1], [258, 3, 3, 190, 64] * 3 + [99]]
    want = [hf_greedy(hf, prompt, NUM_TOKENS) for prompt in prompts]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "acceptance_threshold": 0.0}
    llm = LLM(model=str(path), attn_impl="reference", speculative_config=spec, **ENGINE)
    try:
        engine = llm.engine
        outs = llm.generate(prompts, SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True,
                                                    logprobs=1))
        stats = engine.spec.stats
        print(f"\nproposed {stats.num_draft_tokens}, accepted {stats.num_accepted_tokens}, "
              f"preemptions {engine.scheduler.num_preemptions}")
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
        assert engine.scheduler.num_preemptions > 0
        assert engine.kv.num_free_pages == engine.kv.num_pages - 1
    finally:
        llm.engine.close()
    _assert_as_hf(want, outs)


@pytest.fixture(scope="module")
def mtp_checkpoint(checkpoint, tmp_path_factory):
    """(HF's model, the reference MTP module, the tiny checkpoint with it as Qwen3.5 ships it: `mtp.*`)."""
    import copy
    import shutil

    from mtp_reference import ReferenceQwenMTP
    from safetensors.torch import save_file

    hf, path = checkpoint
    ref = ReferenceQwenMTP(copy.deepcopy(hf.config), hf.model.embed_tokens.weight.detach(),
                           hf.lm_head.weight.detach(), seed=1)
    out = tmp_path_factory.mktemp("qwen3_5_mtp")
    shutil.copytree(path, out, dirs_exist_ok=True)
    save_file(ref.tensors(), str(out / "mtp.safetensors"), metadata={"format": "pt"})
    return hf, ref, str(out)


def test_mtp_drafts_as_the_reference_and_decodes_as_hf(mtp_checkpoint):
    """The MTP layer (fc over both normed inputs, a gated attention layer with its MLP, its norm) against a float64
    composition of transformers' layer (tests/mtp_reference.py): two rows' prefills, then k = 2 drafts each,
    through paged steps. Then through the engine (`{"method": "mtp"}`), preempted and recomputed: HF's greedy
    tokens, and each proposal's first draft the reference's on HF's own last hidden states after its final norm
    (what the target's head reads)."""
    from mtp_reference import normed_last_states
    from test_eagle3 import record_proposals
    from test_mtp import assert_paged_drafts_are_the_references

    from infire_jax import LLM, SamplingParams

    hf, ref, path = mtp_checkpoint
    assert_paged_drafts_are_the_references(hf, ref, path, vocab=VOCAB, kv_heads=2, head_dim=32)

    want = [hf_greedy(hf, prompt, NUM_TOKENS) for prompt in PROMPTS]
    spec = {"method": "qwen3_next_mtp", "num_speculative_tokens": 2, "acceptance_threshold": 0.0}
    llm = LLM(model=path, attn_impl="reference", speculative_config=spec, **ENGINE)
    try:
        engine = llm.engine
        assert engine.spec_config.method == "mtp"
        records = record_proposals(engine)
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True,
                                                    logprobs=1))
        assert engine.spec.stats.num_draft_tokens > 0 and engine.scheduler.num_preemptions > 0
        assert engine.kv.num_free_pages == engine.kv.num_pages - 1
    finally:
        llm.engine.close()
    _assert_as_hf(want, outs)

    finals = [p + tokens for p, (tokens, _) in zip(PROMPTS, want)]
    normed = {tuple(final): normed_last_states(hf, final) for final in finals}
    checked = 0
    for tokens, drafts in records:
        if not drafts:
            continue
        final = next(f for f in finals if f[:len(tokens)] == tokens)
        n = len(tokens)
        wanted, logits = ref.greedy_chain(np.asarray(final[1:n]), normed[tuple(final)][:n - 1], 1)
        assert drafts[0] == wanted[0] or logits[0].max() - logits[0][drafts[0]] < 1e-4, (n, drafts, wanted)
        checked += 1
    assert checked >= 10


def test_moe_mtp_layer_drafts_as_the_reference(tmp_path):
    """Qwen3.5-MoE's MTP layer (routed experts fused as transformers 5 saves them, the shared expert and its gate)
    through paged steps, against the reference composed of transformers' `Qwen3_5MoeDecoderLayer`."""
    import copy

    from mtp_reference import ReferenceQwenMTP
    from safetensors.torch import save_file
    from test_mtp import assert_paged_drafts_are_the_references

    hf = hf_moe_model("qwen3_5_moe")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _save_tokenizer(tmp_path)
    ref = ReferenceQwenMTP(copy.deepcopy(hf.config), hf.model.embed_tokens.weight.detach(),
                           hf.lm_head.weight.detach(), seed=2)
    assert any(name.startswith("mtp.layers.0.mlp.experts.") for name in ref.tensors())
    save_file(ref.tensors(), str(tmp_path / "mtp.safetensors"), metadata={"format": "pt"})
    assert_paged_drafts_are_the_references(hf, ref, str(tmp_path), vocab=VOCAB, kv_heads=2, head_dim=32)


def _hf_kv_scales(hf, token_ids: list[int]) -> np.ndarray:
    """The calibration's scales from HF's own keys and values (its cache after one forward of `token_ids`):
    each attention layer's largest magnitude per kv head, times the margin, over e4m3's largest value."""
    from infire_jax.runner.kv_scales import MARGIN
    from pallas_kernels.kv_quant import FP8_MAX

    with torch.no_grad():
        cache = hf(torch.tensor([token_ids]), use_cache=True).past_key_values
    layers = [layer for layer in cache.layers if getattr(layer, "keys", None) is not None]
    amax = [[t[0].abs().amax(dim=(1, 2)).double().numpy() for t in (layer.keys, layer.values)] for layer in layers]
    return np.array(amax) * MARGIN / FP8_MAX


def test_fp8_kv_cache_calibrated_or_from_the_checkpoint(checkpoint, tmp_path, monkeypatch):
    """`kv_cache_dtype="fp8"`: the pool holds the attention layers' keys and values in e4m3, a scale per
    (attention layer, kv head). Calibrated, the scales are what HF's own keys and values give on the
    calibration text; preempted and recomputed, the engine gives the tokens and logprobs of HF attending to
    its keys and values rounded to e4m3 with those scales (and HF's plain tokens). A checkpoint's
    `k_scale` / `v_scale` on its attention layers (layer 3 and 7 of 8, either naming) are read instead, the
    weight loader passing them by; one on a linear-attention layer is refused by name."""
    import shutil

    from quant_reference import attend_to_e4m3
    from safetensors.numpy import save_file
    from transformers.models.qwen3_5 import modeling_qwen3_5

    from infire_jax import LLM, SamplingParams
    from infire_jax.runner.kv_scales import CALIBRATION_TEXT

    hf, path = checkpoint
    want = [hf_greedy(hf, prompt, NUM_TOKENS) for prompt in PROMPTS]
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
    llm = LLM(model=str(path), attn_impl="reference", kv_cache_dtype="fp8", **ENGINE)
    try:
        engine = llm.engine
        assert engine.runner.cache.k_pages.dtype == np.uint8 and engine.runner.cache.k_pages.shape[0] == 2
        calibrated = engine.runner.kv_scales
        np.testing.assert_allclose(calibrated, _hf_kv_scales(hf, engine.loaded.tokenizer.encode(CALIBRATION_TEXT)),
                                   rtol=1e-4)
        outs = llm.generate(PROMPTS, params)
        assert engine.scheduler.num_preemptions > 0
        assert engine.kv.num_free_pages == engine.kv.num_pages - 1
    finally:
        llm.engine.close()
    rounded = hf_model()
    attend_to_e4m3(modeling_qwen3_5, rounded.config, calibrated, monkeypatch, lambda layer: layer // TINY_INTERVAL)
    want_rounded = [hf_greedy(rounded, prompt, NUM_TOKENS) for prompt in PROMPTS]
    for (tokens, logprobs), (plain_tokens, plain), out in zip(want_rounded, want, outs):
        got = out.outputs[0]
        assert got.token_ids == tokens == plain_tokens
        logprobs_got = [lp[t].logprob for lp, t in zip(got.logprobs, tokens)]
        # Measured: within 4e-7 of HF on rounded keys and values, 1.4e-3 to 2.4e-3 off HF's plain ones.
        np.testing.assert_allclose(logprobs_got, logprobs, atol=1e-5, rtol=0)
        assert np.abs(np.subtract(logprobs_got, plain)).max() > 5e-4

    shutil.copytree(path, tmp_path / "scaled")
    given = (2 * calibrated).astype(np.float32)  # a power of two: the same e4m3 mantissas as calibrated
    # Layer 7's as a multimodal checkpoint names its language model's, its v_scale a scalar (every kv head's).
    scales = {f"model.{'language_model.' * (layer == 7)}layers.{layer}.self_attn.{kv}_scale": given[i, j]
              for i, layer in enumerate((3, 7)) for j, kv in enumerate("kv")}
    scales["model.language_model.layers.7.self_attn.v_scale"] = np.array(given[1, 1].max())
    save_file(scales, str(tmp_path / "scaled" / "kv_scales.safetensors"))
    llm = LLM(model=str(tmp_path / "scaled"), attn_impl="reference", kv_cache_dtype="fp8", **ENGINE)
    try:
        given[1, 1] = given[1, 1].max()
        np.testing.assert_array_equal(llm.engine.runner.kv_scales, given)
        out = llm.generate(PROMPTS[:1], params)[0].outputs[0]
    finally:
        llm.engine.close()
    assert out.token_ids == want[0][0]

    save_file({**scales, "model.layers.2.self_attn.k_scale": np.array(0.1, np.float32)},
              str(tmp_path / "scaled" / "kv_scales.safetensors"))
    with pytest.raises(ConfigError, match="model.layers.2.self_attn.k_scale: layer 2 keeps no keys and values"):
        LLM(model=str(tmp_path / "scaled"), kv_cache_dtype="fp8", **ENGINE)


def _reference(x, w, conv0, q, k, v, g, beta, rec0):
    """One row's tokens through the convolution and the delta rule in float64, as transformers computes
    them (causal_conv1d_update and torch_recurrent_gated_delta_rule), from its saved state."""
    hist = np.concatenate([conv0, x])
    kernel = w.shape[0]
    mixed = np.stack([(hist[t:t + kernel] * w).sum(0) for t in range(len(x))])
    mixed = mixed / (1 + np.exp(-mixed))
    group = v.shape[1] // q.shape[1]

    def l2(a):
        return a / np.sqrt((a * a).sum(-1, keepdims=True) + 1e-6)

    q, k = np.repeat(l2(q), group, 1) / np.sqrt(q.shape[-1]), np.repeat(l2(k), group, 1)
    state, out = rec0.copy(), []
    for t in range(len(x)):
        state = state * np.exp(g[t])[:, None, None]
        delta = (v[t] - np.einsum("hkv,hk->hv", state, k[t])) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out.append(np.einsum("hkv,hk->hv", state, q[t]))
    return mixed, np.stack(out), hist[-(kernel - 1):], state


@pytest.mark.parametrize("decode_only, chunk", [(False, 64), (False, 4), (True, 64)])
def test_gated_delta_over_packed_rows_matches_float64(decode_only, chunk, monkeypatch):
    """Rows of several tokens, one token, none, continuing saved states, padding tokens and a row whose
    token updates no slot (a burst's stopped row), in one chunk or across chunks of 4 (rows starting and
    ending inside them): each row's outputs and saved states against the float64 per-row computation;
    slots no token updates keep their state."""
    from infire_jax.models import gated_delta
    from infire_jax.models.gated_delta import causal_conv, gated_delta_rule, step_rows

    monkeypatch.setattr(gated_delta, "CHUNK", chunk)
    from pallas_kernels.attention import decode_only_steps
    from pallas_kernels.metadata import AttentionMetadata

    rng = np.random.default_rng(0)
    hk, hv, dk, dv, kernel, slots = 2, 4, 8, 6, 4, 6
    channels = 2 * hk * dk + hv * dv
    lens, row_slots = ([1, 1, 1, 0], [3, 0, 2, 5]) if decode_only else ([5, 1, 3, 0], [3, 0, 2, 5])
    live = [True, True, not decode_only, False]  # decode: row 2's token is a stopped row's
    total = sum(lens) + 3  # and padding tokens
    conv = rng.normal(size=(slots, kernel - 1, channels))
    rec = rng.normal(size=(slots, hv, dk, dv))
    x = rng.normal(size=(total, channels))
    q, k = rng.normal(size=(total, hk, dk)), rng.normal(size=(total, hk, dk))
    g, beta = -rng.uniform(0.1, 2.0, (total, hv)), rng.uniform(0, 1, (total, hv))
    w = rng.normal(size=(kernel, channels))
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    seq_ids = np.full(total, len(lens), np.int32)
    token_slots = np.full(total, slots - 1, np.int32)
    for r, n in enumerate(lens):
        seq_ids[cu[r]:cu[r + 1]] = r
        if live[r]:
            token_slots[cu[r]:cu[r + 1]] = row_slots[r]
    meta = AttentionMetadata(positions=np.zeros(total, np.int32), slot_mapping=np.zeros(total, np.int32),
                             seq_ids=seq_ids, page_table=np.zeros((len(lens), 1), np.int32),
                             kv_lens=np.zeros(len(lens), np.int32), cu_q_lens=cu, num_seqs=np.int32(len(lens)))
    v = rng.normal(size=(total, hv, dv))
    f32 = jnp.float32
    rows = step_rows(meta, jnp.asarray(token_slots), slots - 1)
    layer = 1  # of two: the other layer's state stays as it was
    conv2, rec2 = (jnp.asarray(np.stack([a[::-1], a]), f32) for a in (conv, rec))
    mixed, new_conv = causal_conv(jnp.asarray(x, f32), jnp.asarray(w, f32), conv2, jnp.int32(layer), rows,
                                  jnp.asarray(token_slots))
    with decode_only_steps() if decode_only else contextlib.nullcontext():
        out, new_rec = gated_delta_rule(*(jnp.asarray(a, f32) for a in (q, k, v, g, beta)), rec2, jnp.int32(layer),
                                        rows, jnp.asarray(token_slots))
    np.testing.assert_array_equal(new_conv[0], conv2[0])
    np.testing.assert_array_equal(new_rec[0], rec2[0])
    new_conv, new_rec = new_conv[layer], new_rec[layer]
    for r, n in enumerate(lens):
        if not n or not live[r]:
            continue
        s, span = row_slots[r], slice(cu[r], cu[r + 1])
        want_mixed, want_out, want_conv, want_rec = _reference(x[span], w, conv[s], q[span], k[span], v[span],
                                                               g[span], beta[span], rec[s])
        np.testing.assert_allclose(np.asarray(mixed)[span], want_mixed, atol=2e-5, rtol=1e-4)
        np.testing.assert_allclose(np.asarray(out)[span], want_out, atol=2e-4, rtol=1e-4)
        np.testing.assert_allclose(np.asarray(new_conv)[s], want_conv, atol=1e-6)
        np.testing.assert_allclose(np.asarray(new_rec)[s], want_rec, atol=2e-4, rtol=1e-4)
    written = [row_slots[r] for r in range(len(lens)) if lens[r] and live[r]]
    untouched = [s for s in range(slots - 1) if s not in written]
    np.testing.assert_array_equal(np.asarray(new_rec)[untouched], rec[untouched].astype(np.float32))
    np.testing.assert_array_equal(np.asarray(new_conv)[untouched], conv[untouched].astype(np.float32))


MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)


def hf_moe_model(kind: str):
    """A tiny Qwen3.5-MoE, or Qwen3-Next (the same layers; q/k/v/z and b/a fused per k head, experts saved
    one by one)."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3NextConfig, Qwen3NextForCausalLM

    model_cls, config_cls = ((Qwen3NextForCausalLM, Qwen3NextConfig) if kind == "qwen3_next"
                             else (Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig))
    torch.manual_seed(1)
    model = model_cls(config_cls(**TINY, **MOE)).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "dt_bias" in name or name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn_like(p) * 0.5)  # and a router that prefers experts
            if "A_log" in name:
                p.copy_(torch.empty_like(p).uniform_(-7.0, -3.0))
        model.get_input_embeddings().weight.mul_(4.0)
    return model


@pytest.mark.parametrize("kind", ["qwen3_5_moe", "qwen3_next"])
def test_moe_generates_as_hf_and_loads_experts_either_way(tmp_path, kind):
    """Qwen3.5-MoE and Qwen3-Next (top-2 of 8 experts, a gated shared expert, every layer) through the engine:
    HF's tokens and logprobs. Qwen3.5-MoE's experts saved one by one (as transformers 4.x wrote them) load
    to the same weights as its fused ones."""
    from safetensors.numpy import load_file, save_file

    from infire_jax import LLM, SamplingParams
    from infire_jax.loaders.hf import load_hf_dir

    hf = hf_moe_model(kind)
    hf.save_pretrained(tmp_path / "fused", safe_serialization=True)
    _save_tokenizer(tmp_path / "fused")
    want = [hf_greedy(hf, prompt, NUM_TOKENS) for prompt in PROMPTS]
    llm = LLM(model=str(tmp_path / "fused"), attn_impl="reference", **ENGINE)
    try:
        cfg = llm.engine.model_config
        assert cfg.is_moe and cfg.num_experts == 8 and cfg.gated_delta.shared_expert_size == 48
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True,
                                                    logprobs=1))
    finally:
        llm.engine.close()
    _assert_as_hf(want, outs)
    if kind == "qwen3_next":
        return
    tensors = load_file(str(tmp_path / "fused" / "model.safetensors"))
    split = {}
    for name, w in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj"):  # [X, 2F, E]
            f = w.shape[1] // 2
            for x in range(w.shape[0]):
                split[name.replace("gate_up_proj", f"{x}.gate_proj.weight")] = w[x, :f]
                split[name.replace("gate_up_proj", f"{x}.up_proj.weight")] = w[x, f:]
        elif name.endswith("mlp.experts.down_proj"):  # [X, E, F]
            for x in range(w.shape[0]):
                split[name.replace("down_proj", f"{x}.down_proj.weight")] = w[x]
        else:
            split[name] = w
    (tmp_path / "split").mkdir()
    save_file(split, str(tmp_path / "split" / "model.safetensors"))
    _save_tokenizer(tmp_path / "split")
    (tmp_path / "split" / "config.json").write_text((tmp_path / "fused" / "config.json").read_text())
    fused, one_by_one = load_hf_dir(str(tmp_path / "fused")), load_hf_dir(str(tmp_path / "split"))
    assert sorted(fused.weights) == sorted(one_by_one.weights)
    for name, w in fused.weights.items():
        np.testing.assert_array_equal(one_by_one.weights[name], w)


@pytest.mark.parametrize("name, params", [("qwen3.5-0.8b", 752_393_024), ("qwen3.5-27b", 26_895_998_464),
                                          ("qwen3.5-35b-a3b", 34_660_610_688)])
def test_published_config_builds_transformers_model(name, params):
    """The `dummy:` configs (the published text configs) parse as transformers reads them, and the model the
    engine builds (abstractly) counts the parameters of transformers' model (on the meta device)."""
    import math

    from flax import nnx
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    from infire_jax.loaders.dummy import CONFIGS
    from infire_jax.models.registry import abstract_model

    hf = CONFIGS[name]
    cfg = config_from_hf(hf)
    assert cfg.gated_delta.rotary_dim == 64 and cfg.num_kv_layers == cfg.num_layers // 4
    model_cls, config_cls = ((Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig) if cfg.is_moe
                             else (Qwen3_5ForCausalLM, Qwen3_5TextConfig))
    with torch.device("meta"):
        ref = model_cls(config_cls(**{k: v for k, v in hf.items() if k != "model_type"}))
    want = sum(p.numel() for p in ref.parameters())
    assert want == cfg.param_count() == params
    model = abstract_model(cfg, jnp.bfloat16)
    assert sum(math.prod(v.shape) for _, v in nnx.to_flat_state(nnx.state(model))) == want


def test_config_refusals():
    base = dict(TINY, model_type="qwen3_5_text")
    for field, value, match in (("layer_types", ["full_attention"] + ["linear_attention"] * 7, "whole groups"),
                                ("attention_bias", True, "attention_bias"), ("attn_output_gate", False, "gate"),
                                ("linear_num_value_heads", 3, "multiple of linear_num_key_heads"),
                                ("rope_parameters", {"rope_type": "yarn"}, "default RoPE"),
                                ("mlp_only_layers", [1], "mlp_only_layers"), ("sliding_window", 8, "sliding_window")):
        with pytest.raises(UnsupportedModelError, match=match):
            config_from_hf({**base, field: value})


@pytest.mark.parametrize("setting, match", [
    (dict(speculative_config={"method": "eagle3", "num_speculative_tokens": 2, "model": "x"}),
     "method 'eagle3' is not supported"),
    (dict(speculative_config={"method": "mtp", "num_speculative_tokens": 2}),
     r"lacks the MTP layer's tensors \['mtp.fc.weight', 'mtp.pre_fc_norm_embedding.weight'"),
    (dict(weights_quantization="gguf"), "weights_quantization"),
    (dict(enable_lora=True), "LoRA adapters are supported on the Llama family"),
])
def test_engine_refusals(checkpoint, setting, match):
    """Refused by name before any weight is read."""
    from infire_jax import LLM

    _, path = checkpoint
    with pytest.raises(ConfigError, match=match):
        LLM(model=str(path), **{**ENGINE, **setting})


def test_int8_at_load_equals_its_float_twin(tmp_path, monkeypatch):
    """`weights_quantization="int8"` (a float32 scale per output channel; wo's per head): the DeltaNet's
    in_proj_qkv, in_proj_z and out_proj, the attention's q (with its gate), k, v and o, and the MLPs are held as
    their int8 parts alone, and the engine gives the tokens and logprobs of the float engine on a twin checkpoint
    whose projections are the format's decoded values (tests/quant_twins.py); also through the GPU's quantized
    matmul (interpret mode), which reads the parts in place in decode steps."""
    from infire_jax import SamplingParams
    from quant_twins import assert_kept_and_follows_twin, quantize_twin, twin_outputs

    hf = hf_model()
    for name in ("float", "twin"):
        if name == "twin":
            quantize_twin(hf, "int8", lambda _: TINY["head_dim"])
        hf.save_pretrained(tmp_path / name, safe_serialization=True)
        _save_tokenizer(tmp_path / name)
    engine = dict(ENGINE, token_buckets=(32,))
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
    want = twin_outputs(str(tmp_path / "twin"), engine, PROMPTS, params)
    kept = [f"linear_layers.{w}" for w in ("w_qkv", "w_z", "w_out", "w_gate_up", "w_down")] + [
        f"attention_layers.{w}" for w in ("wq", "wk", "wv", "wo", "w_gate_up", "w_down")]
    quantized = dict(engine, weights_quantization="int8")
    assert_kept_and_follows_twin(str(tmp_path / "float"), quantized, kept, "int8", PROMPTS, params, want, 1e-5)
    monkeypatch.setenv("INFIRE_JAX_QUANT_MATMUL", "pallas")
    assert_kept_and_follows_twin(str(tmp_path / "float"), quantized, kept, "int8", PROMPTS, params, want, 1e-4)


def test_meshes_match_hf(checkpoint, tmp_path, monkeypatch):
    """On virtual CPU devices, against HF: tp 2 with one kv head (repeated to each device) and tp 2 x ep 2 on
    the MoE (its experts split over ep, every expert's width and the shared expert's over tp). Each device
    holds its heads' weights and linear state. Meshes that cannot split the model are refused by name. On tp 2,
    int8 weights give the single device's tokens, an fp8 pool HF's scales (the one kv head's repeated) and the
    tokens of HF attending to e4m3 keys and values, and MTP speculation HF's tokens."""
    import os

    import yaml
    from test_sharding import ROOT, _assert_each_device_holds_its_shard, _results, _run_worker

    import copy

    from mtp_reference import ReferenceQwenMTP
    from safetensors.torch import save_file

    from quant_reference import attend_to_e4m3
    from transformers.models.qwen3_5 import modeling_qwen3_5

    from infire_jax.loaders.tokenizer import Tokenizer
    from infire_jax.runner.kv_scales import CALIBRATION_TEXT

    dense = hf_model_with(num_key_value_heads=1)
    moe = hf_moe_model("qwen3_5_moe")
    paths = {}
    for name, hf in (("dense", dense), ("moe", moe)):
        hf.save_pretrained(tmp_path / name, safe_serialization=True)
        _save_tokenizer(tmp_path / name)
        paths[name] = str(tmp_path / name)
    mtp = ReferenceQwenMTP(copy.deepcopy(dense.config), dense.model.embed_tokens.weight.detach(),
                           dense.lm_head.weight.detach(), seed=1)
    save_file(mtp.tensors(), str(tmp_path / "dense" / "mtp.safetensors"), metadata={"format": "pt"})
    tp_ep = tmp_path / "4-tp2-ep2.yaml"
    tp_ep.write_text(yaml.safe_dump({"mesh": {"tp": 2, "ep": 2}, "rules": {
        "vocab": "tp", "q_heads": "tp", "kv_heads": "tp", "mlp": "tp", "experts": "ep"}}))
    shipped = {m: os.path.join(ROOT, "sharding", "configs", f"{m}.yaml") for m in ("2", "4", "2-pp2")}
    runs = [{"model": paths["dense"], "mesh": shipped["2"], "tag": "tp2"},
            {"model": paths["moe"], "mesh": str(tp_ep), "tag": "tp2-ep2"},
            {"model": paths["dense"], "mesh": shipped["4"], "tag": "tp4"},
            {"model": paths["dense"], "mesh": shipped["2-pp2"], "tag": "pp2"},
            {"model": paths["dense"], "mesh": shipped["2"], "tag": "mtp tp2", "speculative_config": {
                "method": "mtp", "num_speculative_tokens": 2, "acceptance_threshold": 0.0}}]
    # int8 at load on tp 2 (the one kv head's k and v parts repeated to each device) as on one device
    runs += [{"model": paths["dense"], "mesh": os.path.join(ROOT, "sharding", "configs", f"{m}.yaml"),
              "tag": f"int8 {m}", "weights_quantization": "int8"} for m in ("1", "2")]
    # and an fp8 pool, calibrated on tp 2 from each device's zeroed linear state
    runs += [{"model": paths["dense"], "mesh": shipped["2"], "tag": "fp8 tp2", "engine": {"kv_cache_dtype": "fp8"}}]
    engine = {**{k: v for k, v in ENGINE.items() if k != "dtype"}, "token_buckets": [32]}  # one bucket compiled
    proc = _run_worker({"runs": runs, "prompts": PROMPTS, "max_tokens": NUM_TOKENS, "engine": engine}, 4, tmp_path,
                       "qwen3_5")
    want = {"tp2": [hf_greedy(dense, p, NUM_TOKENS) for p in PROMPTS],
            "tp2-ep2": [hf_greedy(moe, p, NUM_TOKENS) for p in PROMPTS]}
    results = {r["tag"]: r for r in _results(proc)}
    assert not results["tp4"]["fits"] and "2 linear-attention k heads are not divisible by tp=4" in results["tp4"]["error"]
    assert not results["pp2"]["fits"] and "pipeline parallelism is not supported" in results["pp2"]["error"]
    r = results["mtp tp2"]  # each device verifies, then commits its heads' linear state
    assert r["fits"], r.get("error")
    assert r["spec"]["drafted"] > 0 and r["spec"]["compiles"] == 0, r["spec"]
    for (tokens, logprobs), got, got_lp in zip(want["tp2"], r["tokens"], r["logprobs"]):
        assert got == tokens
        np.testing.assert_allclose(got_lp, logprobs, atol=1e-3, rtol=0)
    int8 = [results[f"int8 {m}"] for m in ("1", "2")]
    assert all(r["fits"] for r in int8), [r.get("error") for r in int8]
    assert int8[1]["tokens"] == int8[0]["tokens"]
    np.testing.assert_allclose(int8[1]["logprobs"], int8[0]["logprobs"], atol=1e-4, rtol=0)
    assert int8[1]["params"]["attention_layers.wk.int8"]["spec"][2] == "tp"
    fp8 = results["fp8 tp2"]
    assert fp8["fits"], fp8.get("error")
    ids = Tokenizer.from_dir(paths["dense"]).encode(CALIBRATION_TEXT)  # HF's scales, the one kv head's repeated
    np.testing.assert_allclose(fp8["kv_scales"], np.repeat(_hf_kv_scales(dense, ids), 2, axis=2), rtol=1e-4)
    rounded = hf_model_with(num_key_value_heads=1)  # HF attending to e4m3 keys and values, with those scales
    attend_to_e4m3(modeling_qwen3_5, rounded.config, np.asarray(fp8["kv_scales"])[:, :, :1], monkeypatch,
                   lambda layer: layer // TINY_INTERVAL)
    for (tokens, logprobs), got, got_lp in zip((hf_greedy(rounded, p, NUM_TOKENS) for p in PROMPTS), fp8["tokens"],
                                               fp8["logprobs"]):
        assert got == tokens
        np.testing.assert_allclose(got_lp, logprobs, atol=1e-5, rtol=0)
    for tag, expected in want.items():
        r = results[tag]
        assert r["fits"], r.get("error")
        for (tokens, logprobs), got, got_lp in zip(expected, r["tokens"], r["logprobs"]):
            assert got == tokens, tag
            np.testing.assert_allclose(got_lp, logprobs, atol=1e-3, rtol=0)
        _assert_each_device_holds_its_shard(r)
        specs = {k: v["spec"] for k, v in r["params"].items()}
        assert specs["linear_layers.w_qkv"] == [None, None, "tp"] and specs["linear_layers.w_out"] == [None, "tp", None]
        assert specs["attention_layers.wk"] == [None, None, "tp", None]
        state = r["linear_state"]
        assert state["conv"]["spec"] == [None, None, None, "tp"] and state["recurrent"]["spec"][2] == "tp"
        for arr in state.values():  # each device its half: tp 2 (replicated over ep)
            assert all(2 * b == arr["global"] for b in arr["per_device"])
    assert results["tp2-ep2"]["params"]["linear_layers.w_gate_up"]["spec"][1] == "ep"
