"""Embeddings (runner="pooling", infire_jax/pooling/) on the real model: the pooled final hidden states
against HF transformers' `last_hidden_state` on the same weights, through chunked prefill, prefix-cache
hits, batches shared with generation, matryoshka sizes, and the settings' errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import SMALL_ENGINE
from infire_jax import LLM, PoolerConfig, PoolingParams, SamplingParams
from infire_jax.core.request import Request
from infire_jax.core.scheduler import ScheduledSeq
from infire_jax.engine.admission import pooling_run
from infire_jax.errors import ConfigError, InvalidRequestError
from infire_jax.loaders.pooler import declared_pooler
from infire_jax.pooling.plan import plan_pooling

SHORT = "The capital of France is"
# Over 64 tokens (the small engine's step budget): its prompt runs in several chunks.
LONG = ("The licenses for most software and other practical works are designed to take away your freedom to "
        "share and change the works. By contrast, the GNU General Public License is intended to guarantee your "
        "freedom to share and change all versions of a program, to make sure it remains free software. ") * 2


def hf_states(hf_smol, ids: list[int]) -> np.ndarray:
    """HF's final hidden states (after the final norm) of a prompt, float64 [T, E]."""
    with torch.no_grad():
        return hf_smol.model(torch.tensor([ids])).last_hidden_state[0].double().numpy()


def unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


def test_last_token_embeddings_match_hf(smol_llm, hf_smol):
    ids = smol_llm.tokenizer.encode("Token ids work too.")
    outs = smol_llm.embed([SHORT, LONG, ids])
    assert len(smol_llm.tokenizer.encode(LONG)) > SMALL_ENGINE["max_num_batched_tokens"]
    assert outs[2].prompt_token_ids == ids and len({o.request_id for o in outs}) == 3
    for o in outs:
        got = np.array(o.outputs.embedding)
        assert got.shape == (576,) and o.outputs.hidden_size == 576
        np.testing.assert_allclose(got, unit(hf_states(hf_smol, o.prompt_token_ids)[-1]), atol=2e-6)
        assert abs(np.linalg.norm(got) - 1) < 1e-6
    raw = smol_llm.embed(SHORT, PoolingParams(use_activation=False))[0].outputs.embedding
    np.testing.assert_allclose(raw, hf_states(hf_smol, outs[0].prompt_token_ids)[-1], rtol=1e-5, atol=1e-4)
    assert smol_llm.engine.kv.num_free_pages == smol_llm.engine.kv.num_usable_pages  # nothing held after


def test_embeddings_share_steps_with_generation(smol_llm):
    """Embedding rows in the same steps as generating ones: the generated tokens and the embeddings
    are each what they are alone (the pooling program reads only the rows it pools)."""
    prompts, params = ["Write a list of fruits:", "Once upon a time"], SamplingParams(max_tokens=12, temperature=0)
    alone = [o.outputs[0].token_ids for o in smol_llm.generate(prompts, params)]
    embedded_alone = [o.outputs.embedding for o in smol_llm.embed([LONG, SHORT])]
    e = smol_llm.engine
    gen = [e.add_request(p, params)[0] for p in prompts]
    emb = [e.add_request(p, PoolingParams())[0] for p in (LONG, SHORT)]
    tokens, vectors, mixed = {r: [] for r in gen}, {}, False
    while e.has_unfinished():
        deltas = e.step()
        mixed |= {d.request_id for d in deltas} >= {gen[0], emb[1]}
        for d in deltas:
            if d.request_id in tokens:
                tokens[d.request_id] += d.token_ids
            if d.embedding is not None:
                vectors[d.request_id] = d.embedding
    assert [tokens[r] for r in gen] == alone
    for r, want in zip(emb, embedded_alone):
        np.testing.assert_allclose(vectors[r], want, atol=1e-6)


def test_last_token_pooling_reads_a_prefix_hit(smol_llm, hf_smol):
    """A prompt whose pages the prefix cache holds computes only its last page, and pools the same."""
    first = smol_llm.embed(LONG)[0]
    hits = smol_llm.engine.kv.hits
    again = smol_llm.embed(LONG)[0]
    assert smol_llm.engine.kv.hits > hits
    np.testing.assert_allclose(again.outputs.embedding, first.outputs.embedding, atol=2e-6)


@pytest.fixture(scope="module")
def mean_llm():
    """MEAN pooling without normalising, with matryoshka sizes; the same programs as the shared engine's,
    loaded from the executable cache."""
    return LLM(**SMALL_ENGINE, pooler_config={"pooling_type": "MEAN", "use_activation": False,
                                              "matryoshka_dimensions": [64, 128]})


def test_mean_pooling_over_chunks_and_cached_pages(mean_llm, hf_smol):
    """MEAN averages every prompt position, across the prompt's chunks; a cached prefix is computed
    again (a hit may not skip positions it pools: Request.first_unscored)."""
    ids = mean_llm.tokenizer.encode(LONG)
    mean_llm.generate(LONG, SamplingParams(max_tokens=1))  # its pages now in the prefix cache
    hits = mean_llm.engine.kv.hits
    got = mean_llm.embed(LONG)[0].outputs.embedding
    assert mean_llm.engine.kv.hits == hits
    np.testing.assert_allclose(got, hf_states(hf_smol, ids).mean(axis=0), rtol=1e-5, atol=1e-5)
    part = mean_llm.embed(SHORT, PoolingParams(dimensions=64, use_activation=True))[0].outputs.embedding
    short = mean_llm.tokenizer.encode(SHORT)
    np.testing.assert_allclose(part, unit(hf_states(hf_smol, short).mean(axis=0)[:64]), atol=2e-6)
    with pytest.raises(InvalidRequestError, match="dimensions must be one of the model's sizes"):
        mean_llm.embed(SHORT, PoolingParams(dimensions=100))
    scored = mean_llm.score(SHORT, LONG)[0].outputs.score  # cosine, though the embeddings are not unit length
    means = [unit(hf_states(hf_smol, p).mean(axis=0)) for p in (short, ids)]
    assert scored == pytest.approx(means[0] @ means[1], abs=2e-6)


def test_cls_pooling_takes_the_first_position(hf_smol):
    llm = LLM(**SMALL_ENGINE, pooler_config=json.dumps({"pooling_type": "cls"}))
    assert llm.engine.pooler == PoolerConfig("CLS", True)
    got = llm.embed(LONG)[0]
    np.testing.assert_allclose(got.outputs.embedding, unit(hf_states(hf_smol, got.prompt_token_ids)[0]), atol=2e-6)


def test_positions_pooled_once(smol_llm):
    """A prompt computed again (a preemption) weighs no position a dispatched step already pooled."""
    req = Request("r", list(range(40)), SamplingParams(max_tokens=0), max_tokens=0, seed=0)
    req.pooling, req.pooling_type, req.pool_next = PoolingParams(), "MEAN", 20
    other = Request("o", [1, 2, 3], SamplingParams(), max_tokens=4, seed=0)
    seqs = [ScheduledSeq(other, 0, 3, True, False, True, 0), ScheduledSeq(req, 16, 24, False, False, True, 0)]
    plan = plan_pooling(seqs, 32)
    assert plan.rows == [1]
    np.testing.assert_array_equal(plan.weights, [0] * 3 + [0] * 4 + [1] * 20 + [0] * 5)
    np.testing.assert_array_equal(plan.token_rows[:27], [0] * 3 + [1] * 24)
    assert req.first_unscored == 20
    req.pooling_type = "LAST"
    assert req.first_unscored is None and plan_pooling(seqs, 32).weights.tolist().index(1) == 3 + 23
    assert plan_pooling(seqs[:1], 32) is None


def test_settings_and_requests_refused(smol_llm):
    for config, match in (({"runner": "bogus"}, "runner must be"),
                          ({"runner": "generate", "pooler_config": {"pooling_type": "MEAN"}}, "runner='pooling'"),
                          ({"pooler_config": {"pooling_type": "ALL"}}, "pooling_type must be one of"),
                          ({"pooler_config": {"softmax": True}}, "not softmax"),
                          ({"pooler_config": "{"}, "not valid JSON"),
                          ({"pooler_config": {"normalize": False}}, "use `use_activation` instead"),
                          ({"pooler_config": {"matryoshka_dimensions": [0]}}, "positive integers")):
        with pytest.raises(ConfigError, match=match):
            LLM(**{**SMALL_ENGINE, **config})
    with pytest.raises(InvalidRequestError, match="serves no embeddings"):
        pooling_run(PoolingParams(), None, "smol", 576)
    with pytest.raises(InvalidRequestError, match="does not support matryoshka"):
        smol_llm.embed(SHORT, PoolingParams(dimensions=64))
    with pytest.raises(InvalidRequestError, match="dimensions must be a positive integer"):
        PoolingParams(dimensions=0)
    assert smol_llm.embed(SHORT, PoolingParams(dimensions=576))[0].outputs.hidden_size == 576


def test_score_is_the_cosine_of_hf_embeddings(smol_llm, hf_smol):
    """vLLM's LLM.score for an embedding model: one first text against each second, else in pairs."""
    docs = ["Paris is the capital of France.", "Bananas are yellow.", LONG]
    tok = smol_llm.tokenizer
    want = [unit(hf_states(hf_smol, tok.encode(t))[-1]) for t in [SHORT, *docs]]
    out = smol_llm.score(SHORT, docs)
    assert [o.prompt_token_ids for o in out] == [tok.encode(SHORT) + tok.encode(d) for d in docs]
    np.testing.assert_allclose([o.outputs.score for o in out], [want[0] @ w for w in want[1:]], atol=2e-6)
    paired = smol_llm.score([SHORT, docs[1]], [docs[0], docs[2]])
    np.testing.assert_allclose([o.outputs.score for o in paired], [want[0] @ want[1], want[2] @ want[3]], atol=2e-6)
    with pytest.raises(InvalidRequestError, match="give one data_1 text, or as many as data_2"):
        smol_llm.score([SHORT, SHORT], docs)


def test_checkpoint_declares_its_pooling(tmp_path):
    """A sentence-transformers directory's Pooling and Normalize modules, and config.json's sizes."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "matryoshka_dimensions": [32, 64]}))
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    declared = declared_pooler(str(tmp_path))
    assert declared == {"matryoshka_dimensions": (32, 64), "use_activation": False, "pooling_type": "MEAN"}
    assert PoolerConfig.parse({"use_activation": True}, declared) == PoolerConfig("MEAN", True, (32, 64))
    assert declared_pooler("model.gguf") == {} and PoolerConfig.parse(None) == PoolerConfig()
