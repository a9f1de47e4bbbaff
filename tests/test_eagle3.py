"""EAGLE-3: the target's aux hidden states against HF, the head against a float64 numpy reference
(tests/eagle3_reference.py) on a random checkpoint in the published layout, the loader's checks, and
a greedy speculative loop on the real model that must reproduce plain greedy decoding."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import save_file

from eagle3_reference import ReferenceEagle3
from infire_jax.errors import ConfigError, UnsupportedModelError
from infire_jax.loaders.load import load_model
from infire_jax.models.config import ModelConfig
from infire_jax.models.registry import build_state
from infire_jax.speculative.eagle3 import eagle3_propose
from infire_jax.speculative.eagle3_loader import load_eagle3
from pallas_kernels.metadata import AttentionMetadata
from test_kernels import pallas_kernel_names

PS = 8  # page size
SMOL = ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64)  # SmolLM2-135M's shape
HEAD_CONFIG = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
               "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
               "intermediate_size": 1536, "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
               "vocab_size": 49152, "draft_vocab_size": 8192, "tie_word_embeddings": False}


def random_checkpoint(seed: int = 0, *, draft_ids: list[int] | None = None,
                      config: dict = HEAD_CONFIG) -> dict[str, np.ndarray]:
    """A random head of `config`'s shape in the published EAGLE-3 layout (HF names, (out, in) weights,
    d2t offsets, t2d mask), drafting over `draft_ids` (default: `draft_vocab_size` random target ids)."""
    rng = np.random.default_rng(seed)
    e, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hq, hkv, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    target = np.sort(rng.choice(v, config["draft_vocab_size"], replace=False) if draft_ids is None else draft_ids)
    draft_vocab = len(target)

    def mat(*shape, std=0.03):
        return (std * rng.standard_normal(shape)).astype(np.float32)

    def norm():
        return (1 + 0.1 * rng.standard_normal(e)).astype(np.float32)

    t2d = np.zeros(v, bool)
    t2d[target] = True
    return {"fc.weight": mat(e, 3 * e), "midlayer.input_layernorm.weight": norm(),
            "midlayer.hidden_norm.weight": norm(), "midlayer.self_attn.q_proj.weight": mat(hq * d, 2 * e),
            "midlayer.self_attn.k_proj.weight": mat(hkv * d, 2 * e),
            "midlayer.self_attn.v_proj.weight": mat(hkv * d, 2 * e), "midlayer.self_attn.o_proj.weight": mat(e, hq * d),
            "midlayer.post_attention_layernorm.weight": norm(), "midlayer.mlp.gate_proj.weight": mat(f, e),
            "midlayer.mlp.up_proj.weight": mat(f, e), "midlayer.mlp.down_proj.weight": mat(e, f),
            "norm.weight": norm(), "lm_head.weight": mat(draft_vocab, e, std=0.05),
            "d2t": (target - np.arange(draft_vocab)).astype(np.int64), "t2d": t2d}


def head_over_frequent_tokens(want: list[list[int]], path, **config) -> tuple[dict, dict, dict]:
    """A random head (HEAD_CONFIG with `config`, `attentive`) drafting over the two tokens most frequent in the
    target's continuations `want`, written at `path`: (its speculative_config, drafting on every step; its
    tensors; its config)."""
    from collections import Counter

    draft_ids = sorted(t for t, _ in Counter(sum(want, [])).most_common(2))
    config = dict(HEAD_CONFIG, draft_vocab_size=len(draft_ids), **config)
    tensors = attentive(random_checkpoint(6, draft_ids=draft_ids, config=config))
    spec = {"method": "eagle3", "model": write_checkpoint(path, tensors, config), "num_speculative_tokens": 3,
            "acceptance_threshold": 0.0}  # no back-off: every step drafts
    return spec, tensors, config


def write_checkpoint(path, tensors: dict[str, np.ndarray], config: dict) -> str:
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def make_meta(rows: list[tuple[list[int], list[int]]], *, num_tokens: int, num_rows: int,
              width: int) -> AttentionMetadata:
    """A step as batch.build_batch lays it out: rows of (positions, pages), then padding."""
    pos, seq = np.zeros(num_tokens, np.int32), np.full(num_tokens, num_rows, np.int32)
    slots = np.arange(num_tokens, dtype=np.int32) % PS  # padding: the null page
    table, kv_lens = np.zeros((num_rows, width), np.int32), np.zeros(num_rows, np.int32)
    cu = np.zeros(num_rows + 1, np.int32)
    off = 0
    for r, (positions, pages) in enumerate(rows):
        p = np.asarray(positions, np.int32)
        pos[off:off + len(p)] = p
        slots[off:off + len(p)] = np.asarray(pages)[p // PS] * PS + p % PS
        seq[off:off + len(p)] = r
        table[r, :len(pages)] = pages
        kv_lens[r] = p[-1] + 1
        off += len(p)
        cu[r + 1:] = off
    return AttentionMetadata(*map(jnp.asarray, (pos, slots, seq, table, kv_lens, cu, np.int32(len(rows)))))


def jit_propose(head, num_draft: int, **kw):
    graphdef, state = nnx.split(head)

    @jax.jit
    def run(state, embed, kv, tokens, hidden, meta, last_index, *args):
        return eagle3_propose(nnx.merge(graphdef, state), embed, kv, tokens, hidden, meta, last_index,
                              num_draft=num_draft, attn_impl="reference", **dict(zip(kw, args)))

    return lambda *a: run(state, *a, *kw.values())


@pytest.fixture(scope="module")
def smol():
    return load_model(None)


@pytest.fixture(scope="module")
def target(smol):
    graphdef, state = build_state(smol.config, smol.weights, jnp.float32)
    return nnx.merge(graphdef, state)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tensors = random_checkpoint()
    return tensors, write_checkpoint(tmp_path_factory.mktemp("eagle3"), tensors, HEAD_CONFIG)


def write_speculators(path, tensors: dict[str, np.ndarray], config: dict, layer: str = "llama",
                      **flags) -> tuple[dict, str, dict]:
    """The head in vLLM's speculators layout (Red Hat's `*-speculator.eagle3`): `layers.0.` names, the decoder
    layer's fields in `transformer_layer_config` (a `layer` one: Qwen3's adds q/k norms), 3 speculative tokens
    by default; `flags` its norm variants, with random weights for the norms they add. (tensors by EAGLE's
    names, the directory, the flat config)."""
    rng = np.random.default_rng(9)
    et = config["hidden_size"]
    tensors = dict(tensors)
    config = dict(config, model_type=layer)
    if layer == "qwen3":
        tensors.update({f"midlayer.self_attn.{n}.weight": (1 + 0.3 * rng.standard_normal(config["head_dim"])
                                                           ).astype(np.float32) for n in ("q_norm", "k_norm")})
    if flags.get("norm_before_fc"):
        tensors["input_norm.weight"] = (1 + 0.3 * rng.standard_normal(3 * et)).astype(np.float32)
    if flags.get("fc_norm"):
        tensors.update({f"fc_norm.{i}.weight": (1 + 0.3 * rng.standard_normal(et)).astype(np.float32)
                        for i in range(3)})
    own = ("architectures", "draft_vocab_size", "eagle_config")
    raw = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.3.0",
           "transformer_layer_config": {k: v for k, v in config.items() if k not in own},
           "draft_vocab_size": config["draft_vocab_size"], "norm_before_residual": False, **flags,
           "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                  "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": "target"}}}
    save_file({k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(raw))
    return tensors, str(path), {**config, **flags}


@pytest.fixture(scope="module")
def heads(checkpoint, tmp_path_factory) -> dict[str, tuple[dict, str, dict]]:
    """The random head as published: EAGLE's layout, and speculators' with each of its norm variants."""
    tensors, path = checkpoint
    out = {"eagle": (tensors, path, HEAD_CONFIG)}
    for name, flags in (("speculators", {}), ("norm_before_fc+norm_output", dict(norm_before_fc=True, norm_output=True)),
                        ("fc_norm", dict(fc_norm=True)), ("qwen3", dict(layer="qwen3"))):
        out[name] = write_speculators(tmp_path_factory.mktemp(name), tensors, HEAD_CONFIG, **flags)
    return out


def assert_aux_states(model, cfg, prompts: list[list[int]], layers: tuple[int, ...], want_states, *,
                      num_tokens: int, num_rows: int, width: int, bad_layers: tuple[int, ...]) -> None:
    """A target's forward with `aux_layers=layers` over `prompts` in one step: its logits and pool are the
    plain forward's, each prompt's states are `want_states(ids)` [len(ids), len(layers) * E] within 1e-4
    (float32), and `bad_layers` and pipeline stages are refused."""
    rows, pages = [], iter(range(1, 100))
    for ids in prompts:
        rows.append((list(range(len(ids))), [next(pages) for _ in range(-(-len(ids) // PS))]))
    meta = make_meta(rows, num_tokens=num_tokens, num_rows=num_rows, width=width)
    tokens = jnp.asarray(np.concatenate([np.concatenate(prompts), np.zeros(num_tokens - sum(map(len, prompts)), int)]))
    kv = (jnp.zeros((cfg.num_layers, 12, PS, cfg.num_kv_heads, cfg.head_dim)),) * 2
    ends = np.cumsum([len(p) for p in prompts]) - 1
    last = jnp.asarray(np.concatenate([ends, np.zeros(num_rows - len(prompts), int)]))
    logits, kv_aux, aux = model(tokens, kv, meta, last, attn_impl="reference", aux_layers=layers)
    plain_logits, kv_plain = model(tokens, kv, meta, last, attn_impl="reference")
    np.testing.assert_array_equal(logits, plain_logits)  # asking for aux states changes nothing else
    np.testing.assert_array_equal(kv_aux[0], kv_plain[0])
    assert aux.shape == (num_tokens, len(layers) * cfg.hidden_size)
    off = 0
    for ids in prompts:
        want = want_states(ids)
        np.testing.assert_allclose(np.asarray(aux[off:off + len(ids)]), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
        off += len(ids)
    with pytest.raises(ConfigError, match="strictly increasing"):
        model(tokens, kv, meta, last, attn_impl="reference", aux_layers=bad_layers)
    with pytest.raises(ConfigError, match="not across stages"):  # (tp / ep meshes: test_eagle3_on_a_tp_mesh_...)
        model(tokens, kv, meta, last, attn_impl="reference", aux_layers=layers, plan=SimpleNamespace(num_stages=2))


def test_aux_hidden_states_equal_hf_hidden_states(smol, target, hf_smol):
    cfg = smol.config
    layers = (2, cfg.num_layers // 2, cfg.num_layers - 3)
    prompts = [smol.tokenizer.encode("The history of the Roman Empire begins with the founding of"),
               smol.tokenizer.encode("def fibonacci(n):")]

    def want(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            hf = hf_smol(torch.tensor([ids]), output_hidden_states=True).hidden_states
        return np.concatenate([hf[i][0].numpy() for i in layers], axis=-1)

    assert_aux_states(target, cfg, prompts, layers, want, num_tokens=32, num_rows=3, width=4, bad_layers=(15, 2, 27))


@pytest.mark.parametrize("layout", ["eagle", "norm_before_fc+norm_output", "fc_norm", "qwen3"])
def test_head_matches_float64_reference_through_paged_steps(heads, layout):
    """Three calls on three rows with pages spread over the pool: prefills, a verification where
    only some catch-up tokens were accepted (their KV slots are scratch), a page boundary, and a row
    whose chain runs past its pages. Every draft equals the reference's greedy chain over the
    accepted sequence, recomputed from scratch, and the logits agree to float32 accuracy. Also in the
    speculators layout with a norm before fc (over the three states, or over each) and the normed state
    passed between drafts, and with a Qwen3 decoder layer (q/k norms)."""
    tensors, path, config = heads[layout]
    head = load_eagle3(path, SMOL)
    rng = np.random.default_rng(1)
    embed = (0.5 * rng.standard_normal((49152, 576))).astype(np.float32)
    ref = ReferenceEagle3(tensors, config, embed)
    k = 4
    pages = {0: [5, 17, 3, 9], 1: [11, 2], 2: [30]}
    seqs = {r: ([], []) for r in pages}  # accepted (token, aux hidden) per position
    calls = [  # per row: (first catch-up position, number of catch-up tokens, number accepted)
        {0: (0, 19, 19), 1: (0, 5, 5), 2: (0, 1, 1)},
        {0: (19, 4, 2), 1: (5, 2, 2), 2: (1, 3, 1)},
        {0: (21, 3, 3), 1: (7, 3, 3), 2: (2, 6, 6)},
    ]
    propose = jit_propose(head, k)
    kv = (jnp.zeros((1, 40, PS, 3, 64)),) * 2
    for call in calls:
        rows, tokens, hidden, last = [], [], [], []
        for r, (start, n, accepted) in call.items():
            toks = rng.integers(0, 49152, n)
            hid = rng.standard_normal((n, 3 * 576)).astype(np.float32)
            seqs[r][0].extend(toks[:accepted])
            seqs[r][1].extend(hid[:accepted])
            last.append(len(tokens) + accepted - 1)
            rows.append((list(range(start, start + n)), pages[r]))
            tokens.extend(toks)
            hidden.extend(hid)
        t = 48
        meta = make_meta(rows, num_tokens=t, num_rows=4, width=4)
        pad = t - len(tokens)
        out = propose(jnp.asarray(embed), kv, jnp.asarray(np.concatenate([tokens, np.zeros(pad, int)])),
                      jnp.asarray(np.concatenate([np.stack(hidden), np.zeros((pad, 3 * 576), np.float32)])), meta,
                      jnp.asarray(last + [0]))
        kv = out.kv
        for r in call:
            drafts, logits = ref.greedy_chain(np.asarray(seqs[r][0]), np.stack(seqs[r][1]), k)
            exact = k if r != 2 or call[2][0] < 2 else 2  # row 2's last call drafts past its page from draft 3
            assert list(np.asarray(out.token_ids[r, :exact])) == drafts[:exact], (call, r)
            np.testing.assert_allclose(out.draft_logits[r, :exact], logits[:exact], rtol=1e-4, atol=1e-4)
            np.testing.assert_array_equal(np.asarray(out.probs[r, np.arange(k), out.token_ids[r]]), 1.0)
    untouched = sorted(set(range(1, 40)) - {p for ps in pages.values() for p in ps})
    assert not np.asarray(kv[0][0, untouched]).any() and not np.asarray(kv[1][0, untouched]).any()


def test_sampled_drafts_come_with_the_distribution_they_were_drawn_from(checkpoint):
    tensors, path = checkpoint
    head = load_eagle3(path, SMOL)
    rng = np.random.default_rng(2)
    embed = jnp.asarray((0.5 * rng.standard_normal((49152, 576))).astype(np.float32))
    meta = make_meta([([0, 1, 2], [1]), ([0, 1], [2])], num_tokens=8, num_rows=2, width=2)
    tokens = jnp.asarray(rng.integers(0, 49152, 8))
    hidden = jnp.asarray(rng.standard_normal((8, 3 * 576)).astype(np.float32))
    kv = (jnp.zeros((1, 4, PS, 3, 64)),) * 2
    temperature = jnp.asarray([0.7, 0.0])
    out = jit_propose(head, 3, temperature=temperature, key=jax.random.key(0))(
        embed, kv, tokens, hidden, meta, jnp.asarray([2, 4]))
    greedy = jit_propose(head, 3)(embed, kv, tokens, hidden, meta, jnp.asarray([2, 4]))
    assert list(out.token_ids[1]) == list(greedy.token_ids[1])  # temperature 0 drafts greedily
    in_draft_vocab = np.zeros(49152, bool)
    in_draft_vocab[np.arange(8192) + tensors["d2t"]] = True
    probs = np.asarray(out.probs)
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
    assert not probs[..., ~in_draft_vocab].any()
    assert (probs[0, np.arange(3), np.asarray(out.token_ids[0])] > 0).all()
    want = jax.nn.softmax(out.draft_logits[0] / 0.7, axis=-1)
    np.testing.assert_allclose(probs[0][:, np.arange(8192) + tensors["d2t"]], want, rtol=1e-5, atol=1e-7)


def test_pallas_kernels_draft_as_the_reference_does(checkpoint):
    """The GPU path's kernels (interpreted) under the same metadata, chain steps included."""
    head = load_eagle3(checkpoint[1], SMOL)
    rng = np.random.default_rng(4)
    embed = jnp.asarray((0.5 * rng.standard_normal((49152, 576))).astype(np.float32))
    meta = make_meta([(list(range(11)), [3, 5]), ([0, 1, 2], [7])], num_tokens=16, num_rows=4, width=2)
    args = (embed, (jnp.zeros((1, 9, PS, 3, 64)),) * 2, jnp.asarray(rng.integers(0, 49152, 16)),
            jnp.asarray(rng.standard_normal((16, 3 * 576)).astype(np.float32)), meta, jnp.asarray([10, 13, 0, 0]))
    graphdef, state = nnx.split(head)
    outs = [jax.jit(lambda state, *a, impl=impl: eagle3_propose(nnx.merge(graphdef, state), *a, num_draft=3,
                                                                attn_impl=impl))(state, *args)
            for impl in ("reference", "pallas_interpret")]
    np.testing.assert_array_equal(outs[0].token_ids[:2], outs[1].token_ids[:2])
    np.testing.assert_allclose(outs[0].draft_logits[:2], outs[1].draft_logits[:2], rtol=1e-4, atol=1e-4)
    jaxpr = jax.make_jaxpr(lambda state, *a: eagle3_propose(nnx.merge(graphdef, state), *a, num_draft=3,
                                                           attn_impl="pallas_interpret"))(state, *args).jaxpr
    kernels = ["write_kv_pages", "paged_decode_attention", "paged_prefill_attention"]
    assert pallas_kernel_names(jaxpr) == kernels + kernels[:2]  # the chained steps: a token a row, no prefill


def test_loader_reads_variants_and_names_what_is_wrong(checkpoint, heads, tmp_path):
    from infire_jax.speculative.config import SpeculativeConfig

    tensors, path = checkpoint
    head = load_eagle3(path, SMOL)
    np.testing.assert_array_equal(head.d2t[...], tensors["d2t"])
    np.testing.assert_array_equal(head.fc[...], tensors["fc.weight"].T)
    assert head.cfg.aux_layers(30) == (2, 15, 27) and not hasattr(head, "embed")

    # SpecForge's names, its own embedding, aux ids of layer outputs, no t2d.
    spec = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items() if k != "t2d"}
    spec["embed_tokens.weight"] = np.ones((49152, 576), np.float32)
    cfg = dict(HEAD_CONFIG, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 14, 26]})
    (tmp_path / "specforge").mkdir()
    head = load_eagle3(write_checkpoint(tmp_path / "specforge", spec, cfg), SMOL)
    assert head.cfg.aux_layers(30) == (2, 15, 27) and head.embed.shape == (49152, 576)

    def refused(tensors, config, match, target=SMOL):
        d = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        with pytest.raises(UnsupportedModelError, match=match):
            load_eagle3(write_checkpoint(d, tensors, config), target)

    refused({k: v for k, v in tensors.items() if k != "norm.weight"}, HEAD_CONFIG, "lacks \\['final_norm'\\]")
    short_head = dict(tensors, **{"lm_head.weight": tensors["lm_head.weight"][:100]})
    refused(short_head, HEAD_CONFIG, "'lm_head.weight' has shape")
    refused(dict(tensors, extra=np.zeros(1)), HEAD_CONFIG, "unexpected weight 'extra'")
    refused(tensors, dict(HEAD_CONFIG, vocab_size=32000), "vocab_size is 32000")
    refused(tensors, HEAD_CONFIG, "hidden_size", target=ModelConfig("llama", 49152, 960, 2560, 32, 15, 5, 64))
    refused(dict(tensors, d2t=np.zeros(8192, np.int64) + 5 * (np.arange(8192) % 2)), HEAD_CONFIG, "one-to-one")
    refused(tensors, dict(HEAD_CONFIG, num_hidden_layers=2), "num_hidden_layers=2")

    # speculators' layout: the same head; its method and draft count from its config unless given
    plain, same = (load_eagle3(p, SMOL) for p in (path, heads["speculators"][1]))
    for (name, a), (_, b) in zip(nnx.to_flat_state(nnx.state(plain)), nnx.to_flat_state(nnx.state(same))):
        np.testing.assert_array_equal(a.get_value(), b.get_value(), err_msg=str(name))
    # `infire-jax plan` places the head (whole, its d2t table too) and its pool per token as the engine does
    from infire_jax.memplan.plan import memory_plan, parse_bytes
    from infire_jax.memplan.source import plan_source
    from infire_jax.speculative.plan import draft_head_for
    from infire_jax.speculative.head_proposer import HeadProposer
    from sharding.mesh import CONFIG_DIR, MeshConfig

    mc = MeshConfig.from_yaml(os.path.join(CONFIG_DIR, "1.yaml"))
    spec = {"method": "eagle3", "model": path, "num_speculative_tokens": 3}
    without, planned = (memory_plan(plan_source(None, "float32", draft_head=sc and draft_head_for(sc, "float32"))(mc), mc, parse_bytes("1GB"),
                                    dtype="float32") for sc in (None, spec))
    assert planned.weights["speculation"] == sum(v.get_value().nbytes for _, v in nnx.to_flat_state(nnx.state(plain)))
    assert (planned.kv_bytes_per_token - without.kv_bytes_per_token) * PS == HeadProposer.page_bytes(plain, PS,
                                                                                                     np.float32)
    with pytest.raises(ValueError, match="'draft_model' is not planned"):
        draft_head_for(dict(spec, method="draft_model"), "float32")

    sc = SpeculativeConfig.parse({"model": heads["speculators"][1]})
    assert (sc.method, sc.num_speculative_tokens) == ("eagle3", 3)
    assert SpeculativeConfig.parse({"model": heads["speculators"][1], "num_speculative_tokens": 5}).num_speculative_tokens == 5
    with pytest.raises(ConfigError, match="method is required"):
        SpeculativeConfig.parse({"model": path, "num_speculative_tokens": 3})  # EAGLE's layout names none
    with open(os.path.join(heads["fc_norm"][1], "config.json")) as f:
        raw = json.load(f)
    for change, match in ((dict(speculators_model_type="mlp"), "speculators_model_type 'mlp'"),
                          (dict(transformer_layer_config=dict(raw["transformer_layer_config"], model_type="mistral")),
                           "model_type 'mistral'"),
                          (dict(transformer_layer_config=dict(raw["transformer_layer_config"], use_sliding_window=True)),
                           "sliding-window"), (dict(norm_before_fc=True), "exclude each other")):
        d = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps(dict(raw, **change)))
        save_file({k.replace("midlayer.", "layers.0."): v for k, v in heads["fc_norm"][0].items()},
                  str(d / "model.safetensors"))
        with pytest.raises(UnsupportedModelError, match=match):
            load_eagle3(str(d), SMOL)


def test_greedy_speculation_reproduces_greedy_decoding(smol, target, tmp_path):
    """Target verification with aux states, head catch-up and chain: the tokens are plain greedy's,
    and the head's pool, kept incrementally across acceptances, equals one catch-up over the whole
    final sequence at every position up to the last accepted one. The prompt's greedy continuation
    is " 1, 1, 1," and the head drafts among its three tokens, so some drafts are accepted."""
    cfg, k, new = smol.config, 3, 16
    prompt = smol.tokenizer.encode("1, 1, 2, 1, 1, 2, 1, 1, 2, 1, 1,")
    draft_ids = sorted(set(smol.tokenizer.encode(" 1, 1,")))
    config = dict(HEAD_CONFIG, draft_vocab_size=len(draft_ids))
    head = load_eagle3(write_checkpoint(tmp_path, random_checkpoint(3, draft_ids=draft_ids), config), cfg)
    layers = head.cfg.aux_layers(cfg.num_layers)
    pages = list(range(1, 10))
    graphdef, state = nnx.split(target)
    forward = jax.jit(lambda state, *args: nnx.merge(graphdef, state)(*args, attn_impl="reference", aux_layers=layers))
    propose = jit_propose(head, k)
    embed = target.embed[...]

    def run_target(kv, toks, start):
        meta = make_meta([(list(range(start, start + len(toks))), pages)], num_tokens=len(toks), num_rows=1, width=9)
        logits, kv, aux = forward(state, jnp.asarray(toks), kv, meta, jnp.arange(len(toks)))
        return np.asarray(logits).argmax(-1), kv, aux, meta

    pool = (jnp.zeros((cfg.num_layers, 10, PS, cfg.num_kv_heads, cfg.head_dim)),) * 2
    greedy_pool, seq = pool, list(prompt)
    best, greedy_pool, _, _ = run_target(greedy_pool, seq, 0)
    seq.append(int(best[-1]))
    while len(seq) < len(prompt) + new:
        best, greedy_pool, _, _ = run_target(greedy_pool, seq[-1:], len(seq) - 1)
        seq.append(int(best[-1]))

    head_kv = (jnp.zeros((1, 10, PS, 3, 64)),) * 2
    best, pool, aux, meta = run_target(pool, prompt, 0)
    out = list(prompt) + [int(best[-1])]
    prop = propose(embed, head_kv, jnp.asarray(out[1:]), aux, meta, jnp.asarray([len(prompt) - 1]))
    head_kv = prop.kv
    accepted_counts = []
    while len(out) < len(prompt) + new:
        drafts = [int(t) for t in prop.token_ids[0]]
        start = len(out) - 1
        best, pool, aux, meta = run_target(pool, [out[-1]] + drafts, start)
        accepted = 0
        while accepted < k and drafts[accepted] == best[accepted]:
            accepted += 1
        out += drafts[:accepted] + [int(best[accepted])]
        accepted_counts.append(accepted)
        catch_up = drafts + [0]
        catch_up[accepted] = int(best[accepted])
        prop = propose(embed, head_kv, jnp.asarray(catch_up), aux, meta, jnp.asarray([accepted]))
        head_kv = prop.kv
    assert out[:len(seq)] == seq
    assert min(accepted_counts) == 0 < max(accepted_counts)  # both paths taken

    last = len(out) - 2  # the last position the head has caught up to
    _, _, aux, meta = run_target((jnp.zeros_like(pool[0]),) * 2, out[:last + 1], 0)
    fresh = propose(embed, (jnp.zeros((1, 10, PS, 3, 64)),) * 2, jnp.asarray(out[1:last + 2]), aux, meta,
                    jnp.asarray([last])).kv
    slots = np.asarray(pages)[np.arange(last + 1) // PS] * PS + np.arange(last + 1) % PS

    def at_slots(pool):
        return np.asarray(pool[0]).reshape(-1, 3, 64)[slots]

    for a, b in zip(head_kv, fresh):
        np.testing.assert_allclose(at_slots(a), at_slots(b), rtol=1e-4, atol=1e-4)



def test_engine_serves_eagle3_losslessly(smol_llm, tmp_path):
    """The head wired into the engine (observing every step, drafting for every row): greedy output
    equals the engine without speculation, proposals are both accepted and rejected, nothing
    compiles after warmup and every page comes back."""
    from conftest import SMALL_ENGINE

    from infire_jax import LLM
    from infire_jax.sample.sampling_params import SamplingParams

    prompt = "1, 1, 2, 1, 1, 2, 1, 1, 2, 1, 1,"
    draft_ids = sorted(set(smol_llm.tokenizer.encode(" 1, 1,")))
    path = write_checkpoint(tmp_path, random_checkpoint(3, draft_ids=draft_ids),
                            dict(HEAD_CONFIG, draft_vocab_size=len(draft_ids)))
    # Its steps (3 rows, up to 3 drafts each) take the 4- and the 64-token bucket; with up to 4 rows it
    # compiles no 8-token bucket's forwards and no verifier or sampler of 8 rows, which it would not run.
    engine = dict(SMALL_ENGINE, max_num_seqs=4, token_buckets=(4, 64))
    llm = LLM(**engine, speculative_config={"method": "eagle3", "model": path, "num_speculative_tokens": 3,
                                            "disable_by_batch_size": 8})
    prompts = [prompt, "Write a short poem about the sea.", "List the numbers from 1 to 30 separated by commas:"]
    params = SamplingParams(max_tokens=30, temperature=0)
    for w, g in zip(smol_llm.generate(prompts, params), llm.generate(prompts, params)):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
    e = llm.engine
    s = e.spec.stats
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens
    sampled = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=1.0, top_k=20, seed=5))
    assert all(len(o.outputs[0].token_ids) == 12 or o.outputs[0].finish_reason == "stop" for o in sampled)
    assert e.compiles_since_warmup == 0
    assert e.kv.num_free_pages == e.kv.num_usable_pages


def test_eagle3_drafts_for_a_target_kept_quantized(tmp_path):
    """The default model served as its file keeps it (`weights_quantization="gguf"`: Q4_1 / Q8_0 blocks
    dequantized in the layer scan): the head reads that target's hidden states, and greedy output equals
    the same target's without speculation, with drafts both accepted and rejected."""
    from conftest import SMALL_ENGINE

    from infire_jax import LLM
    from infire_jax.sample.sampling_params import SamplingParams

    engine = dict(SMALL_ENGINE, max_num_seqs=4, token_buckets=(4, 64), weights_quantization="gguf")
    plain = LLM(**engine)
    prompts = ["1, 1, 2, 1, 1, 2, 1, 1, 2, 1, 1,", "List the numbers from 1 to 30 separated by commas:"]
    params = SamplingParams(max_tokens=30, temperature=0)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    draft_ids = sorted(set(plain.tokenizer.encode(" 1, 1,")))
    plain.engine.close()
    path = write_checkpoint(tmp_path, random_checkpoint(3, draft_ids=draft_ids),
                            dict(HEAD_CONFIG, draft_vocab_size=len(draft_ids)))
    llm = LLM(**engine, speculative_config={"method": "eagle3", "model": path, "num_speculative_tokens": 3,
                                            "disable_by_batch_size": 8})
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
        s = llm.engine.spec.stats
        assert 0 < s.num_accepted_tokens < s.num_draft_tokens
        assert llm.engine.compiles_since_warmup == 0 and llm.engine.kv.num_free_pages == llm.engine.kv.num_usable_pages
    finally:
        llm.engine.close()


def test_catch_up_tokens_follow_each_position():
    """The head's input after each token: the row's next token; at a sampling row's last accepted
    position the sampled token; at the end of a prompt chunk the next prompt token."""
    from infire_jax.speculative.head_proposer import catch_up_tokens

    # rows: a prompt's last chunk (samples 13), a chunk inside a prompt (next prompt token 77),
    # a verifying row [t, d1, d2, d3] that accepted d1 and then sampled 9; then padding.
    tokens = jnp.array([10, 11, 12, 20, 21, 30, 31, 32, 33, 0, 0, 0])
    meta = make_meta([([0, 1, 2], [1]), ([0, 1], [2]), ([4, 5, 6, 7], [3])], num_tokens=12, num_rows=4, width=1)
    shifted, last = catch_up_tokens(tokens, meta, jnp.array([True, False, True, False]), jnp.array([0, 77, 0, 0]),
                                    jnp.array([0, 0, 3, 0]), jnp.array([13, 0, 9, 0]), jnp.array([1, 1, 2, 1]))
    assert np.asarray(shifted)[:9].tolist() == [11, 12, 13, 21, 77, 31, 9, 33, 9]
    assert np.asarray(last)[:3].tolist() == [2, 4, 6]


def hf_states(model, tokens: list[int], indices: tuple[int, ...]) -> np.ndarray:
    """HF's residual stream at `hidden_states` indices over `tokens`, [N, len(indices) * E] float64. Index
    L is the last layer's output before the final norm (HF's `hidden_states[L]` is after it): a hook reads it."""
    layers = model.model.layers
    caught = []
    hook = layers[len(layers) - 1].register_forward_hook(
        lambda module, args, out: caught.append(out[0] if isinstance(out, tuple) else out))
    try:
        with torch.no_grad():
            states = model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    return np.concatenate([(caught[0] if i == len(layers) else states[i])[0].double().numpy() for i in indices], -1)


def attentive(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The head with its attention sharpened (q, k x 4) and carrying most of its output (o x 20): a key
    or value read from a wrong page then changes its drafts."""
    scale = {f"midlayer.self_attn.{p}.weight": f for p, f in (("q_proj", 4.0), ("k_proj", 4.0), ("o_proj", 20.0))}
    return {name: w * scale.get(name, 1.0) if w.dtype.kind == "f" else w for name, w in tensors.items()}


def record_proposals(engine) -> list[tuple[list[int], list[int]]]:
    """Every proposal the engine's EAGLE-3 head hands out, with its request's tokens then."""
    records, propose = [], engine.draft.propose

    def recording(reqs, ks):
        out = propose(reqs, ks)
        records.extend((r.all_token_ids, drafts) for r, drafts in zip(reqs, out))
        return out

    engine.draft.propose = recording
    return records


def assert_first_drafts_are_the_references(records, finals: list[list[int]], tensors: dict, config: dict,
                                           embed: np.ndarray, states) -> None:
    """Each recorded proposal's first draft is the float64 reference head's greedy draft over the request's
    tokens so far, fed the target's states (`states(final sequence)`, [N, 3E]): its catch-up KV, written over
    the steps through the engine's page tables, is exact (later drafts may chain into the null page). Where
    they differ, the reference's logits must tie within 1e-4."""
    ref = ReferenceEagle3(tensors, config, embed)
    draft_to_target = list(np.arange(len(tensors["d2t"])) + tensors["d2t"])
    cache, checked = {}, 0
    for tokens, drafts in records:
        if not drafts:
            continue
        final = next(f for f in finals if f[:len(tokens)] == tokens)
        if tuple(final) not in cache:
            cache[tuple(final)] = states(final)
        n = len(tokens)
        want, logits = ref.greedy_chain(np.asarray(final[1:n]), cache[tuple(final)][:n - 1], 1)
        if drafts[0] != want[0]:
            got = draft_to_target.index(drafts[0])
            assert logits[0].max() - logits[0][got] < 1e-4, (n, drafts, want, logits[0])
        checked += 1
    assert checked >= len(finals) * 5


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
def test_engine_serves_eagle3_beside_sliding_window_layers(family, tmp_path_factory, tmp_path):
    """qwen3: sliding-window layers 0 and 1 before global layers 2 and 3, on the hybrid KV cache: the head's
    one (global) layer keeps its KV on the pages of group 0, the global layers' (the target's layer 0 is in
    a window group, whose table drops the pages before the window). mistral: every layer slides, so no
    group keeps every page and the head is refused, unless every page is kept (`hybrid_kv_cache=False`).
    Greedy tokens equal HF's over prompts and outputs past the window; each proposal's first draft is the
    reference head's on HF's states (aux ids: the layers' outputs, the last one's included); drafts are
    accepted and rejected, every page comes back, nothing compiles after warmup."""
    from collections import Counter

    from deepseek_models import hf_greedy
    from test_sliding_window_models import ENGINE, VOCAB, _prompts, _tiny_hf_dir

    from infire_jax import LLM
    from infire_jax.core.hybrid_kv_cache import HybridKVCacheManager
    from infire_jax.sample.sampling_params import SamplingParams

    path, hf = _tiny_hf_dir(tmp_path_factory, family)
    num_layers = len(hf.model.layers)
    ids = [0, 1, num_layers - 1]
    prompts = _prompts()
    want = [hf_greedy(hf, p, 48)[0] for p in prompts]
    draft_ids = sorted(t for t, _ in Counter(sum(want, [])).most_common(3))
    config = dict(HEAD_CONFIG, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=128, vocab_size=VOCAB, draft_vocab_size=len(draft_ids), rope_theta=10000.0,
                  eagle_config={"eagle_aux_hidden_state_layer_ids": ids})
    tensors = attentive(random_checkpoint(5, draft_ids=draft_ids, config=config))
    spec = {"method": "eagle3", "model": write_checkpoint(tmp_path, tensors, config), "num_speculative_tokens": 3,
            "acceptance_threshold": 0.0}  # no back-off: every step drafts
    # One 32-token bucket: the prompts still prefill in chunks of 32 (the budget), and every step, decodes
    # and verifications of 4 rows included, fits it; a 4-token bucket's forwards are not compiled for nothing.
    engine = dict(ENGINE, token_buckets=(32,))
    if family == "mistral":
        with pytest.raises(ConfigError, match="every layer of this model is chunked or sliding-window, so no group"):
            LLM(model=path, **engine, speculative_config=spec)
    llm = LLM(model=path, **engine, speculative_config=spec, hybrid_kv_cache=family != "mistral")
    e = llm.engine
    groups = e.runner.rc.kv_groups
    assert e.runner.rc.aux_layers == tuple(i + 1 for i in ids)
    if family == "qwen3":
        assert isinstance(e.kv, HybridKVCacheManager) and e.runner.rc.aux_layers == (1, 2, 4)
        assert [g.layers for g in groups.groups] == [(2, 3), (0, 1)] and groups.groups[1].bounded
    else:
        assert groups is None and e.model_config.local_attention == ((0, 16),) * num_layers
    records = record_proposals(e)
    outs = llm.generate(prompts, SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == want
    s = e.spec.stats
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens
    embed = hf.model.embed_tokens.weight.detach().numpy()
    assert_first_drafts_are_the_references(records, [p + w for p, w in zip(prompts, want)], tensors, config, embed,
                                           lambda seq: hf_states(hf, seq, e.runner.rc.aux_layers))
    assert e.compiles_since_warmup == 0 and e.kv.num_free_pages == e.kv.num_usable_pages
    e.close()


def test_eagle3_on_a_tp_mesh_drafts_as_one_device(smol_llm, tmp_path):
    """On a tp 3 mesh (the default model: 9 heads over 3 kv heads) the target's states come out of its
    shard_map whole and the head and its pool are replicated on every device: greedy tokens and logprobs equal
    one device's with the same head, and so does every proposal, accepted and rejected; nothing compiles after
    warmup (tp x ep: tests/test_llama4.py's Llama 4, tests/test_mtp.py). A pipeline mesh, whose stages hold
    different layers' states, and a draft model on a mesh are refused by name."""
    from test_sharding import CONFIG_DIR, ENGINE, _results, _run_worker

    tk = smol_llm.tokenizer
    draft_ids = sorted(set(tk.encode(" 1, 1,")))
    smol_head = write_checkpoint(tmp_path, random_checkpoint(3, draft_ids=draft_ids),
                                 dict(HEAD_CONFIG, draft_vocab_size=len(draft_ids)))
    tp3 = tmp_path / "3.yaml"
    tp3.write_text(json.dumps({"mesh": {"dp": 1, "pp": 1, "tp": 3, "ep": 1}, "rules": {
        "vocab": "tp", "q_heads": "tp", "kv_heads": "tp", "mlp": "tp", "experts": None, "layers": None}}))

    def run(model, mesh, tag, head=smol_head, method="eagle3"):
        return {"model": model, "mesh": mesh if os.path.isabs(mesh) else os.path.join(CONFIG_DIR, f"{mesh}.yaml"),
                "tag": tag, "speculative_config": {"method": method, "model": head, "num_speculative_tokens": 3}}

    runs = [run(None, "1", "smol-1"), run(None, str(tp3), "smol-3"), run(None, "2-pp2", "pp"),
            run(None, str(tp3), "draft-model", smol_llm.engine.model_name, "draft_model")]
    prompts = ["1, 1, 2, 1, 1, 2, 1, 1, 2, 1, 1,", "List the numbers from 1 to 30 separated by commas:"]
    results = {r["tag"]: r for r in _results(_run_worker({"runs": runs, "prompts": prompts, "max_tokens": 24,
                                                          "engine": ENGINE}, 8, tmp_path, "eagle3-mesh"))}
    assert not results["pp"]["fits"] and "pp=2" in results["pp"]["error"]
    assert not results["draft-model"]["fits"] and "'draft_model' runs on one device" in results["draft-model"]["error"]
    ref, r = results["smol-1"], results["smol-3"]
    assert r["fits"] and ref["fits"], (r.get("error"), ref.get("error"))
    assert r["tokens"] == ref["tokens"]
    np.testing.assert_allclose(r["logprobs"], ref["logprobs"], atol=1e-4, rtol=0)
    assert r["spec"]["proposals"] == ref["spec"]["proposals"] and r["spec"]["compiles"] == 0
    assert 0 < r["spec"]["accepted"] < r["spec"]["drafted"]
