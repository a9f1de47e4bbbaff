"""`python -m infire_jax.bench`: flags, roofline arithmetic, datasets, and end-to-end runs on CPU.

The end-to-end runs are subprocesses of the real entry point; each writes a JSON whose figures must
be positive and agree with one another, and a PNG that matplotlib drew.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from infire_jax.bench import device_checks, latency, serve, suite, throughput
from infire_jax.bench.common import BenchError, add_output_args
from infire_jax.bench.datasets import random_prompts, read_jsonl
from infire_jax.bench.metrics import RequestTiming, summarize
from infire_jax.loaders.dummy import CONFIGS, with_layers
from infire_jax.models.hf_config import config_from_hf
from conftest import engine_flags

# Small shapes shared by the runs of one model, so they reuse one set of compiled steps (two step sizes,
# not the default six: each bench run is a fresh process that compiles them).
SMALL = ["--max-model-len", "64", "--num-kv-pages", "16", "--max-num-batched-tokens", "32",
         "--token-buckets", "4", "32"]
# The default model's float32 runs take the suite's small engine (conftest.SMALL_ENGINE): they load the
# programs `smol_llm` compiled from the executable cache instead of compiling their own.
SMOL = ["--dtype", "float32", *engine_flags()]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# The flags the issue names, per subcommand (vllm bench names), besides every flag having help.
REQUIRED_FLAGS = {
    "latency": ["--model", "--input-len", "--output-len", "--batch-size", "--json", "--plot"],
    "throughput": ["--model", "--input-len", "--output-len", "--num-prompts", "--max-concurrency", "--dataset",
                   "--json", "--plot"],
    "serve": ["--model", "--input-len", "--output-len", "--num-prompts", "--max-concurrency", "--request-rate",
              "--base-url", "--dataset", "--goodput", "--json", "--plot"],
    "suite": ["--model", "--input-len", "--output-len", "--max-concurrency", "--json", "--plot"],
    "device-checks": ["--out", "--budget", "--only", "--list", "--json"],
}
MODULES = {"latency": latency, "throughput": throughput, "serve": serve, "suite": suite, "device-checks": device_checks}


def _bench(*args: str, timeout: int = 600) -> str:
    proc = subprocess.run([sys.executable, "-m", "infire_jax.bench", *args], capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"bench {args[0]} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc.stdout


def _check_png(path) -> None:
    import matplotlib.image

    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert b"Matplotlib" in data[:2000]  # the Software text chunk matplotlib writes
    pixels = matplotlib.image.imread(str(path))
    assert pixels.shape[0] > 100 and pixels.shape[1] > 100
    assert len(np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)) > 10  # axes, lines, text: not blank


def _run(tmp_path, name: str, *args: str) -> dict:
    out_json, out_png = tmp_path / f"{name}.json", tmp_path / f"{name}.png"
    stdout = _bench(*args, "--json", str(out_json), "--plot", str(out_png))
    assert f"wrote {out_json}" in stdout
    _check_png(out_png)
    return json.loads(out_json.read_text())


# ---- flags ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(MODULES))
def test_help_documents_every_flag(name):
    p = argparse.ArgumentParser(**getattr(MODULES[name], "PARSER_OPTIONS", {}))
    MODULES[name].add_args(p)
    add_output_args(p)
    flags = [a for a in p._actions if not isinstance(a, argparse._HelpAction)]
    undocumented = [a.option_strings for a in flags if not (a.help and a.help.strip())]
    assert not undocumented
    text = _bench(name, "--help")
    squeezed = "".join(text.split())  # argparse re-wraps help text, at spaces and hyphens
    for action in flags:
        for option in action.option_strings:
            assert option in text
        assert "".join(action.help.split()) in squeezed, action.option_strings
    for flag in REQUIRED_FLAGS[name]:
        assert flag in text


# ---- roofline arithmetic, against numbers worked out by hand ------------------------------------------

def test_roofline_dense_llama_8b():
    from infire_jax.bench import roofline as r

    cfg = config_from_hf(CONFIGS["llama-3.1-8b"])
    # Per layer: attention 4096*128*(2*32 + 2*8) = 41,943,040; MLP 3*4096*14336 = 176,160,768.
    assert r.layer_matmul_params(cfg) == 32 * (41_943_040 + 176_160_768) == 6_979_321_856
    # 2048-token prompt: 2*params*2048 + LM head 2*4096*128256 at one row + attention
    # 4*32 layers*32 heads*128 * (2048*2049/2 keys).
    assert r.forward_flops(cfg, 2048, 0) == (2 * 6_979_321_856 * 2048 + 2 * 4096 * 128256
                                            + 4 * 32 * 32 * 128 * 2_098_176) == 29_688_401_494_016
    # One decode token after 999 cached: attends to 1000 keys.
    assert r.forward_flops(cfg, 1, 999) == 2 * 6_979_321_856 + 1_050_673_152 + 524_288 * 1000 == 15_533_604_864
    # Decode weights: all 8,030,261,248 params but the untied input embedding, of which 1 row is gathered.
    assert r.decode_weight_bytes(cfg, 2, 1) == (8_030_261_248 - 128255 * 4096) * 2 == 15_009_857_536
    # KV: K and V * 32 layers * 8 kv heads * 128 * 2 bytes = 131,072 bytes per token.
    assert r.kv_bytes_read(cfg, 2, [1000]) == (131_072_000, 0)
    assert r.decode_step_bytes(cfg, 2, [1000, 500]) == (8_030_261_248 - 128254 * 4096) * 2 + 131_072 * 1500
    # Weights held in fewer bytes (int8 with its scales, as the engine measures them) count those; KV stays bf16.
    assert r.decode_step_bytes(cfg, 2, [1000, 500], 1.01) == pytest.approx(
        (8_030_261_248 - 128254 * 4096) * 1.01 + 131_072 * 1500)


def test_roofline_deepseek_v3_mla_and_moe():
    from infire_jax.bench import roofline as r

    cfg = config_from_hf(CONFIGS["deepseek-v3"])
    # Attention per layer: q 7168*1536 + 1536*128*192, latent kv 7168*576, up 512*128*256, o 128*128*7168.
    attn = 11_010_048 + 37_748_736 + 4_128_768 + 16_777_216 + 117_440_512
    # 58 MoE layers: 8 routed + 1 shared expert of 3*7168*2048, the router 7168*256; 3 dense layers of 3*7168*18432.
    moe, dense = 9 * 44_040_192 + 1_835_008, 396_361_728
    assert r.layer_matmul_params(cfg) == 61 * attn + 58 * moe + 3 * dense == 35_697_917_952  # "37B activated" less embeddings
    # The pool holds the 512-wide latent and the 64-wide rope key: 576 values per token and layer.
    assert r.kv_bytes_read(cfg, 2, [1000]) == (61 * 576 * 2 * 1000, 0)
    # Absorbed attention per key and head: q.latent (512) + q.rope (64), then p.latent (512).
    assert r.forward_flops(cfg, 1, 999) - r.forward_flops(cfg, 1, 0) == 2 * 61 * 128 * (2 * 512 + 64) * 999


def test_roofline_llama4_chunked_layers_read_one_chunk():
    from infire_jax.bench import roofline as r

    cfg = config_from_hf(CONFIGS["llama-4-scout"])
    assert cfg.num_layers == 48 and cfg.num_heads == 40 and cfg.head_dim == 128
    # 12 NoPE layers attend globally, 36 RoPE layers within chunks of 8192; K and V * 8 kv heads * 128 * 2 bytes.
    per_token = 2 * 8 * 128 * 2
    # At 32768 keys a chunked layer's query (position 32767) sees its chunk's 8192 keys.
    assert r.kv_bytes_read(cfg, 2, [32768]) == (per_token * (12 * 32768 + 36 * 8192), per_token * 36 * 8192)
    # Below one chunk every layer sees every key; one past a boundary a chunked layer sees one key.
    assert r.kv_bytes_read(cfg, 2, [4096, 8193]) == (per_token * (48 * 4096 + 12 * 8193 + 36 * 1),
                                                     per_token * 36 * (4096 + 1))
    # A 10,000-token prompt: global layers 10000 * 10001 / 2 keys, chunked ones restart at 8192:
    # 8192 * 8193 / 2 + 1808 * 1809 / 2 keys.
    keys = 12 * 50_005_000 + 36 * (33_558_528 + 1_635_336)
    assert r.forward_flops(cfg, 10_000, 0) == (2 * r.layer_matmul_params(cfg) * 10_000 + 2 * 5120 * 202_048
                                               + 2 * 40 * 2 * 128 * keys)


def test_roofline_tied_and_moe():
    from infire_jax.bench import roofline as r

    tied = config_from_hf(CONFIGS["llama-3.2-1b"])
    assert r.decode_weight_bytes(tied, 4, 8) == 1_235_814_400 * 4  # the tied table is the LM head: read whole
    moe = config_from_hf(CONFIGS["qwen3-30b-a3b"])
    expert = 3 * 2048 * 768  # 4,718,592 weights per expert
    # Per layer: attention 2048*128*(64+8), 8 routed experts, the router 2048*128.
    assert r.layer_matmul_params(moe) == 48 * (18_874_368 + 8 * expert + 262_144) == 2_730_491_904
    # One token reads 8 of 128 experts per layer; two read 128*(1-(120/128)^2) = 15.5 in expectation.
    assert r.expected_experts_touched(128, 8, 1) == pytest.approx(8)
    assert r.expected_experts_touched(128, 8, 2) == pytest.approx(15.5)
    assert r.decode_weight_bytes(moe, 2, 1) == pytest.approx(
        (30_532_122_624 - 151935 * 2048 - 48 * 120 * expert) * 2)
    assert r.decode_weight_bytes(moe, 2, 2) == pytest.approx(
        (30_532_122_624 - 151934 * 2048 - 48 * 112.5 * expert) * 2)


def test_measured_peaks_are_plausible():
    import jax.numpy as jnp

    from infire_jax.bench.roofline import measure_bandwidth, measure_matmul_rate

    assert 1e8 < measure_bandwidth(1 << 24, iters=3, repeats=2) < 1e13
    assert 1e8 < measure_matmul_rate(256, jnp.float32, iters=2, repeats=2) < 1e16
    assert 1e8 < measure_matmul_rate(256, jnp.bfloat16, iters=2, repeats=2) < 1e16  # our CPU kernel too


def test_matmul_ceiling_is_the_faster_matmul(monkeypatch):
    """On CPU the ceiling takes the engine's bfloat16 kernels (on row-major weights and on panels) when
    they are faster than XLA's dot, so a prefill through them is not reported above 100% of the
    measured matmul rate."""
    import jax.numpy as jnp

    from infire_jax.bench import roofline
    from pallas_kernels import cpu_matmul

    timed = []
    monkeypatch.setattr(roofline, "_best_seconds", lambda fn, args, iters, repeats: timed.append(fn) or 1.0)
    roofline.measure_matmul_rate(256, jnp.bfloat16)
    w = jnp.zeros((1, 256, 256), jnp.bfloat16)
    assert len(timed) == 1 + cpu_matmul.applies(256, w) + cpu_matmul.panels_apply(w)


# ---- prompts and statistics -----------------------------------------------------------------------------

def test_jsonl_dataset_through_grain(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "hello there", "output_len": 3}\n\n{"prompt": [5, 6, 7]}\n'
                    '{"prompt": "third", "output_len": 9}\n')
    prompts = read_jsonl(str(path), None, 4)
    assert [(p.prompt, p.output_len) for p in prompts] == [("hello there", 3), ([5, 6, 7], 4), ("third", 9)]
    assert [p.prompt for p in read_jsonl(str(path), 2, 4)] == ["hello there", [5, 6, 7]]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"prompt": ""}\n')
    with pytest.raises(BenchError, match="bad.jsonl:2"):
        read_jsonl(str(bad), None, 4)
    bad.write_text('{"prompt": "x", "output_len": 0}\n')
    with pytest.raises(BenchError, match="output_len"):
        read_jsonl(str(bad), None, 4)


def test_random_prompts_are_fresh_per_seed():
    a = random_prompts(3, 5, 2, 100, (0, 1))
    assert len(a) == 3 and all(len(p.prompt) == 5 and p.output_len == 2 for p in a)
    assert all(0 <= t < 100 for p in a for t in p.prompt)
    assert [p.prompt for p in a] == [p.prompt for p in random_prompts(3, 5, 2, 100, (0, 1))]
    assert [p.prompt for p in a] != [p.prompt for p in random_prompts(3, 5, 2, 100, (0, 2))]


def test_serve_image_flags_and_chat_bodies():
    """`bench serve --image-size WxH` (or N), its images as JPEG data URLs of that size, random token ids
    as words in a chat message with the images after the text; a chat stream's role-only first chunk
    brings no token (it would make every TTFT zero)."""
    import base64
    import io

    from PIL import Image

    from infire_jax.bench import serve_images

    p = argparse.ArgumentParser()
    serve.add_args(p)
    args = p.parse_args(["--images-per-request", "2", "--image-size", "96x40"])
    assert (args.images_per_request, args.image_size, args.endpoint) == (2, (96, 40), None)
    assert p.parse_args(["--image-size", "64"]).image_size == (64, 64)
    for bad in ("96x", "0x4", "axb", "1x2x3"):
        with pytest.raises(SystemExit):
            p.parse_args(["--image-size", bad])
    urls = serve_images.data_urls(2, (96, 40), seed=0)
    assert len(set(urls)) == 2 and urls == serve_images.data_urls(2, (96, 40), seed=0)
    image = Image.open(io.BytesIO(base64.b64decode(urls[0].split(",", 1)[1])))
    assert (image.format, image.size) == ("JPEG", (96, 40))
    (message,) = serve_images.messages([0, 1, 52], urls)
    assert message["content"][0] == {"type": "text", "text": "the a of"}
    assert [part["image_url"]["url"] for part in message["content"][1:]] == urls
    assert not serve._brings_token({"index": 0, "delta": {"role": "assistant", "content": ""}})
    assert serve._brings_token({"index": 0, "delta": {"content": "Hi"}})
    assert serve._brings_token({"index": 0, "text": ""}) and not serve._brings_token({"text": "", "finish_reason": "stop"})


def test_summary_and_goodput():
    fast = RequestTiming(ttft=0.1, e2el=0.5, itl=[0.1] * 4, prompt_tokens=10, output_tokens=5)
    slow = RequestTiming(ttft=0.3, e2el=0.4, itl=[0.05, 0.05], prompt_tokens=20, output_tokens=3)
    s = summarize([fast, slow], 2.0, [50, 99], {"ttft": 200.0, "tpot": 120.0})
    assert s["completed"] == 2 and s["total_input_tokens"] == 30 and s["total_output_tokens"] == 8
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 4.0 and s["total_token_throughput"] == 19.0
    assert s["mean_ttft_ms"] == pytest.approx(200) and s["p50_ttft_ms"] == pytest.approx(200)
    assert s["mean_tpot_ms"] == pytest.approx(75)  # (0.4/4 + 0.1/2) / 2 seconds
    assert s["mean_itl_ms"] == pytest.approx((0.4 + 0.1) / 6 * 1000)
    assert s["good_requests"] == 1 and s["request_goodput"] == 0.5  # the slow one misses the TTFT SLO


# ---- end to end on CPU ------------------------------------------------------------------------------

def _check_latency(data: dict, batches: list[int], input_len: int, output_len: int, iters: int,
                   cached: list[int] | None = None) -> None:
    """`cached`: the tokens each request of the run finds cached (none without it)."""
    from infire_jax.bench.roofline import forward_flops

    cfg_name = data["engine"]["model"]
    assert data["benchmark"] == "latency" and data["peaks"]["bandwidth"] > 0 and data["peaks"]["matmul_flops"] > 0
    assert [r["batch_size"] for r in data["results"]] == batches
    for r in data["results"]:
        b = r["batch_size"]
        assert r["num_requests"] == b * iters and r["total_output_tokens"] == b * iters * output_len
        assert r["decode_steps_timed"] == iters * (output_len - 1)
        for key in ("mean_ttft_ms", "decode_ms_per_token", "decode_tokens_per_s", "mean_e2e_ms",
                    "decode_bw_util", "prefill_flops_util", "output_throughput"):
            assert r[key] > 0 and math.isfinite(r[key]), (cfg_name, key)
        assert r["decode_tokens_per_s"] == pytest.approx(b * 1000 / r["decode_ms_per_token"])
        assert r["mean_ttft_ms"] < r["mean_e2e_ms"] and r["p50_e2e_ms"] <= r["p99_e2e_ms"]
        if cfg_name.startswith("dummy:"):
            spec = cfg_name.split(":", 1)[1]
            hf = CONFIGS[spec.partition(",")[0]]
            cfg = config_from_hf(with_layers(hf, spec) if "," in spec else hf)
            hits = cached or [0] * (b * iters)
            assert r["prefill_flops"] == pytest.approx(sum(forward_flops(cfg, input_len - c, c) for c in hits) / iters)


def _check_throughput(data: dict, sweep: list[int], num: int, input_len: int, output_len: int) -> None:
    assert data["benchmark"] == "throughput" and data["peaks"]["bandwidth"] > 0
    assert [r["max_concurrency"] for r in data["results"]] == sweep
    for r in data["results"]:
        assert r["completed"] == num and r["total_output_tokens"] == num * output_len
        assert r["total_input_tokens"] == num * input_len
        assert 0 < r["max_running"] <= r["max_concurrency"]
        assert r["output_throughput"] == pytest.approx(r["total_output_tokens"] / r["duration_s"])
        for key in ("request_throughput", "mean_ttft_ms", "mean_tpot_ms", "mean_e2el_ms", "bw_util", "flops_util"):
            assert r[key] > 0 and math.isfinite(r[key]), key
        assert r["p50_ttft_ms"] <= r["p99_ttft_ms"] and r["mean_ttft_ms"] < r["mean_e2el_ms"]


def test_latency_default_model(tmp_path):
    """The default model with its Q4_1 weights kept quantized (the float32 default is measured by the
    throughput and serve tests): a decode step's roofline bytes are the weights as held (180 MB, a third
    of float32's), plus a few KV entries."""
    data = _run(tmp_path, "latency", "latency", "--input-len", "16", "--output-len", "8", "--batch-size", "1", "2",
                "--num-iters", "2", "--max-num-seqs", "4", "--weights-quantization", "gguf", *SMALL)
    assert data["engine"]["model"] == "SmolLM2-135M-Instruct"
    _check_latency(data, [1, 2], 16, 8, 2)
    held = data["engine"]["weight_bytes"]
    assert held < 0.4 * data["engine"]["param_count"] * 4
    assert held < data["results"][0]["decode_bytes_per_step"] < 1.01 * held


def test_throughput_default_model(tmp_path):
    data = _run(tmp_path, "throughput", "throughput", "--input-len", "16", "--output-len", "8",
                "--num-prompts", "6", "--max-concurrency", "2", "4", *SMOL)
    _check_throughput(data, [2, 4], 6, 16, 8)


def test_throughput_dataset(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "output_len": n}) + "\n"
                            for p, n in [("The capital of France is", 5), ([1, 2, 3, 4], 3), ("Hello", 4)]))
    data = _run(tmp_path, "dataset", "throughput", "--dataset", str(path), "--max-concurrency", "4", *SMOL)
    (r,) = data["results"]
    assert r["completed"] == 3 and r["total_output_tokens"] == 5 + 3 + 4
    assert r["total_input_tokens"] > 4


def test_latency_llama_1b(tmp_path):
    """With a 32-token prefix every prompt shares: the first request computes it (its first chunk of 32
    tokens, the step budget), every later one finds both of its pages cached. Sampled, as vLLM's
    bench latency samples (its length does not depend on what is drawn: EOS is ignored)."""
    data = _run(tmp_path, "latency_1b", "latency", "--model", "dummy:llama-3.2-1b,layers=2", "--input-len", "40",
                "--output-len", "8", "--batch-size", "2", "--num-iters", "2", "--num-iters-warmup", "0",
                "--prefix-len", "32", "--temperature", "1.0", *SMALL)
    assert data["settings"]["temperature"] == 1.0
    assert data["engine"]["model"] == "dummy:llama-3.2-1b,layers=2" and data["engine"]["max_num_seqs"] == 2
    _check_latency(data, [2], 40, 8, 2, cached=[0, 32, 32, 32])
    assert data["results"][0]["prefix_len"] == 32 and data["results"][0]["mean_cached_tokens"] == 24


def test_suite_default_model(tmp_path):
    data = _run(tmp_path, "suite", "suite", "--model", "", "--latency-input-len", "16", "--latency-output-len", "4",
                "--num-iters", "1", "--input-len", "16", "--output-len", "4", "--max-concurrency", "2", "4",
                "--num-prompts", "4", *SMOL)
    assert data["engine"]["model"] == "SmolLM2-135M-Instruct"
    figures = {f["key"]: f for f in data["figures"]}
    assert list(figures) == ["decode_ms_per_token_bs1", "ttft_ms_16_bs1", "output_tokens_per_s_c2",
                             "output_tokens_per_s_c4"]
    for f in figures.values():
        assert f["value"] > 0 and 0 < f["roofline_fraction"] and f["unit"] and f["roofline"]
    (lat,) = data["latency"]
    assert figures["decode_ms_per_token_bs1"]["value"] == lat["decode_ms_per_token"]
    assert figures["ttft_ms_16_bs1"]["roofline_fraction"] == lat["prefill_flops_util"]
    assert [t["total_output_tokens"] for t in data["throughput"]] == [4 * 4, 4 * 4]
    assert figures["output_tokens_per_s_c4"]["value"] == data["throughput"][1]["output_throughput"]


def test_serve_against_our_server(tmp_path):
    from tests.server_utils import MODEL, ServerProcess

    server = ServerProcess(engine_flags())
    try:
        server.wait_ready()
        data = _run(tmp_path, "serve", "serve", "--base-url", server.url, "--num-prompts", "6", "--input-len", "16",
                    "--output-len", "6", "--vocab-size", "49152", "--request-rate", "inf", "20",
                    "--max-concurrency", "4", "--ignore-eos", "--goodput", "ttft:60000", "e2el:0.001")
    finally:
        server.stop()
    assert data["model"] == MODEL and [r["request_rate"] for r in data["results"]] == ["inf", 20.0]
    for r in data["results"]:
        assert r["completed"] == 6 and r["failed"] == 0
        assert r["total_input_tokens"] == 6 * 16 and r["total_output_tokens"] == 6 * 6  # usage, ignore_eos honoured
        assert r["good_requests"] == 0 and r["request_goodput"] == 0  # nobody finishes within 1 us
        for key in ("request_throughput", "output_throughput", "p50_ttft_ms", "p90_tpot_ms", "p99_itl_ms",
                    "p50_e2el_ms"):
            assert r[key] > 0, key
        assert r["p50_ttft_ms"] <= r["p90_ttft_ms"] <= r["p99_ttft_ms"] < r["p99_e2el_ms"]
