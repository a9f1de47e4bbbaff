"""Engine behaviour on the real model: paged decode vs full recompute, batch invariance, the
no-recompile guard, and rejection of bad input."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infire_jax import LLM, SamplingParams
from infire_jax.lora.request import LoRARequest
from infire_jax.runner.compile_guard import RecompileError, forbid_compiles
from infire_jax.errors import InvalidRequestError, ModelNotFoundError, UnsupportedModelError
from pallas_kernels.metadata import AttentionMetadata

PROMPT = "A short story about a lighthouse keeper who finds a message in a bottle:"


def full_recompute_next_tokens(llm: LLM, ids: list[int], positions: range) -> list[int]:
    """The greedy token after each prefix `ids[:p + 1]`, p in `positions`, from one fresh forward over
    the whole sequence (no cached KV, nothing paged before it): attention is causal, so position p's
    logits see exactly the prefix up to p, as a forward over that prefix alone would."""
    model = llm.engine.runner.model()
    t, ps = len(ids), llm.engine.config.page_size
    n_pages = -(-t // ps)
    cfg = llm.engine.model_config
    pages = (jnp.zeros((cfg.num_layers, n_pages + 1, ps, cfg.num_kv_heads, cfg.head_dim), llm.engine.dtype),) * 2
    table = np.arange(1, n_pages + 1, dtype=np.int32)[None, :]
    pos = np.arange(t, dtype=np.int32)
    meta = AttentionMetadata(pos, table[0][pos // ps] * ps + pos % ps, np.zeros(t, np.int32), table,
                             np.array([t], np.int32), np.array([0, t], np.int32), np.int32(1))
    meta = jax.tree.map(jnp.asarray, meta)
    logits, _ = model(jnp.asarray(ids), pages, meta, jnp.asarray(list(positions)), attn_impl="reference")
    return np.asarray(jnp.argmax(logits, axis=-1)).tolist()


def test_paged_decode_equals_full_recompute(smol_llm):
    ids = smol_llm.tokenizer.encode(PROMPT)
    out = smol_llm.generate([ids], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 24
    # the token after the prompt, and after each of its first 23 generated tokens
    assert full_recompute_next_tokens(smol_llm, ids + out.token_ids, range(len(ids) - 1, len(ids) + 23)) == \
        out.token_ids


def test_results_do_not_depend_on_batch_or_padding(smol_llm):
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=3)
    alone = smol_llm.generate([PROMPT], params)[0]
    others = ["Hi", "Explain photosynthesis in detail, step by step, for a student.", "1 2 3 4 5 6 7",
              "The weather today", "Once upon a time in a land far away there lived"]
    mixed = smol_llm.generate(others[:2] + [PROMPT] + others[2:], params)[2]
    assert mixed.token_ids == alone.token_ids
    for a, b in zip(alone.logprobs, mixed.logprobs):
        assert a.keys() == b.keys()
        np.testing.assert_allclose([a[k].logprob for k in a], [b[k].logprob for k in a], atol=1e-4)


def test_long_prompt_is_prefilled_in_chunks(smol_llm):
    """A prompt several times the 64-token step budget gives the same tokens as the same
    prompt in an engine whose budget holds it in one chunk."""
    text = " ".join(["The quick brown fox jumps over the lazy dog."] * 20)
    ids = smol_llm.tokenizer.encode(text)
    assert len(ids) > 3 * smol_llm.engine.scheduler.max_num_batched_tokens
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    chunked = smol_llm.generate([ids], params)[0]
    big = LLM(dtype="float32", max_num_seqs=2, max_num_batched_tokens=256, token_buckets=(1, 2, 256),
              max_model_len=1024, num_kv_pages=129)  # two sequences' pages, not the CPU's default 1 GiB
    whole = big.generate([ids], params)[0]
    assert chunked.token_ids == whole.token_ids


def test_no_compilation_after_warmup(smol_llm):
    """A mixed stream of prompt lengths, batch sizes and sampling settings compiles nothing."""
    tok = smol_llm.tokenizer
    prompts = [tok.encode(" ".join(["word"] * n)) for n in (1, 5, 17, 40, 90, 200)]
    params = [
        SamplingParams(max_tokens=5, temperature=0),
        SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9, seed=1),
        SamplingParams(max_tokens=3, temperature=1.0, top_k=20, min_p=0.05, logprobs=5),
        SamplingParams(max_tokens=7, temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5,
                       frequency_penalty=0.5),
        SamplingParams(max_tokens=4, temperature=0, min_tokens=2, stop=["."]),
        SamplingParams(max_tokens=6, temperature=0, n=2),
    ]
    with forbid_compiles():
        for batch in (1, 3, 6):
            smol_llm.generate(prompts[:batch], params[:batch])
        smol_llm.generate(prompts[::-1], params)
    assert smol_llm.engine.compiles_since_warmup == 0


def test_compile_guard_detects_compilation():
    import jax

    with pytest.raises(RecompileError):
        with forbid_compiles():
            jax.jit(lambda x: x * 3 + 1)(np.arange(7)).block_until_ready()


@pytest.mark.parametrize("kwargs, param", [
    (dict(max_tokens=1.5), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=2.0), "min_p"),
    (dict(logprobs=21), "logprobs"),
    (dict(n=0), "n"),
    (dict(temperature="hot"), "temperature"),
    (dict(top_p=None), "top_p"),
    (dict(repetition_penalty="x"), "repetition_penalty"),
    (dict(presence_penalty=True), "presence_penalty"),
    (dict(stop=5), "stop"),
    (dict(stop_token_ids=7), "stop_token_ids"),
])
def test_bad_sampling_params_are_rejected(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param
    assert param in str(e.value)


def test_bad_prompts_are_rejected_and_engine_still_serves(smol_llm):
    with pytest.raises(InvalidRequestError, match="empty"):
        smol_llm.generate([""])
    with pytest.raises(InvalidRequestError, match="empty"):
        smol_llm.generate([[]])
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        smol_llm.generate([[1, 2, 10 ** 9]])
    too_long = [1] * smol_llm.engine.max_model_len
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        smol_llm.generate([too_long])
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        smol_llm.generate([[1] * 1000], SamplingParams(max_tokens=100))
    with pytest.raises(InvalidRequestError, match=r"lone surrogate \(U\+D800\) at character 3"):
        smol_llm.generate(["Hi \ud800"])
    with pytest.raises(InvalidRequestError, match="lone surrogate"):
        smol_llm.generate(["Hi"], SamplingParams(bad_words=["\udc00"]))
    for prompts in (None, 5, ["a", None], [1.5, 2.0]):  # the offline API's wrong types, named
        with pytest.raises(InvalidRequestError, match="prompt"):
            smol_llm.generate(prompts)
    with pytest.raises(InvalidRequestError, match="SamplingParams"):
        smol_llm.generate("Hi", {"max_tokens": 3})
    with pytest.raises(InvalidRequestError, match="messages"):
        smol_llm.chat("hello")
    # A bad prompt in a batch leaves the engine untouched; good requests still complete.
    with pytest.raises(InvalidRequestError):
        smol_llm.generate(["fine", ""])
    assert not smol_llm.engine.has_unfinished()
    assert smol_llm.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0))[0].token_ids
    assert smol_llm.engine.kv.usage == 0.0


def test_chat_takes_vllms_keywords(smol_llm, monkeypatch):
    """LLM.chat as vLLM's: numpy token ids and use_tqdm are taken; continue_final_message continues a
    prefilled answer (not with add_generation_prompt); lora_request reaches the engine (which serves
    none here); chat_template_kwargs and tools reach the template."""
    greedy = SamplingParams(max_tokens=6, temperature=0)
    ids = smol_llm.generate("Hi", greedy)[0].prompt_token_ids
    assert smol_llm.generate([np.asarray(ids)[i] for i in range(len(ids))], greedy, use_tqdm=False)[0].token_ids == \
        smol_llm.generate([ids], greedy)[0].token_ids
    prefilled = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color is"}]
    out = smol_llm.chat(prefilled, greedy, add_generation_prompt=False, continue_final_message=True)[0]
    text = smol_llm.tokenizer.decode(out.prompt_token_ids)
    assert text.endswith("Name a color.\nassistant\nThe color is")  # no end of turn, no new turn
    with pytest.raises(InvalidRequestError, match="continue_final_message"):
        smol_llm.chat(prefilled, greedy, continue_final_message=True)
    with pytest.raises(InvalidRequestError, match="serves no LoRA adapters"):
        smol_llm.chat(prefilled[:1], greedy, lora_request=LoRARequest("a", 1, "/nowhere"))
    tk, seen = smol_llm.engine.tokenizer, []
    render = tk.apply_chat_template
    monkeypatch.setattr(tk, "apply_chat_template", lambda messages, **kw: seen.append(kw) or render(messages, **kw))
    tools = [{"type": "function", "function": {"name": "f"}}]
    smol_llm.chat(prefilled[:1], greedy, tools=tools, chat_template_kwargs={"enable_thinking": False})
    assert seen == [{"enable_thinking": False, "tools": tools, "add_generation_prompt": True,
                     "continue_final_message": False}]


def test_token_buckets_flag_sets_the_compiled_step_sizes():
    """`--token-buckets 4 32` compiles those two step sizes, the last one the step budget unless it is
    given; buckets out of order, or not ending at the budget, are refused by name."""
    from infire_jax.cli import build_parser
    from infire_jax.engine.args import engine_config
    from infire_jax.engine.setup import resolve_settings
    from infire_jax.errors import ConfigError

    args = build_parser().parse_args(["serve", "--model", "dummy:smollm2-135m", "--max-num-seqs", "4",
                                      "--max-model-len", "64", "--token-buckets", "4", "32"])
    ec = engine_config(args, args.model[0])
    assert ec.enable_prefix_caching and ec.linear_state_snapshots is None
    off = build_parser().parse_args(["serve", "--no-enable-prefix-caching", "--linear-state-snapshots", "4"])
    assert (engine_config(off).enable_prefix_caching, engine_config(off).linear_state_snapshots) == (False, 4)
    settings = resolve_settings(ec, None)
    assert settings.max_num_batched_tokens == 32
    assert settings.runner_config.buckets.token_buckets == (4, 32)
    with pytest.raises(ConfigError, match="distinct, increasing and positive"):
        resolve_settings(dataclasses.replace(ec, token_buckets=(32, 4)), None)
    with pytest.raises(ConfigError, match=r"largest token bucket must equal max_num_batched_tokens \(64\)"):
        resolve_settings(dataclasses.replace(ec, max_num_batched_tokens=64), None)
    for field, value in (("max_model_len", 0), ("max_model_len", -5), ("num_kv_pages", 0)):
        with pytest.raises(ConfigError, match=f"{field} must be a positive integer, got {value}"):
            resolve_settings(dataclasses.replace(ec, **{field: value}), None)
    with pytest.raises(SystemExit) as e:  # as argparse refuses any bad flag, before anything loads
        build_parser().parse_args(["serve", "--port", "99999"])
    assert e.value.code == 2


def test_unknown_model_path_is_rejected(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not found"):
        LLM(model=str(tmp_path / "no-such-model.gguf"))
    with pytest.raises(ModelNotFoundError, match="unknown dummy"):
        LLM(model="dummy:no-such-config")


def test_unsupported_architecture_is_rejected(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        LLM(model=str(tmp_path))


def test_next_step_is_dispatched_before_the_previous_is_read_back(smol_llm, monkeypatch):
    """Asynchronous scheduling: the host plans and launches step N+1 before it waits for step N."""
    runner = smol_llm.engine.runner
    calls = []
    dispatch, fetch = runner.dispatch, runner.fetch

    def logged_dispatch(work):
        calls.append(f"dispatch x{max(sq.num_steps for sq in work.seqs)}")
        return dispatch(work)

    def logged_fetch(pending):
        calls.append("fetch")
        return fetch(pending)

    monkeypatch.setattr(runner, "dispatch", logged_dispatch)
    monkeypatch.setattr(runner, "fetch", logged_fetch)
    out = smol_llm.generate(["Count to ten:"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 6
    # The prompt, a decode burst of 4 steps, the last token's step; every read-back but the last
    # follows the launch of the next step.
    assert calls == ["dispatch x1", "dispatch x4", "fetch", "dispatch x1", "fetch", "fetch"]


def test_reset_prefix_cache_forgets_cached_prompts(smol_llm):
    """`LLM.reset_prefix_cache` (vLLM's): a repeated prompt takes its full pages from the cache, and
    after a reset computes them again."""
    ids = smol_llm.tokenizer.encode(PROMPT * 3)
    params = SamplingParams(max_tokens=1, temperature=0)
    smol_llm.generate([ids], params)
    page = smol_llm.engine.config.page_size
    assert smol_llm.generate([ids], params)[0].num_cached_tokens == (len(ids) - 1) // page * page
    assert smol_llm.reset_prefix_cache()
    assert smol_llm.generate([ids], params)[0].num_cached_tokens == 0
