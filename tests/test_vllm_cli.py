"""vLLM's `vllm serve` command lines on `infire-jax serve`: what each flag becomes (mesh, engine config,
server settings), the refusals, and one server started from such a command line answering over HTTPS."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from infire_jax.cli import build_parser, main
from infire_jax.engine.args import engine_config
from infire_jax.engine.vllm_args import expand_config_file, resolve_serve_args
from infire_jax.errors import ConfigError
from sharding.mesh import ALIASES, ALLOWED_RULES, CONFIG_DIR, MeshConfig
from conftest import cpu_env, engine_flags
from server_utils import ServerProcess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Were a refusal broken, `main` would serve: on a port of ours, a model that fails to load at once.
_NO_SERVER = ["--port", "18951", "--host", "127.0.0.1"]


def _serve_args(line: str):
    """A `vllm serve ...` line, as `infire-jax serve` parses and resolves it."""
    parser = build_parser()
    args = parser.parse_args(expand_config_file(["serve", *line.split()], parser))
    resolve_serve_args(args)
    return args


def _layout(mc: MeshConfig):
    """What a ShardPlan reads of a mesh: the axis sizes and each logical axis's mesh axis."""
    return mc.sizes, {logical: mc.rule(logical) for logical in [*ALLOWED_RULES, *ALIASES]}


@pytest.mark.parametrize("flags, shipped", [
    ("-tp 1", "1.yaml"), ("-tp 1 -pp 1 --enable-expert-parallel", "1.yaml"), ("-tp 2", "2.yaml"),
    ("--tensor-parallel-size 8", "8.yaml"), ("-pp 2", "2-pp2.yaml"), ("-pp 8", "8-pp8.yaml"),
    ("-tp 4 -pp 2", "8-tp4-pp2.yaml"), ("-tp 8 --enable-expert-parallel", "8-tp8-ep.yaml")])
def test_parallel_flags_build_the_shipped_mesh(flags, shipped):
    mesh = engine_config(_serve_args(f"/models/m {flags}"), "/models/m").mesh
    assert isinstance(mesh, MeshConfig)
    assert _layout(mesh) == _layout(MeshConfig.from_yaml(os.path.join(CONFIG_DIR, shipped)))


# Each model placed (shapes and shardings, no weights) on 8 CPU devices by the flags' mesh and the file's.
_PLACEMENT = """
import json, sys
import jax
from infire_jax.cli import build_parser
from infire_jax.engine.args import engine_config
from infire_jax.loaders.load import load_config
from infire_jax.models.registry import abstract_state
from sharding.mesh import load_mesh_config
from sharding.plan import ShardPlan

def placement(model, flags):
    cfg = load_config(model)
    plan = ShardPlan.create(cfg, load_mesh_config(engine_config(build_parser().parse_args(
        ["serve", "--model", model, *flags]), model).mesh, 8))
    _, state = abstract_state(cfg, "float32", plan)
    specs = [str(a.sharding.spec) for a in jax.tree.leaves(state)]
    return [dict(plan.mesh.shape), plan.kv_repeat, plan.stage_layers, specs]

out = []
for model, flags, shipped in json.loads(sys.argv[1]):
    out.append(placement(model, flags) == placement(model, ["--mesh", shipped]))
print(json.dumps(out))
"""


def test_parallel_flags_place_a_model_as_the_shipped_file_does():
    cases = [("dummy:qwen3-0.6b", ["-tp", "2"], "2.yaml"), ("dummy:qwen3-0.6b", ["-pp", "2"], "2-pp2.yaml"),
             ("dummy:qwen3-0.6b", ["-tp", "4", "-pp", "2"], "8-tp4-pp2.yaml"),
             ("dummy:qwen3-30b-a3b,layers=2", ["-tp", "8", "--enable-expert-parallel"], "8-tp8-ep.yaml")]
    cases = [(m, f, os.path.join(CONFIG_DIR, y)) for m, f, y in cases]
    out = subprocess.run([sys.executable, "-c", _PLACEMENT, json.dumps(cases)], capture_output=True, text=True,
                         env=cpu_env(8, PYTHONPATH=ROOT), cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.splitlines()[-1]) == [True] * len(cases)


def test_without_parallel_flags_the_mesh_is_the_default_or_mesh_file():
    assert engine_config(_serve_args("m -dp 1")).mesh is None  # the shipped file for the device count
    assert engine_config(_serve_args("m --mesh x.yaml")).mesh == "x.yaml"


@pytest.mark.parametrize("line, message", [
    ("m -tp 2 --mesh x.yaml", "--mesh and --tensor-parallel-size"), ("m -tp 1 --mesh x.yaml", "--mesh and"),
    ("m -dp 2", r"--data-parallel-size 2: .*infire-jax router.*docs/FLEET.md"),
    ("m -tp 3", None)])  # a mesh the shipped rules cannot split: ConfigError at engine_config, not later
def test_parallel_flags_refused(line, message):
    args = _serve_args(line)
    if message is None:
        assert engine_config(args).mesh.num_devices == 3  # a valid mesh; the model decides whether 3 divides it
        return
    with pytest.raises(ConfigError, match=message):
        engine_config(args)


def test_a_vllm_command_line_becomes_our_config(tmp_path):
    model = str(tmp_path)
    args = _serve_args(
        f"{model} --tensor-parallel-size 2 --max-model-len 8192 --gpu-memory-utilization 0.95 --enable-prefix-caching "
        "--max-num-seqs 128 --max-num-batched-tokens 4096 --kv-cache-dtype fp8 --served-model-name llama "
        "--api-key sk-x --trust-remote-code --disable-log-requests --disable-log-stats --enable-chunked-prefill "
        "--port 8001 --host 0.0.0.0 --max-logprobs 5 --block-size 32 --seed 7 --num-gpu-blocks-override 300 "
        "--kv-cache-memory-bytes 1073741824 --tokenizer-mode auto --enable-prompt-tokens-details --tokenizer " + model)
    ec = engine_config(args, args.model[0])
    assert (ec.model, ec.max_model_len, ec.gpu_memory_utilization, ec.max_num_seqs, ec.max_num_batched_tokens,
            ec.kv_cache_dtype, ec.page_size, ec.seed) == (model, 8192, 0.95, 128, 4096, "fp8", 32, 7)
    assert (ec.max_logprobs, ec.max_prompt_logprobs, ec.mesh.sizes["tp"]) == (5, 5, 2)
    assert (ec.num_kv_pages, ec.kv_cache_memory) == (300, 1 << 30)
    assert (args.served_model_name, args.api_key, args.port, args.host) == ([["llama"]], ["sk-x"], 8001, "0.0.0.0")


@pytest.mark.parametrize("text, tokens", [("4096", 4096), ("1k", 1000), ("1K", 1024), ("25.6k", 25600),
                                          ("2m", 2_000_000), ("2M", 2 << 20), ("1g", 10**9), ("1G", 1 << 30),
                                          ("0.5K", 512)])
def test_sizes_read_as_vllm_reads_them(text, tokens):
    """Lower case decimal, upper case binary; a fraction that comes out whole."""
    args = _serve_args(f"m --max-model-len {text} --max-num-batched-tokens {text}")
    assert (args.max_model_len, args.max_num_batched_tokens) == (tokens, tokens)


@pytest.mark.parametrize("flag, text", [("--max-model-len", "1.0001k"), ("--max-model-len", "0.3K"),
                                        ("--max-model-len", "4x"), ("--max-model-len", "0"),
                                        ("--max-model-len", "-2"), ("--max-num-batched-tokens", "auto"),
                                        ("--max-num-batched-tokens", "-1"), ("--max-model-len", "k")])
def test_bad_sizes_are_argparse_errors(flag, text, capsys):
    with pytest.raises(SystemExit) as e:
        _serve_args(f"m {flag} {text}")
    assert e.value.code == 2
    assert f"argument {flag}: expected a positive whole number" in capsys.readouterr().err


def test_max_model_len_auto_is_the_models_context_as_much_as_the_pool_holds():
    """auto and -1 (vLLM's): the model's whole context (past the default's 8192 cap), cut to what one
    sequence has of a pool sized in advance (8 usable pages of 16: 128 tokens)."""
    from infire_jax.engine.setup import EngineConfig, resolve_settings
    from infire_jax.loaders.load import load_config

    model = "dummy:llama-3.2-1b,layers=2"
    context = load_config(model).max_position_embeddings
    assert context > 8192
    assert _serve_args("m --max-model-len auto").max_model_len == _serve_args("m --max-model-len -1").max_model_len
    for line, expected in ((f"{model} --max-model-len auto --max-num-seqs 4 --num-kv-pages 9", 128),
                           (f"{model} --max-model-len -1 --max-num-seqs 4 --num-kv-pages 9000", context),
                           (f"{model} --max-num-seqs 4", min(context, 8192))):
        args = _serve_args(line)
        assert resolve_settings(engine_config(args, args.model[0]), None).max_model_len == expected, line
    offline = EngineConfig(model=model, max_model_len="auto", max_num_seqs=4, num_kv_pages=9)  # LLM(max_model_len=...)
    assert resolve_settings(offline, None).max_model_len == 128


@pytest.mark.parametrize("line, served", [
    ("m", [((), "m")]),
    ("m --served-model-name a b c", [(("a", "b", "c"), "m")]),  # vLLM's: a, and b and c as its aliases
    ("m --served-model-name a --served-model-name b", [(("a", "b"), "m")]),  # one model: every name its own
    ("--model m --model n --served-model-name a --served-model-name b c", [(("a",), "m"), (("b", "c"), "n")]),
    ("--model m --model n", [((), "m"), ((), "n")]),
])
def test_served_model_names_one_models_aliases_or_one_flag_per_model(line, served):
    from server.app import _served_models

    assert _served_models(_serve_args(line)) == served


@pytest.mark.parametrize("line, message", [
    ("--model m --model n --served-model-name a b", "one --served-model-name per --model"),
    ("--model m --model n --served-model-name a --served-model-name a", "given twice"),
    ("--model m --model n --served-model-name a --served-model-name b a", "given twice"),
    ("--model m --model m", "given twice"),
])
def test_served_model_names_refused_when_ambiguous(line, message):
    from server.app import _served_models

    with pytest.raises(ValueError, match=message):
        _served_models(_serve_args(line))


def test_max_logprobs_caps_what_the_sampler_has():
    ec = engine_config(_serve_args("m --max-logprobs 50"))
    assert (ec.max_logprobs, ec.max_prompt_logprobs) == (20, 50)  # sampled: the sampler's top-20
    ec = engine_config(_serve_args("m --max-logprobs 2 --max-prompt-logprobs 20"))
    assert (ec.max_logprobs, ec.max_prompt_logprobs) == (2, 20)


def test_model_positional_or_flag_not_both(capsys):
    assert _serve_args("/models/a").model == ["/models/a"]
    assert _serve_args("--model /models/a").model == ["/models/a"]
    assert _serve_args("--load-format dummy llama-3.2-1b").model == ["dummy:llama-3.2-1b"]
    assert main(["serve", "/models/a", "--model", "/models/b", *_NO_SERVER]) == 2
    err = capsys.readouterr().err
    assert "MODEL (/models/a) and --model (/models/b)" in err and "Traceback" not in err


@pytest.mark.parametrize("line, message", [
    ("m --load-format pt", "--load-format pt"), ("m --tokenizer other", "--tokenizer other"),
    ("m --tokenizer-mode mistral", "--tokenizer-mode mistral"),
    ("m --ssl-keyfile k.pem", "--ssl-keyfile and --ssl-certfile"), ("m --root-path llm/", "--root-path")])
def test_vllm_flags_we_cannot_honour_as_asked(line, message):
    with pytest.raises(ConfigError, match=message):
        _serve_args(line)


@pytest.mark.parametrize("flags", [["--enforce-eager"], ["--revision", "main"], ["--download-dir", "/d"],
                                   ["--swap-space", "4"], ["--no-enable-chunked-prefill"]])
def test_refused_flags_say_why_in_one_line(flags, capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "m", *flags, *_NO_SERVER])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"error: {flags[0]}: ") and err.count("\n") == 1


def test_an_unknown_flag_fails_without_a_traceback():
    out = subprocess.run([sys.executable, "-m", "infire_jax", "serve", "m", "--no-such-flag"],
                         capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 2 and "--no-such-flag" in out.stderr and "Traceback" not in out.stderr


def test_config_file_gives_flags_the_command_line_overrides(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("model: /models/a\ntensor_parallel_size: 2\nmax_num_seqs: 7\ntrust_remote_code: true\n"
                    "port: 9001\nspeculative_config: {method: ngram, num_speculative_tokens: 3}\n"
                    "enable_prefix_caching: false\nenable_lora: false\n")
    args = _serve_args(f"--config {path} --max-num-seqs 9")
    ec = engine_config(args, args.model[0])
    assert (args.model, ec.mesh.sizes["tp"], ec.max_num_seqs, args.trust_remote_code, args.port) == \
           (["/models/a"], 2, 9, True, 9001)
    assert json.loads(ec.speculative_config) == {"method": "ngram", "num_speculative_tokens": 3}
    assert not ec.enable_prefix_caching and not ec.enable_lora


def test_config_file_flags_are_refused_or_missing_files_named(tmp_path, capsys):
    path = tmp_path / "serve.yaml"
    path.write_text("enable_chunked_prefill: false\n")
    with pytest.raises(SystemExit) as e:
        main(["serve", "--config", str(path), "--model", "/models/missing", *_NO_SERVER])
    assert e.value.code == 2 and capsys.readouterr().err.startswith("error: --no-enable-chunked-prefill: ")
    assert main(["serve", "--config", str(tmp_path / "missing.yaml"), *_NO_SERVER]) == 2
    assert f"--config {tmp_path / 'missing.yaml'}" in capsys.readouterr().err


def _self_signed(tmp_path) -> tuple[str, str]:
    key, cert = str(tmp_path / "key.pem"), str(tmp_path / "cert.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "1", "-subj", "/CN=127.0.0.1"], check=True, capture_output=True)
    return key, cert


def _call(url: str, method: str = "GET", body: dict | None = None, headers: dict | None = None):
    """(status, headers, JSON body or None) of one HTTPS request to the self-signed server."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    req = urllib.request.Request(url, json.dumps(body).encode() if body else None, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=300, context=context) as r:
            data = r.read()
            return r.status, r.headers, json.loads(data) if data else None
    except urllib.error.HTTPError as e:
        return e.code, e.headers, json.loads(e.read() or b"null")


def test_a_server_started_from_a_vllm_command_line(tmp_path, default_gguf):
    key, cert = _self_signed(tmp_path)
    origin = "https://app.example"
    # The tests' small engine (its programs come from the executable cache), the rest as vLLM spells it.
    server = ServerProcess([default_gguf, *engine_flags(), "--served-model-name", "smol", "--trust-remote-code",
                            "--tensor-parallel-size", "1", "--root-path", "/llm", "--allowed-origins",
                            json.dumps([origin]), "--max-logprobs", "2", "--max-prompt-logprobs", "20",
                            "--response-role", "model", "--return-tokens-as-token-ids", "--enable-log-requests",
                            "--ssl-keyfile", key, "--ssl-certfile", cert, "--disable-log-stats",
                            "--uvicorn-log-level", "info"])
    try:
        server.wait_ready()
        assert server.url.startswith("https://")
        chat = {"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                "logprobs": True, "top_logprobs": 2}
        status, headers, out = _call(server.url + "/llm/v1/chat/completions", "POST", chat, {"Origin": origin})
        assert status == 200, out
        assert out["choices"][0]["message"]["role"] == "model"
        assert headers["Access-Control-Allow-Origin"] == origin
        tokens = out["choices"][0]["logprobs"]["content"]
        assert tokens and all(t["token"].startswith("token_id:") for t in tokens)
        status, _, out = _call(server.url + "/v1/chat/completions", "POST", {**chat, "top_logprobs": 3})
        assert status == 400 and "--max-logprobs" in out["error"]["message"]
        preflight = {"Origin": origin, "Access-Control-Request-Method": "GET",
                     "Access-Control-Request-Headers": "authorization"}
        status, headers, _ = _call(server.url + "/llm/v1/models", "OPTIONS", headers=preflight)
        assert status == 200 and headers["Access-Control-Allow-Headers"] == "authorization"
        status, headers, out = _call(server.url + "/v1/models", headers={"Origin": "https://other.example"})
        assert status == 200 and out["data"][0]["id"] == "smol" and "Access-Control-Allow-Origin" not in headers
        log = server.log_tail(1 << 20)
        assert "POST /llm/v1/chat/completions" in log and "INFO infire_jax.engine" in log
    finally:
        server.stop()
