"""The model's generation_config.json as sampling defaults (vLLM's --generation-config): read and
checked (sample/generation_config.py), offline (LLM.get_default_sampling_params) and over HTTP, where
a field the request leaves unset takes the default and max_new_tokens caps max_tokens."""

from __future__ import annotations

import json

import openai
import pytest

from server_utils import MODEL, AppThread, post_json

from infire_jax.errors import ConfigError
from infire_jax.sample.generation_config import sampling_defaults
from infire_jax.sample.sampling_params import SamplingParams


def _folder(tmp_path, config: dict) -> str:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_the_files_sampling_fields_become_defaults(tmp_path, default_gguf):
    folder = _folder(tmp_path, {"bos_token_id": 1, "eos_token_id": [2, 3], "do_sample": True, "temperature": 0.6,
                                "top_p": 0.95, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.0,
                                "max_new_tokens": 512})
    # repetition_penalty 1.0 is transformers' own default, so vLLM reads no default from it
    want = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "max_tokens": 512}
    assert sampling_defaults(folder) == want  # auto: the model folder's file
    assert sampling_defaults(default_gguf, folder) == want  # a folder named: its file
    assert sampling_defaults(folder, "vllm") == {}
    assert sampling_defaults(default_gguf) == {} and sampling_defaults(None) == {} and sampling_defaults("dummy:x") == {}
    assert sampling_defaults(folder, override={"temperature": 0.2}) == want | {"temperature": 0.2}
    assert sampling_defaults(folder, "vllm", '{"top_k": 5, "num_beams": 4}') == {"top_k": 5}
    # transformers' default top_k of 50 is no default either (vLLM reads the file's difference from it)
    assert sampling_defaults(_folder(tmp_path, {"top_k": 50, "temperature": 0.7})) == {"temperature": 0.7}


@pytest.mark.parametrize("source, override, named", [
    ("/nonexistent/folder", None, "no generation_config.json"),
    ("auto", '{"top_p": 2}', "top_p"),
    ("auto", '{"temperature": "hot"}', "temperature"),
    ("auto", "{not json", "not JSON"),
    ("auto", "[1]", "JSON object"),
    ("", None, "'auto', 'vllm' or a folder"),
])
def test_bad_generation_configs_are_refused_by_name(tmp_path, source, override, named):
    with pytest.raises(ConfigError, match=named):
        sampling_defaults(str(tmp_path), source, override)


def test_a_bad_file_is_refused_by_name(tmp_path):
    (tmp_path / "generation_config.json").write_text("{")
    with pytest.raises(ConfigError, match="generation_config.json cannot be read"):
        sampling_defaults(str(tmp_path))
    for bad in (-1, 0, 2.5):  # 0 would end every request at once
        with pytest.raises(ConfigError, match="max_new_tokens must be an integer >= 1"):
            sampling_defaults(_folder(tmp_path, {"max_new_tokens": bad}))


def test_the_flags(tmp_path):
    from infire_jax.cli import build_parser
    from infire_jax.engine.args import engine_config

    args = build_parser().parse_args(["serve", "--generation-config", "vllm",
                                      "--override-generation-config", '{"temperature": 0.3}'])
    ec = engine_config(args)
    assert (ec.generation_config, ec.override_generation_config) == ("vllm", '{"temperature": 0.3}')
    assert engine_config(build_parser().parse_args(["serve"])).generation_config == "auto"


@pytest.fixture(scope="module")
def defaults_llm(smol_llm):
    """The shared engine with a generation config's defaults: greedy, 5 tokens at most."""
    engine = smol_llm.engine
    kept = engine.sampling_defaults
    engine.sampling_defaults = {"temperature": 0.0, "top_p": 0.9, "max_tokens": 5}
    yield smol_llm
    engine.sampling_defaults = kept


def test_offline_defaults(defaults_llm):
    params = defaults_llm.get_default_sampling_params()
    assert (params.temperature, params.top_p, params.max_tokens, params.top_k) == (0.0, 0.9, 5, 0)
    prompt = "The capital of France is"
    out = defaults_llm.generate(prompt)[0].outputs[0]
    greedy = defaults_llm.generate(prompt, SamplingParams(temperature=0, top_p=0.9, max_tokens=5))[0].outputs[0]
    assert out.token_ids == greedy.token_ids and len(out.token_ids) == 5
    # given params are the caller's own, as in vLLM
    assert len(defaults_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=7))[0].outputs[0].token_ids) == 7


@pytest.fixture(scope="module")
def defaults_server(defaults_llm):
    from server.app import build_app

    apps = AppThread()
    apps.run(apps.serve(build_app(defaults_llm.engine)))
    yield apps.urls[0]
    apps.close()


def test_requests_take_the_defaults_they_leave_unset(defaults_server):
    client = openai.OpenAI(base_url=defaults_server + "/v1", api_key="none", max_retries=0, timeout=300)
    messages = [{"role": "user", "content": "Name three colors."}]
    plain = client.chat.completions.create(model=MODEL, messages=messages)
    greedy = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=5)
    assert plain.choices[0].message.content == greedy.choices[0].message.content
    assert (plain.usage.completion_tokens, plain.choices[0].finish_reason) == (5, "length")
    # max_new_tokens caps a larger max_tokens (vLLM's min of both), on both endpoints
    capped = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    assert capped.usage.completion_tokens == 5
    # the Responses API repeats the values used: the default where unset, the request's where set
    status, r = post_json(defaults_server, "/v1/responses", {"model": MODEL, "input": "Hi"})
    assert status == 200 and (r["temperature"], r["top_p"]) == (0.0, 0.9), r
    status, r = post_json(defaults_server, "/v1/responses", {"model": MODEL, "input": "Hi", "temperature": 0.7,
                                                             "top_p": None})
    assert status == 200 and (r["temperature"], r["top_p"]) == (0.7, 0.9), r
    # min_tokens above the capped max_tokens is the client's error, named
    status, r = post_json(defaults_server, "/v1/completions", {"model": MODEL, "prompt": "Hi", "min_tokens": 8})
    assert status == 400 and r["error"]["param"] == "min_tokens", r
