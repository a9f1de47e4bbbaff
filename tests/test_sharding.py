"""Sharding: mesh files, layout plans, pipeline microbatching, and sharded runs on 8 virtual CPU
devices (and on 2 processes x 4 devices) that must equal the single-device run."""

from __future__ import annotations

import functools
import glob
import json
import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import yaml

from conftest import cpu_env, dying_with_parent
from infire_jax.models.hf_config import config_from_hf
from pallas_kernels.metadata import AttentionMetadata, slice_tokens
from pallas_kernels.reference import ragged_paged_attention
from sharding.mesh import CONFIG_DIR, MeshConfig, MeshConfigError, load_mesh_config
from sharding.pipeline import num_microbatches
from sharding.plan import ShardPlan, plan_stages

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = sorted(glob.glob(os.path.join(CONFIG_DIR, "*.yaml")))
SMOL = config_from_hf(dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                           num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3))


def write_yaml(tmp_path, data, name="mesh.yaml") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return str(path)


# ---- mesh files and plans (no devices needed) -------------------------------------------------
def test_checkpoint_kv_scales_take_the_pools_layout():
    """A checkpoint's fp8 scales [L, 2, Hkv] land where `prepare_weights` puts each layer's kv head:
    each head's scale on every copy of it, the layers on their stage slots (read from a fused q/k/v
    weight whose k entries hold their layer and head)."""
    import types

    layers, hkv, g, d = 5, 2, 4, 3
    plan = types.SimpleNamespace(kv_repeat=2, num_stages=2, padded_layers=3, stage_layers=(3, 2),
                                 stacks=(("layers", (3, 2)),), stack_kv_repeats=())
    wqkv = np.zeros((layers, 1, hkv, g + 2, d), np.float32)
    wqkv[..., g, :] = (np.arange(layers)[:, None, None] * 10 + np.arange(hkv)[None, :, None] + 1)[:, None]
    placed = ShardPlan.prepare_weights(plan, {"layers.wqkv": wqkv})["layers.wqkv"][:, 0, :, -2, 0]  # [slots, heads]
    scales = np.stack([np.arange(layers)[:, None] * 10 + np.arange(hkv) + 1] * 2, axis=1).astype(np.float32)
    got = ShardPlan.prepare_kv_scales(plan, scales)
    real = placed > 0
    assert got.shape == (6, 2, 4) and real.sum() == layers * hkv * 2
    np.testing.assert_array_equal(got[:, 0][real], placed[real])
    np.testing.assert_array_equal(got[:, 1][real], placed[real])
    assert (got[~real.any(axis=1)] == 1).all()  # padding slots



@pytest.mark.parametrize("data, message", [
    ("mesh: [1, 2", "not valid YAML"),
    ({"mesh": {"tp": 2}, "extra": 1}, "unknown keys"),
    ({"mesh": {"xp": 2}}, "unknown mesh axes"),
    ({"mesh": {"tp": 0}}, "positive integer"),
    ({"mesh": {"tp": "two"}}, "positive integer"),
    ({"mesh": {"dp": 2}}, "dp > 1"),
    ({"mesh": {"tp": 2}, "rules": {"heads": "tp"}}, "unknown logical axis 'heads'"),
    ({"mesh": {"tp": 2}, "rules": {"layers": "tp"}}, "cannot be sharded over 'tp'"),
    ({"mesh": {"pp": 2}}, "layers: pp"),
    ({"mesh": {"tp": 2}, "rules": {"q_heads": "tp"}}, "q_heads and kv_heads"),
])
def test_bad_mesh_files_are_rejected(tmp_path, data, message):
    with pytest.raises(MeshConfigError, match=message):
        MeshConfig.from_yaml(write_yaml(tmp_path, data))


def test_shipped_files_parse_and_cover_each_device_count():
    for n in (1, 2, 4, 8):
        assert load_mesh_config(None, n).num_devices == n
    for path in SHIPPED:
        MeshConfig.from_yaml(path)
    with pytest.raises(MeshConfigError, match="needs 8 devices, but only 4"):
        load_mesh_config(os.path.join(CONFIG_DIR, "8.yaml"), 4)
    with pytest.raises(MeshConfigError, match="no shipped mesh config for 3 devices"):
        load_mesh_config(None, 3)


def test_plans_reject_models_that_do_not_fit():
    devices = [jax.devices()[0]] * 8  # shape checks only; the mesh is never used

    def plan(name, cfg):
        return ShardPlan.create(cfg, MeshConfig.from_yaml(os.path.join(CONFIG_DIR, name)), devices)

    with pytest.raises(MeshConfigError, match="9 attention heads are not divisible by tp=2"):
        plan("2.yaml", SMOL)
    with pytest.raises(MeshConfigError, match="needs a mixture-of-experts model"):
        plan("8-ep8.yaml", SMOL)
    tiny = SMOL.__class__(**{**SMOL.__dict__, "num_layers": 4})
    with pytest.raises(MeshConfigError, match="4 layers cannot fill 8 pipeline stages"):
        plan("8-pp8.yaml", tiny)
    moe = config_from_hf(dict(model_type="mixtral", vocab_size=1024, hidden_size=64, intermediate_size=64,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              num_local_experts=6, num_experts_per_tok=2))
    with pytest.raises(MeshConfigError, match="6 experts are not divisible by ep=8"):
        plan("8-ep8.yaml", moe)
    stages = plan("8-pp8.yaml", SMOL).stage_layers
    assert sum(stages) == 30 and max(stages) == 4 and min(stages) >= 1
    assert plan("8.yaml", SMOL.__class__(**{**SMOL.__dict__, "num_heads": 16, "num_kv_heads": 2})).kv_repeat == 4


def test_stage_plan_balances_cost():
    assert plan_stages(30, 2) == (15, 15)
    assert sorted(plan_stages(7, 3)) == [2, 2, 3]
    assert sorted(plan_stages(30, 8)) == [3, 3, 4, 4, 4, 4, 4, 4]
    # A stage that also carries 4 layers' worth of other work gets 4 layers fewer.
    assert plan_stages(20, 2, stage_extra=[0.0, 4.0]) == (12, 8)
    extra = [1.0] + [0.0] * 6 + [2.5]
    split = plan_stages(31, 8, stage_extra=extra)
    assert sum(split) == 31 and max(n + e for n, e in zip(split, extra)) == 5  # ceil((31 + 3.5) / 8)


def test_prepare_weights_repeats_kv_heads_and_pads_stages():
    cfg = SMOL.__class__(**{**SMOL.__dict__, "num_layers": 3, "num_heads": 8, "num_kv_heads": 2})
    mc = MeshConfig.parse({"mesh": {"pp": 2, "tp": 4},
                           "rules": {"q_heads": "tp", "kv_heads": "tp", "layers": "pp"}}, "t")
    plan = ShardPlan.create(cfg, mc, [jax.devices()[0]] * 8)
    rng = np.random.default_rng(0)
    wqkv = rng.normal(size=(3, 576, 2, 6, 64)).astype(np.float32)  # 2 kv heads, each 4 q heads + k + v
    norm = rng.normal(size=(3, 576)).astype(np.float32)
    out = plan.prepare_weights({"layers.wqkv": wqkv, "layers.attn_norm": norm, "embed": norm})
    assert plan.stage_layers == (1, 2) and plan.padded_layers == 2
    w = out["layers.wqkv"]
    assert w.shape == (4, 576, 4, 4, 64)  # 2 stages x 2 slots; kv heads 0 0 1 1, each with 2 q heads + k + v
    np.testing.assert_array_equal(w[0, :, 0, :2], wqkv[0, :, 0, :2])  # q heads 0, 1 with kv head 0
    np.testing.assert_array_equal(w[0, :, 1, :2], wqkv[0, :, 0, 2:4])  # q heads 2, 3 with its copy
    np.testing.assert_array_equal(w[0, :, 0, 2:], wqkv[0, :, 0, 4:])  # kv head 0's k and v ...
    np.testing.assert_array_equal(w[0, :, 1, 2:], wqkv[0, :, 0, 4:])  # ... stored twice
    np.testing.assert_array_equal(w[2:, :, 3, :2], wqkv[1:, :, 1, 2:4])  # stage 1 holds layers 1, 2
    np.testing.assert_array_equal(w[2:, :, 3, 2:], wqkv[1:, :, 1, 4:])
    np.testing.assert_array_equal(out["layers.attn_norm"][2:], norm[1:])
    assert not w[1].any() and not out["layers.attn_norm"][1].any()  # stage 0's padding slot
    assert out["embed"] is norm


def test_microbatches_see_earlier_microbatches_as_context():
    """Attention over a step cut into microbatches (the pipeline's view) equals the whole step."""
    rng = np.random.default_rng(1)
    ps, hq, hkv, d, pages = 4, 4, 2, 16, 24
    q_lens, ctx = [5, 1, 9, 3], [3, 11, 0, 6]  # prefill chunks, a decode and a fresh prompt
    t = 32
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    kv_lens = np.asarray(q_lens) + np.asarray(ctx)
    table = np.zeros((4, 8), np.int32)
    free = iter(rng.permutation(np.arange(1, pages)))
    for s, n in enumerate(kv_lens):
        table[s, :-(-n // ps)] = [next(free) for _ in range(-(-n // ps))]
    pos = np.zeros(t, np.int32)
    seq = np.full(t, 4, np.int32)
    for s in range(4):
        pos[cu[s]:cu[s + 1]] = np.arange(ctx[s], kv_lens[s])
        seq[cu[s]:cu[s + 1]] = s
    valid = np.arange(t) < cu[-1]
    slots = np.where(valid, table[np.minimum(seq, 3), pos // ps] * ps + pos % ps, np.arange(t) % ps)
    meta = AttentionMetadata(*map(jnp.asarray, (pos, slots, seq, table, kv_lens.astype(np.int32), cu,
                                                np.int32(4))))
    q, k, v = (jnp.asarray(rng.normal(size=(t, h, d)), jnp.float32) for h in (hq, hkv, hkv))
    cache = jnp.asarray(rng.normal(size=(1, pages, ps, hkv, d)), jnp.float32)
    # jitted, as the engine runs it: two compiles (the step and a microbatch), not each op's (14 s of CPU, now 6)
    attention = jax.jit(functools.partial(ragged_paged_attention, scale=0.25))
    whole, _, _ = attention(q, k, v, cache, cache, jnp.int32(0), meta)
    m = 4
    size = t // m
    kp = vp = cache
    parts = []
    for i in range(m):
        sl = slice(i * size, (i + 1) * size)
        out, kp, vp = attention(q[sl], k[sl], v[sl], kp, vp, jnp.int32(0), slice_tokens(meta, i * size, size))
        parts.append(out)
    n = int(cu[-1])
    np.testing.assert_allclose(np.concatenate(parts)[:n], np.asarray(whole)[:n], rtol=1e-5, atol=1e-5)
    assert num_microbatches(32, 8) == 8 and num_microbatches(1, 8) == 1 and num_microbatches(12, 8) == 6


# ---- sharded runs on 8 virtual devices ----------------------------------------------------------

PROMPTS = ["The capital of France is", "Once upon a time, " * 5, "def add(a, b):"]
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256, token_buckets=[32], num_kv_pages=64)


def _hf_dir(path, family: str, tokenizer) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig

    common = dict(vocab_size=tokenizer.vocab_size, hidden_size=64, num_key_value_heads=2,
                  max_position_embeddings=1024, initializer_range=0.3, tie_word_embeddings=False)
    torch.manual_seed(0)
    if family == "llama":  # 8 heads over 2 kv heads: tp=4 and tp=8 replicate kv heads; 3 layers split 2+1
        cfg = LlamaConfig(**common, intermediate_size=128, num_hidden_layers=3, num_attention_heads=8)
    else:
        cfg = MixtralConfig(**common, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
                            num_local_experts=8, num_experts_per_tok=2)  # 8 heads: fits tp 8 (8-tp8-ep.yaml)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path, safe_serialization=True)
    tokenizer.save(str(path))
    return str(path)


def _run_worker(job: dict, env_devices: int, tmp_path, name: str, distributed: dict | None = None):
    job = dict(job, distributed=distributed)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(job))
    # No placed-weights checkpoints (test_checkpoint's, on meshes and two processes too): a tmp model's would be
    # written for nothing, and orbax's writes compile a program per shard layout (a mesh engine's: tens)
    env = cpu_env(env_devices, PYTHONPATH=ROOT, INFIRE_JAX_NO_CHECKPOINT="1")
    command = [sys.executable, os.path.join(ROOT, "tests", "sharded_worker.py"), str(path)]
    return subprocess.Popen(dying_with_parent(command), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _results(proc) -> list[dict]:
    out, err = proc.communicate(timeout=1500)
    assert proc.returncode == 0, err[-4000:]
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory, smol_llm):
    base = tmp_path_factory.mktemp("sharding")
    return {"llama": _hf_dir(base / "llama", "llama", smol_llm.tokenizer),
            "mixtral": _hf_dir(base / "mixtral", "mixtral", smol_llm.tokenizer)}


def _assert_same(sharded: dict, single: dict) -> None:
    assert sharded["tokens"] == single["tokens"], (sharded["mesh"], sharded["model"])
    np.testing.assert_allclose(np.asarray(sharded["logprobs"]), np.asarray(single["logprobs"]), atol=1e-4)
    if "prompt_logprobs" in single:  # each prompt token's logprob and rank, each position's top ids
        for ours, ref in zip(sharded["prompt_logprobs"], single["prompt_logprobs"]):
            assert len(ours) == len(ref) > 0
            np.testing.assert_allclose([lp for lp, _ in ours], [lp for lp, _ in ref], atol=1e-4)
            # a rank counts the vocabulary's tokens at least as likely: float32 ties within 1e-6 may move it by one
            assert max(abs(a - b) for (_, a), (_, b) in zip(ours, ref)) <= 1
        assert sharded["prompt_top"] == single["prompt_top"], (sharded["mesh"], sharded["model"])


def _assert_each_device_holds_its_shard(result: dict) -> None:
    sizes = result["mesh_sizes"]
    for name, p in result["params"].items():
        shards = 1
        for entry in p["spec"]:
            for axis in (entry if isinstance(entry, list) else [entry]):
                shards *= sizes[axis] if axis else 1
        assert all(b * shards == p["global"] for b in p["per_device"]), (result["mesh"], name, p)


# Each shipped mesh runs the model it is meant for (one each: a mesh run costs ~15 s of compiling on 2
# cores); the rest of the matrix is asserted by refusals, which cost nothing.
MESH_MODELS = {"default": ["8-pp8"], "llama": ["2-pp2", "2", "4", "8", "8-tp4-pp2"],
               "mixtral": ["8-ep8", "8-tp2-ep4", "8-tp8-ep"]}
REFUSED = {"default": {"2": "9 attention heads are not divisible by tp=2"},
           "llama": {"8-ep8": "needs a mixture-of-experts model", "8-pp8": "3 layers cannot fill 8"},
           "mixtral": {"8-pp8": "2 layers cannot fill 8"}}


def test_every_shipped_mesh_matches_single_device(tiny_models, tmp_path):
    paths = {"default": None, **tiny_models}
    mesh = {os.path.basename(p)[:-5]: p for p in SHIPPED}
    assert sorted(sum(MESH_MODELS.values(), ["1"])) == sorted(mesh)  # every shipped mesh runs
    runs = [{"model": paths[name], "mesh": mesh[m], "name": name}
            for name in paths for m in ["1", *MESH_MODELS[name], *REFUSED[name]]]
    results = _results(_run_worker({"runs": runs, "prompts": PROMPTS, "max_tokens": 8, "engine": ENGINE},
                                   8, tmp_path, "job8"))
    assert len(results) == len(runs)
    single = {r["model"]: r for r in results if r["mesh"] == mesh["1"]}
    assert all(r["fits"] for r in single.values()) and len(single) == 3
    for run, r in zip(runs, results):
        says = REFUSED[run["name"]].get(os.path.basename(run["mesh"])[:-5])
        if says:
            assert not r["fits"] and "does not fit the model" in r["error"] and says in r["error"], (run, r)
        elif run["mesh"] != mesh["1"]:
            assert r["fits"], (run, r.get("error"))
            _assert_same(r, single[r["model"]])
            _assert_each_device_holds_its_shard(r)


def test_prompt_logprobs_on_meshes_match_single_device(tiny_models, tmp_path):
    """Prompt logprobs (top 3; the 30-token prompt chunked over the 32-token budget beside the others)
    equal the single device's on a pipeline (the default model on 2-pp2; its 3 kv heads fit no tp) and
    on tp x pp, the head split over tp (the tiny Llama on 8-tp4-pp2)."""
    runs = [{"model": m, "mesh": os.path.join(CONFIG_DIR, mesh)}
            for m, meshes in [(None, ["1.yaml", "2-pp2.yaml"]), (tiny_models["llama"], ["1.yaml", "8-tp4-pp2.yaml"])]
            for mesh in meshes]
    results = _results(_run_worker({"runs": runs, "prompts": PROMPTS, "max_tokens": 4, "prompt_logprobs": 3,
                                    "engine": ENGINE}, 8, tmp_path, "prompt_lp"))
    assert [r["fits"] for r in results] == [True] * 4
    for single, sharded in zip(results[::2], results[1::2]):
        assert len(sharded["prompt_logprobs"]) == len(PROMPTS)
        _assert_same(sharded, single)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one(tiny_models, tmp_path):
    """2 processes x 4 CPU devices joined by jax.distributed (gloo) give the one-process output."""
    mesh = os.path.join(CONFIG_DIR, "8-tp4-pp2.yaml")
    job = {"runs": [{"model": tiny_models["llama"], "mesh": mesh}], "prompts": PROMPTS, "max_tokens": 8,
           "engine": ENGINE}
    one = _results(_run_worker(job, 8, tmp_path, "one"))[0]
    address = f"127.0.0.1:{_free_port()}"
    procs = [_run_worker(job, 4, tmp_path, f"p{i}", {"address": address, "num_processes": 2, "process_id": i})
             for i in range(2)]
    leader = _results(procs[0])
    _results(procs[1])
    assert leader[0]["mesh_sizes"] == {"dp": 1, "pp": 2, "tp": 4, "ep": 1}
    _assert_same(leader[0], one)


def test_fp8_kv_cache_on_a_mesh_matches_single_device(tiny_models, tmp_path):
    """An fp8 pool on tp4 x pp2 (kv heads repeated, 3 layers in 2 + 2 slots, one of them padding): the
    sharded calibration gives the single device's scales in the pool's layout, and the same tokens."""
    meshes = ("1.yaml", "8-tp4-pp2.yaml")
    runs = [{"model": tiny_models["llama"], "mesh": os.path.join(CONFIG_DIR, name)} for name in meshes]
    # One bucket, one decode step a launch: a burst runs the same forward (bursts and the small bucket on meshes:
    # test_every_shipped_mesh_matches_single_device), each another program both engines compile; the scheduler's
    # steps are the same (chunked by the 32-token budget, not by the buckets).
    engine = dict(ENGINE, kv_cache_dtype="fp8", token_buckets=[32], num_decode_steps=1)
    single, sharded = _results(_run_worker({"runs": runs, "prompts": PROMPTS, "max_tokens": 8, "engine": engine},
                                           8, tmp_path, "fp8"))
    assert sharded["fits"] and sharded["mesh_sizes"] == {"dp": 1, "pp": 2, "tp": 4, "ep": 1}
    assert plan_stages(3, 2) == (1, 2)  # slots: layer 0, padding, layers 1 and 2
    real = np.asarray([0, 2, 3])
    expected = np.repeat(np.asarray(single["kv_scales"]), 2, axis=2)  # each kv head stored twice
    np.testing.assert_allclose(np.asarray(sharded["kv_scales"])[real], expected, rtol=1e-4)
    _assert_same(sharded, single)
