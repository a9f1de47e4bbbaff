"""MTP speculative decoding (vLLM's `{"method": "mtp"}`) on a tiny random DeepSeek-V3 checkpoint whose MTP layer
(model.layers.3) is written as DeepSeek-V3 ships it: the head's drafts against a float64 torch composition of
HF's `DeepseekV3DecoderLayer` (tests/mtp_reference.py) through paged steps, the engine's greedy output against
the engine without speculation, and checkpoints without an MTP layer refused by name."""

from __future__ import annotations

import copy
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import load_file, save_file

from deepseek_models import hf_model, save
from infire_jax.errors import ConfigError
from infire_jax.loaders.hf import read_hf_config
from infire_jax.speculative.mtp import mtp_propose
from infire_jax.speculative.mtp_loader import load_mtp
from mtp_reference import ReferenceMTP, normed_last_states
from test_eagle3 import PS, make_meta, record_proposals

ENGINE = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=32, token_buckets=(8, 32), max_model_len=128,
              num_kv_pages=96)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(the HF target, the reference MTP layer, the checkpoint's directory with both)."""
    hf = hf_model("deepseek-v3")
    path = save("deepseek-v3", hf, tmp_path_factory.mktemp("mtp"))
    ref = ReferenceMTP(copy.deepcopy(hf.config), hf.model.embed_tokens.weight.detach(), hf.lm_head.weight.detach(),
                       seed=1)
    _passes_states_on(ref)
    file = os.path.join(path, "model.safetensors")
    save_file({**load_file(file), **ref.tensors()}, file, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["num_nextn_predict_layers"] == 1
    return hf, ref, path


def _passes_states_on(ref: ReferenceMTP) -> None:
    """The block mostly passes hnorm(h_p) on, so that drafts often guess x_{p+2} = x_{p+1} (some are accepted)."""
    with torch.no_grad():
        ref.eh_proj.weight.mul_(0.3)
        ref.eh_proj.weight[:, 64:] += torch.eye(64, dtype=torch.float64)
        for w in (ref.block.self_attn.o_proj.weight, ref.block.mlp.experts.down_proj,
                  ref.block.mlp.shared_experts.down_proj.weight):
            w.mul_(0.25)


@pytest.fixture(scope="module")
def glm4_checkpoint(tmp_path_factory):
    """(the HF GLM-4.5 target with q/k norms, its reference MTP layer, the checkpoint's directory with both)."""
    from deepseek_models import _save_tokenizer
    from test_glm4_moe import hf_model as glm4_model

    hf, path = glm4_model(use_qk_norm=True), tmp_path_factory.mktemp("glm4-mtp")
    hf.save_pretrained(path, safe_serialization=True)
    _save_tokenizer(path)
    ref = ReferenceMTP(copy.deepcopy(hf.config), hf.model.embed_tokens.weight.detach(), hf.lm_head.weight.detach(),
                       seed=2)
    file = str(path / "model.safetensors")
    save_file({**load_file(file), **ref.tensors()}, file, metadata={"format": "pt"})
    return hf, ref, str(path)


@pytest.mark.parametrize("k", [1, 2])
def test_drafts_match_the_reference_through_paged_steps(checkpoint, k):
    """Two calls on two rows with pages spread over the pool: prefills, then a verification where only some
    catch-up tokens were accepted (their KV slots are scratch). Each row's drafts (k = 2: the MTP layer reused on
    its own output) are the reference's greedy chain over the accepted sequence, recomputed from scratch, and
    the draft logits agree to float32 accuracy. The checkpoint's shared_head.head and embed_tokens equal the
    target's, so the head holds neither."""
    hf, ref, path = checkpoint
    head = load_mtp(path, read_hf_config(path), dtype=jnp.float32)
    assert not hasattr(head, "head") and not hasattr(head, "embed")
    embed, lm_head = hf.model.embed_tokens.weight.detach().numpy(), hf.lm_head.weight.detach().numpy()
    graphdef, state = nnx.split(head)
    propose = jax.jit(lambda state, *a: mtp_propose(nnx.merge(graphdef, state), *a, num_draft=k,
                                                    attn_impl="reference"))
    rng = np.random.default_rng(k)
    pages = {0: [5, 17, 3, 9], 1: [11, 2, 7]}
    seqs = {r: ([], []) for r in pages}  # accepted (token, hidden state) per position
    calls = [{0: (0, 19, 19), 1: (0, 6, 6)},  # per row: (first position, catch-up tokens, accepted)
             {0: (19, 3, 1), 1: (6, 3, 3)}]
    kv = (jnp.zeros((1, 20, PS, 1, 32)), jnp.zeros((1, 20, PS, 1, 8)))
    for call in calls:
        rows, tokens, hidden, last = [], [], [], []
        for r, (start, n, accepted) in call.items():
            toks, hid = rng.integers(0, 320, n), rng.standard_normal((n, 64)).astype(np.float32)
            seqs[r][0].extend(toks[:accepted])
            seqs[r][1].extend(hid[:accepted])
            last.append(len(tokens) + accepted - 1)
            rows.append((list(range(start, start + n)), pages[r]))
            tokens.extend(toks)
            hidden.extend(hid)
        pad = 32 - len(tokens)
        out = propose(state, jnp.asarray(embed), jnp.asarray(lm_head), kv,
                      jnp.asarray(np.concatenate([tokens, np.zeros(pad, int)])),
                      jnp.asarray(np.concatenate([np.stack(hidden), np.zeros((pad, 64), np.float32)])),
                      make_meta(rows, num_tokens=32, num_rows=3, width=4), jnp.asarray(last + [0]))
        kv = out.kv
        for r in call:
            drafts, logits = ref.greedy_chain(np.asarray(seqs[r][0]), np.stack(seqs[r][1]), k)
            assert np.asarray(out.token_ids[r]).tolist() == drafts, (call, r)
            np.testing.assert_allclose(out.draft_logits[r], logits, rtol=1e-4, atol=1e-4)


def test_loader_keeps_a_shared_head_that_differs(checkpoint, tmp_path):
    """A shared_head.head that is not the target's LM head is the head's own."""
    hf, ref, path = checkpoint
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(os.path.join(path, name), tmp_path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    head_name = "model.layers.3.shared_head.head.weight"
    tensors[head_name] = tensors[head_name] * 2
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    head = load_mtp(str(tmp_path), read_hf_config(path), dtype=jnp.float32)
    np.testing.assert_array_equal(head.head[...], tensors[head_name].numpy())
    assert not hasattr(head, "embed")


@pytest.fixture(scope="module")
def engines(checkpoint):
    from infire_jax import LLM

    _, _, path = checkpoint
    spec = {"method": "deepseek_mtp", "num_speculative_tokens": 2, "disable_by_batch_size": 8,
            "acceptance_threshold": 0.0}  # every step drafts
    return LLM(model=path, **ENGINE), LLM(model=path, **ENGINE, speculative_config=spec)


def test_engine_serves_mtp_losslessly(checkpoint, engines):
    """Greedy output equals the engine without speculation for several prompts in one batch, with n = 2 and a stop
    string; drafts are proposed (and each proposal's first draft is the reference's on HF's states), nothing
    compiles after warmup and every page comes back."""
    from infire_jax import SamplingParams

    hf, ref, _ = checkpoint
    plain, spec = engines
    e = spec.engine
    assert spec.engine.spec_config.method == "mtp" and e.runner.rc.aux_layers is None
    prompts = [[5, 77, 200, 13, 42], [258, 3, 3, 190, 64, 99, 120, 7, 250, 11, 31], list(range(60, 90))]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = plain.generate(prompts, params)
    records = record_proposals(e)
    got = spec.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    s = e.spec.stats
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens  # proposed, and both accepted and rejected

    finals = [p + o.outputs[0].token_ids for p, o in zip(prompts, got)]
    cache, checked = {}, 0
    for tokens, drafts in records:
        if not drafts:
            continue
        final = next(f for f in finals if f[:len(tokens)] == tokens)
        if tuple(final) not in cache:
            cache[tuple(final)] = normed_last_states(hf, final)
        n = len(tokens)
        wanted, logits = ref.greedy_chain(np.asarray(final[1:n]), cache[tuple(final)][:n - 1], 1)
        assert drafts[0] == wanted[0] or logits[0].max() - logits[0][drafts[0]] < 1e-4, (n, drafts, wanted)
        checked += 1
    assert checked >= 3 * 5

    text = want[1].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, n=2, stop=[stop])
    want = plain.generate(prompts, params)
    assert want[1].outputs[0].finish_reason == "stop"
    for w, g in zip(want, spec.generate(prompts, params)):
        assert [o.token_ids for o in g.outputs] == [o.token_ids for o in w.outputs]
        assert [o.text for o in g.outputs] == [o.text for o in w.outputs]
    assert e.compiles_since_warmup == 0 and e.kv.num_free_pages == e.kv.num_usable_pages


def test_checkpoints_without_an_mtp_layer_are_refused(checkpoint, tmp_path):
    from infire_jax import LLM

    _, _, path = checkpoint
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    tensors = {k: v for k, v in load_file(os.path.join(path, "model.safetensors")).items()
               if not k.startswith("model.layers.3.")}
    for name, nextn in (("no_tensors", 1), ("no_layer", 0)):
        d = tmp_path / name
        d.mkdir()
        shutil.copy(os.path.join(path, "tokenizer.json"), d)
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(path, "config.json")) as f:
            config = dict(json.load(f), num_nextn_predict_layers=nextn)
        (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"lacks the MTP layer's tensors \['model.layers.3.enorm.weight'"):
        LLM(model=str(tmp_path / "no_tensors"), **ENGINE, speculative_config=spec)
    with pytest.raises(ConfigError, match="has no MTP layer .*num_nextn_predict_layers is 0"):
        LLM(model=str(tmp_path / "no_layer"), **ENGINE, speculative_config=spec)
    with pytest.raises(ConfigError, match="serves the DeepSeek-V3 family, GLM-4.5 and Qwen3.5, not llama"):
        LLM(**ENGINE, speculative_config=spec)
    with pytest.raises(ConfigError, match="method 'mtp' reads the target's own checkpoint"):
        LLM(model=path, **ENGINE, speculative_config=dict(spec, model="elsewhere"))


def assert_paged_drafts_are_the_references(hf, ref, path: str, *, vocab: int, kv_heads: int, head_dim: int) -> None:
    """The MTP layer of checkpoint `path` over two rows' prefills (random tokens and hidden states), then k = 2
    drafts each, through paged steps: the reference's drafts and logits."""
    head = load_mtp(path, read_hf_config(path), dtype=jnp.float32)
    graphdef, state = nnx.split(head)
    rng = np.random.default_rng(3)
    lengths, pages = (13, 5), ([4, 1], [6])
    tokens = rng.integers(0, vocab, 32)
    hidden = rng.standard_normal((32, 64)).astype(np.float32)
    meta = make_meta([(list(range(n)), p) for n, p in zip(lengths, pages)], num_tokens=32, num_rows=3, width=2)
    kv = (jnp.zeros((1, 8, PS, kv_heads, head_dim)),) * 2
    out = jax.jit(lambda state, *a: mtp_propose(nnx.merge(graphdef, state), *a, num_draft=2, attn_impl="reference"))(
        state, hf.model.embed_tokens.weight.detach().numpy(), hf.lm_head.weight.detach().numpy(), kv,
        jnp.asarray(tokens), jnp.asarray(hidden), meta, jnp.asarray([12, 17, 0]))
    for r, (start, n) in enumerate(((0, 13), (13, 5))):
        drafts, logits = ref.greedy_chain(tokens[start:start + n], hidden[start:start + n], 2)
        assert np.asarray(out.token_ids[r]).tolist() == drafts
        np.testing.assert_allclose(out.draft_logits[r], logits, rtol=1e-4, atol=1e-4)


def test_glm4_moe_drafts_match_the_reference(glm4_checkpoint, tmp_path):
    """GLM-4.5's MTP layer (GQA with q/k norms, a partial rotation and biases, beside DeepSeek-V3's MoE) through
    glm4_moe.py's layer: two rows' prefills, then k = 2 drafts each, against the reference."""
    hf, ref, path = glm4_checkpoint
    assert_paged_drafts_are_the_references(hf, ref, path, vocab=320, kv_heads=2, head_dim=16)

    # through the engine: GLM-4.5's pool entry for the head, greedy output the engine's own without drafts
    from infire_jax import LLM, SamplingParams

    prompts, params = [[5, 77, 200, 13, 42], list(range(60, 90))], SamplingParams(max_tokens=12, temperature=0,
                                                                                   ignore_eos=True)
    plain = LLM(model=path, **ENGINE)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    plain.engine.close()
    spec = LLM(model=path, **ENGINE, speculative_config={
        "method": "glm4_moe_mtp", "num_speculative_tokens": 2, "disable_by_batch_size": 8, "acceptance_threshold": 0.0})
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == want
    e = spec.engine
    assert e.spec.stats.num_draft_tokens > 0 and e.compiles_since_warmup == 0
    assert e.kv.num_free_pages == e.kv.num_usable_pages
    e.close()

    # beside a target kept in fp8 as GLM-4.5's FP8 releases are (compressed-tensors, a scale a row; the MTP
    # layer's projections too, dequantized for the head): the tokens and every draft of the float engine on
    # the twin of the decoded values (which is lossless, as above)
    from quant_twins import write_8bit

    quantized, twin = (str(tmp_path / k) for k in ("fp8", "twin"))
    write_8bit(path, quantized, twin, "fp8-channel")
    runs = []
    for path, mode in ((twin, None), (quantized, "checkpoint")):
        llm = LLM(model=path, weights_quantization=mode, **ENGINE, speculative_config={
            "method": "glm4_moe_mtp", "num_speculative_tokens": 2, "disable_by_batch_size": 8,
            "acceptance_threshold": 0.0})
        records = record_proposals(llm.engine)
        runs.append(([o.outputs[0].token_ids for o in llm.generate(prompts, params)], records))
        llm.engine.close()
    assert runs[0] == runs[1] and runs[0][1]


def test_mtp_beside_a_target_kept_quantized(checkpoint, engines, tmp_path):
    """DeepSeek-V3 as it is released: every linear weight in fp8 blocks (of 16 here), the MTP layer's too,
    the target's kept so on the device (`weights_quantization="checkpoint"`), the MTP layer dequantized:
    greedy output equals the kept engine's without speculation, drafts are accepted as often as over the
    float target (their head and its hidden states are within fp8 rounding of those), nothing compiles after
    warmup and every page comes back."""
    from deepseek_models import quantize_checkpoint
    from infire_jax import LLM, SamplingParams

    _, _, path = checkpoint
    quantized = tmp_path / "fp8"
    shutil.copytree(path, quantized)
    quantize_checkpoint(str(quantized), "fp8", 16)
    prompts = [[5, 77, 200, 13, 42], [258, 3, 3, 190, 64, 99, 120, 7, 250, 11, 31], list(range(60, 90))]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    spec = {"method": "mtp", "num_speculative_tokens": 2, "disable_by_batch_size": 8, "acceptance_threshold": 0.0}
    plain = LLM(model=str(quantized), weights_quantization="checkpoint", **ENGINE)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    plain.engine.close()
    kept = LLM(model=str(quantized), weights_quantization="checkpoint", **ENGINE, speculative_config=spec)
    try:
        assert [o.outputs[0].token_ids for o in kept.generate(prompts, params)] == want
        e = kept.engine
        assert "moe_layers.w_gate_up.fp8" in {".".join(map(str, p)) for p, _ in nnx.to_flat_state(e.runner.state)}
        accepted = e.spec.stats.num_accepted_tokens / e.spec.stats.num_draft_tokens
        before = engines[1].engine.spec.stats  # the float target's, over the same prompts
        drafted, took = before.num_draft_tokens, before.num_accepted_tokens
        engines[1].generate(prompts, params)
        after = engines[1].engine.spec.stats
        assert accepted > 0.5 * (after.num_accepted_tokens - took) / (after.num_draft_tokens - drafted) > 0
        assert e.compiles_since_warmup == 0 and e.kv.num_free_pages == e.kv.num_usable_pages
    finally:
        kept.engine.close()


def _mesh_results(path: str, specs: dict[str, dict], meshes: tuple[str, ...], tmp_path) -> dict[str, dict]:
    """sharded_worker.py's results (8 virtual CPU devices) for the target at `path` with each speculative_config
    of `specs` on each mesh, by "{name in specs}-{mesh}": two prompts, 24 greedy tokens each."""
    from test_sharding import CONFIG_DIR, _results, _run_worker

    runs = [{"model": path, "mesh": os.path.join(CONFIG_DIR, f"{mesh}.yaml"), "tag": f"{name}-{mesh}",
             "speculative_config": sc} for name, sc in specs.items() for mesh in meshes]
    job = {"runs": runs, "prompts": [[5, 77, 200, 13, 42], [258, 3, 3, 190, 64, 99, 120, 7, 250, 11, 31]],
           "max_tokens": 24, "engine": {k: v for k, v in ENGINE.items() if k != "dtype"}}
    return {r["tag"]: r for r in _results(_run_worker(job, 8, tmp_path, "mtp-mesh"))}


def _assert_as_one_device(r: dict, ref: dict) -> None:
    """A mesh's run gives one device's tokens, logprobs (within float32 reductions' order) and every proposal,
    and compiles nothing after warmup."""
    assert ref["fits"] and ref["spec"]["drafted"] > 0, ref.get("error")
    assert r["fits"], r.get("error")
    assert r["tokens"] == ref["tokens"] and r["spec"]["proposals"] == ref["spec"]["proposals"]
    np.testing.assert_allclose(r["logprobs"], ref["logprobs"], atol=1e-4, rtol=0)
    assert r["spec"]["compiles"] == 0


def _planned(path: str, spec: dict, mesh: str):
    """`infire-jax plan`'s plans of the target at `path` on `mesh`, without and with `spec`'s draft head."""
    from test_sharding import CONFIG_DIR

    from infire_jax.memplan.plan import memory_plan, parse_bytes
    from infire_jax.memplan.source import plan_source
    from infire_jax.speculative.plan import draft_head_for
    from sharding.mesh import MeshConfig

    mc = MeshConfig.from_yaml(os.path.join(CONFIG_DIR, f"{mesh}.yaml"))
    return tuple(memory_plan(plan_source(path, "float32", draft_head=sc and draft_head_for(sc, "float32"))(mc), mc,
                             parse_bytes("1GB"), dtype="float32") for sc in (None, spec))


def test_mtp_on_a_tp_ep_mesh_drafts_as_one_device(checkpoint, tmp_path):
    """On tp 2 x ep 4 (the MLA heads split over tp, the latent pool replicated, the experts split over ep), the MTP
    head's decoder layer is split as the target's layers (an eighth of its experts a device: over ep, their
    widths over tp; half of its heads' projections) and run in the mesh's shard_map; its norms, eh_proj and
    one-layer pool are whole on every device, reading the target's last states and its vocabulary-split
    embedding and head: greedy tokens and logprobs equal one device's with the head, and so does every
    proposal, accepted and rejected; nothing compiles after warmup. `infire-jax plan` counts the head's bytes
    on each device and its pool's per token, and refuses a pipeline mesh. An EAGLE-3 head drafts there as on
    one device too (the states it reads kept across the dense and MoE stacks inside the shard_map)."""
    from deepseek_models import VOCAB
    from test_eagle3 import head_over_frequent_tokens
    from test_sharding import CONFIG_DIR

    from infire_jax.memplan.source import plan_source
    from infire_jax.models.kv_entry import kv_entry
    from infire_jax.speculative.plan import draft_head_for
    from sharding.mesh import MeshConfig

    _, _, path = checkpoint
    spec = {"method": "mtp", "num_speculative_tokens": 2, "disable_by_batch_size": 8, "acceptance_threshold": 0.0}
    eagle3, _, _ = head_over_frequent_tokens(
        [[5, 77, 77, 200]], tmp_path, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=96, vocab_size=VOCAB, max_position_embeddings=512,
        eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]})
    results = _mesh_results(path, {"mtp": spec, "eagle3": eagle3}, ("1", "8-tp2-ep4"), tmp_path)
    _assert_as_one_device(results["eagle3-8-tp2-ep4"], results["eagle3-1"])
    ref, r = results["mtp-1"], results["mtp-8-tp2-ep4"]
    _assert_as_one_device(r, ref)
    assert 0 < ref["spec"]["accepted"] < ref["spec"]["drafted"]
    params = r["spec"]["params"]
    for name in ("layers.w_gate_up", "layers.w_down"):  # the routed experts over ep, their widths over tp
        assert params[name][1] == [params[name][0] // 8] * 8, (name, params[name])
    assert params["layers.w_uk"][1] == [params["layers.w_uk"][0] // 2] * 8  # its heads over tp
    assert params["eh_proj"][1] == [params["eh_proj"][0]] * 8  # whole on every device

    # `infire-jax plan --speculative-config` counts the head's bytes on each device, and its pool's per token
    plain, planned = _planned(path, spec, "8-tp2-ep4")
    assert planned.weights["speculation"] == sum(per_device[0] for _, per_device in params.values())
    assert planned.kv_bytes_per_token - plain.kv_bytes_per_token == kv_entry(read_hf_config(path)).bytes_per_page(
        1, 1, np.float32)
    with pytest.raises(ValueError, match="pp=2"):
        plan_source(path, "float32", draft_head=draft_head_for(spec, "float32"))(MeshConfig.from_yaml(
            os.path.join(CONFIG_DIR, "2-pp2.yaml")))


def test_glm4_mtp_on_meshes_drafts_as_one_device(glm4_checkpoint, tmp_path):
    """GLM-4.5's MTP layer on tp 4 (its 2 kv heads repeated to 4, as the target's): the layer split as the
    target's layers and run in the mesh's shard_map, its one-layer pool split by kv head as the target's pool:
    greedy tokens, logprobs and every proposal equal one device's; nothing compiles after warmup. `infire-jax
    plan` counts each device's share of the head and of its pool. (The experts split over ep as DeepSeek-V3's
    MTP layer's, above.)"""
    _, _, path = glm4_checkpoint
    spec = {"method": "glm4_moe_mtp", "num_speculative_tokens": 2, "disable_by_batch_size": 8,
            "acceptance_threshold": 0.0}
    results = _mesh_results(path, {"mtp": spec}, ("1", "4"), tmp_path)
    r = results["mtp-4"]
    _assert_as_one_device(r, results["mtp-1"])  # its drafts rejected, each but the next token
    params, pool, tokens = r["spec"]["params"], r["spec"]["pool"], r["spec"]["pool_tokens"]
    e, heads, d, kv_heads, tp = 64, 8, 16, 4, 4  # 2 kv heads repeated up to tp
    assert params["layers.wqkv"][0] == e * (heads + 2 * kv_heads) * d * 4
    assert params["layers.wqkv"][1] == [params["layers.wqkv"][0] // tp] * tp  # its heads over tp
    assert params["eh_proj"][1] == [params["eh_proj"][0]] * tp  # whole on every device
    assert pool == [kv_heads // tp * 2 * d * 4 * tokens] * tp  # one (repeated) kv head a device
    # the plan: each device's share of the head, and of its pool per token
    plain, planned = _planned(path, spec, "4")
    assert planned.weights["speculation"] == sum(per_device[0] for _, per_device in params.values())
    assert (planned.kv_bytes_per_token - plain.kv_bytes_per_token) * tokens == pool[0]


@pytest.mark.parametrize("family", ["deepseek-v3", "glm4_moe"])
def test_eagle3_drafts_for_the_deepseek_and_glm_families(family, request, tmp_path):
    """EAGLE-3 (Kimi K2's speculation: it ships no MTP layer) over a target of two stacks, a dense first layer
    then MoE layers: the states it reads are kept across both stacks' scans (aux ids 0, 1 and the last: the
    dense layer's output, the first MoE layer's and the last one's). Greedy tokens equal HF's; drafts over
    the two tokens most frequent in HF's continuations are accepted and rejected; each proposal's first draft
    is the float64 reference head's on HF's states; nothing compiles after warmup, every page comes back."""
    from deepseek_models import VOCAB, hf_greedy
    from test_eagle3 import assert_first_drafts_are_the_references, head_over_frequent_tokens, hf_states

    from infire_jax import LLM, SamplingParams

    hf, _, path = request.getfixturevalue("checkpoint" if family == "deepseek-v3" else "glm4_checkpoint")
    n = hf.config.num_hidden_layers
    prompts = [[5, 77, 200, 13, 42], [258, 3, 3, 190, 64, 99, 120, 7, 250, 11, 31], list(range(60, 90))]
    want = [hf_greedy(hf, p, 16)[0] for p in prompts]
    spec, tensors, config = head_over_frequent_tokens(
        want, tmp_path, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=96, vocab_size=VOCAB, max_position_embeddings=512,
        eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, n - 1]})
    llm = LLM(model=path, **ENGINE, speculative_config=spec)
    e = llm.engine
    try:
        assert e.runner.rc.aux_layers == (1, 2, n)
        records = record_proposals(e)
        outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in outs] == want
        assert 0 < e.spec.stats.num_accepted_tokens < e.spec.stats.num_draft_tokens
        assert_first_drafts_are_the_references(records, [p + w for p, w in zip(prompts, want)], tensors, config,
                                               hf.model.embed_tokens.weight.detach().numpy(),
                                               lambda seq: hf_states(hf, seq, (1, 2, n)))
        assert e.compiles_since_warmup == 0 and e.kv.num_free_pages == e.kv.num_usable_pages
    finally:
        e.close()
