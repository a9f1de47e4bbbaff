"""`infire-jax plan`: per-device bytes against what the engine places on 8 virtual CPU devices (GPTQ /
AWQ checkpoints as `weights_quantization="checkpoint"` keeps them, a float one as `"int4"`, `"int8"`
or `"fp8"` quantizes it at load), the flagship configs' figures against hand arithmetic, and errors that
name the field."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import cpu_env
from gptq_awq_models import quantization_config, write_checkpoint, write_float_twin
from infire_jax.memplan.model import (
    at_load_layouts, formats_from_hf, from_hf_config, from_model_config, kept_layouts, placed_config)
from infire_jax.memplan.plan import GiB, layers_per_device, memory_plan, parse_bytes, tensor_bytes
from infire_jax.memplan.source import plan_source
from infire_jax.models.hf_config import config_from_hf
from sharding.mesh import CONFIG_DIR, MeshConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = dict(vocab_size=256, hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
              max_position_embeddings=512, tie_word_embeddings=False)
MODELS = {  # 8 heads over 2 kv heads: tp 8 repeats kv heads; 3 layers pad to 4 slots on pp 2
    "dense": dict(COMMON, model_type="llama", intermediate_size=128, num_hidden_layers=3),
    "moe": dict(COMMON, model_type="mixtral", intermediate_size=64, num_hidden_layers=2, num_local_experts=8,
                num_experts_per_tok=2),
}
TINY_MLA = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=8, intermediate_size=128,
                kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
RUNS = [("dense", "8.yaml"), ("dense", "8-tp4-pp2.yaml"), ("moe", "8-ep8.yaml"), ("moe", "8-tp2-ep4.yaml"),
        ("moe", "8-tp8-ep.yaml")]
# tests/gptq_awq_models.py's tiny Llama (4 heads over 2 kv heads, 2 layers): (method, group, act-order), mesh
INT4 = {"gptq-act-order-g32": (("gptq", 32, True), "8-tp4-pp2.yaml"), "awq-g32": (("awq", 32, False), "4.yaml"),
        "gptq-per-channel": (("gptq", -1, False), "8-tp4-pp2.yaml")}
# the same model's float twin quantized at load (`weights_quantization` int4, int8 or fp8): mode, int4 group, mesh
AT_LOAD = {"at-load-g32": ("int4", 32, "8-tp4-pp2.yaml"), "at-load-g128": ("int4", 128, "2.yaml"),
           "at-load-fp8": ("fp8", None, "8-tp4-pp2.yaml"), "at-load-int8": ("int8", None, "4.yaml")}


def test_plan_matches_the_bytes_placed_per_device(tmp_path):
    """One subprocess with 8 CPU devices places each (model, mesh); every device's bytes per weight
    (per part of a kept int4 weight, from a GPTQ / AWQ checkpoint or quantized at load) and the KV
    pool's bytes per token equal the plan's, which allocated nothing. A kept int4 weight's workspace
    is one layer of it in float32: 8 x its words."""
    runs = [{"name": m, "config": MODELS[m], "mesh": os.path.join(CONFIG_DIR, mesh)} for m, mesh in RUNS]
    defined = {}
    for name, ((method, group, act_order), mesh) in INT4.items():
        defined[name] = write_checkpoint(tmp_path / name, method, group, act_order=act_order)
        runs.append({"name": name, "checkpoint": str(tmp_path / name), "mesh": os.path.join(CONFIG_DIR, mesh)})
    write_float_twin(tmp_path / "float", tmp_path / "awq-g32", defined["awq-g32"])
    for name, (mode, group, mesh) in AT_LOAD.items():
        runs.append({"name": name, "checkpoint": str(tmp_path / "float"), "at_load": [mode, group],
                     "mesh": os.path.join(CONFIG_DIR, mesh)})
    path = tmp_path / "job.json"
    path.write_text(json.dumps({"runs": runs}))
    env = cpu_env(8, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "memplan_worker.py"), str(path)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(runs)
    for r in results:
        mc = MeshConfig.from_yaml(r["mesh"])
        if r["name"] in INT4:
            model = plan_source(str(tmp_path / r["name"]), "float32")(mc)
        elif r["name"] in AT_LOAD:
            model = plan_source(str(tmp_path / "float"), "float32", *AT_LOAD[r["name"]][:2])(mc)
        else:
            model = from_model_config(placed_config(config_from_hf(MODELS[r["name"]]), mc), "float32")
        tensors = {t.name: t for t in model.tensors}
        assert set(tensors) == set(r["bytes"]), r["mesh"]
        for name, per_device in r["bytes"].items():
            assert per_device == [tensor_bytes(tensors[name], model, mc, "float32")] * mc.num_devices, \
                (r["name"], r["mesh"], name)
        plan = memory_plan(model, mc, 80 * GiB, dtype="float32")
        assert sum(plan.weights.values()) == sum(b[0] for b in r["bytes"].values())
        assert plan.kv_bytes_per_token == r["kv_per_token"], r["mesh"]
        if r["name"] in AT_LOAD and AT_LOAD[r["name"]][0] != "int4":  # 8-bit values, a float32 scale a row
            assert f"wqkv.{AT_LOAD[r['name']][0]}" in r["bytes"] and "wqkv.scale" in r["bytes"]
        elif r["name"] in INT4 or r["name"] in AT_LOAD:
            words = sum(b[0] for k, b in r["bytes"].items() if k.endswith(".q4"))
            assert plan.workspace == words * 8 / layers_per_device(model.num_layers, mc), r["name"]
            assert ("wo.g_idx" in r["bytes"]) == (r["name"] in INT4 and INT4[r["name"]][0][2])


def _plan(name: str, mesh: str, memory: str, **kw):
    mc = MeshConfig.from_yaml(os.path.join(CONFIG_DIR, mesh))
    return memory_plan(plan_source(name, "bfloat16")(mc), mc, parse_bytes(memory), **kw)


def test_llama4_counts_its_vision_tower_and_image_pool_on_every_device():
    """Where the engine serves images, the plan holds Scout's tower (871,932,416 parameters in bf16) and
    the image pool (4 prompts' image of 17 tiles x 144 tokens, 5120 wide in bf16) on each device: one, or
    every device of a mesh, where both are replicated; with the text weights quantized at load, the same.
    Beside them each device keeps room for the
    encoder's largest call (17 tiles of 577 tokens: 1408-wide activations and a 5632-wide MLP in
    bf16, 16 heads' scores in float32), which the KV room leaves out."""
    tower_and_pool = 871_932_416 * 2 + 4 * 17 * 144 * 5120 * 2
    encoder = 17 * 577 * (11 * 1408 + 5632) * 2 + 17 * 16 * 577 ** 2 * 4
    assert _plan("dummy:llama-4-scout,layers=8", "1.yaml", "141GB").weights["vision"] == tower_and_pool
    for mesh in ("2.yaml", "2-pp2.yaml", "8-tp2-ep4.yaml"):
        plan = _plan("dummy:llama-4-scout", mesh, "141GB")
        assert plan.weights["vision"] == tower_and_pool and plan.encoder == encoder, mesh
        assert "image encoder (largest call)" in plan.describe()
        assert plan.kv_room == pytest.approx(plan.device_memory * plan.utilization - plan.weight_bytes
                                             - plan.activations - plan.workspace - plan.logits - encoder)
    mc = MeshConfig.from_yaml(os.path.join(CONFIG_DIR, "2.yaml"))
    int4 = memory_plan(plan_source("dummy:llama-4-scout", "bfloat16", "int4")(mc), mc, parse_bytes("141GB"))
    assert int4.weights["vision"] == tower_and_pool and int4.encoder == encoder
    assert _plan("dummy:llama-3.1-8b", "1.yaml", "80GB").weights["vision"] == 0


@pytest.mark.parametrize("name", ["qwen3.5-27b", "qwen3.5-35b-a3b"])
def test_qwen3_5_plans_its_stacks_its_attention_layers_kv_and_each_slots_linear_state(name):
    """Qwen3.5 (dense and MoE): the planned weights are the engine's model's parameters in bf16, the KV per
    token is its attention layers' alone (a quarter of them), and each request slot (64 and the dummy one)
    holds its linear layers' state as the runner allocates it (runner/device_memory.py), and so does each of
    the prefix cache's 16 snapshots."""
    import math

    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from infire_jax.loaders.dummy import CONFIGS
    from infire_jax.models.registry import abstract_model
    from infire_jax.models.gated_delta import linear_state_shapes

    cfg = config_from_hf(CONFIGS[name])
    p = _plan(f"dummy:{name}", "1.yaml", "80GB", max_num_seqs=64)
    params = sum(math.prod(v.shape) for _, v in nnx.to_flat_state(nnx.state(abstract_model(cfg, jnp.bfloat16))))
    assert p.weight_bytes == 2 * params
    assert p.kv_bytes_per_token == cfg.num_kv_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
    per_slot = sum(math.prod(shape) * np.dtype(dt).itemsize for shape, dt in linear_state_shapes(cfg, 1, jnp.bfloat16))
    assert p.slot_state == (65 + 16) * per_slot > 3 * GiB  # the slots, the dummy one, the prefix cache's 16
    tp8 = _plan(f"dummy:{name}", "8.yaml", "80GB", max_num_seqs=64)  # each device: its heads' weights and state
    assert tp8.slot_state == p.slot_state / 8
    # an eighth, but for the repeated kv heads (4 to 8) and the replicated norms
    assert tp8.weights["attention"] == pytest.approx(p.weights["attention"] / 8, rel=0.05)
    with pytest.raises(ValueError, match="pipeline parallelism is not supported"):
        _plan(f"dummy:{name}", "8-pp8.yaml", "80GB", max_num_seqs=64)


def test_gpt_oss_fits_one_card_with_its_mxfp4_experts():
    """As published: 36 layers x 128 experts x (2880 x 5760 + 2880 x 2880) weights at 4.25 bits (a
    byte per two, a scale byte per 32) and their bf16 biases take 56.8 GiB; with the rest in bf16 one
    80 GB card keeps room for KV at 0.9."""
    p = _plan("dummy:gpt-oss-120b", "1.yaml", "80GB")
    assert p.weights["experts"] == 36 * 128 * (3 * 2880 * 2880 * (0.5 + 1 / 32) + 3 * 2880 * 2)
    assert p.weight_bytes < 61 * GiB and p.kv_room > 4 * GiB
    small = _plan("dummy:gpt-oss-20b", "1.yaml", "24GiB")  # and the 20b a 24 GiB card
    assert small.weight_bytes < 13 * GiB and small.kv_room > 6 * GiB


def test_gpt_oss_splits_its_mxfp4_experts_over_meshes():
    """tp 2 halves the experts' widths with their gate/up biases (w_down's 90 blocks of 32 inputs: 45 a
    device), the down biases whole on each; ep 8 holds 16 whole experts a device; tp 8 would split w_down's
    90 blocks and is refused, as the engine refuses it (tests/test_gpt_oss.py)."""
    weights = 3 * 2880 * 2880 * (0.5 + 1 / 32)  # an expert's, at 4.25 bits
    tp2 = _plan("dummy:gpt-oss-120b", "2.yaml", "80GB")
    assert tp2.weights["experts"] == pytest.approx(36 * 128 * (weights / 2 + 2 * 2880 * 2), rel=1e-12)
    ep8 = _plan("dummy:gpt-oss-120b", "8-ep8.yaml", "80GB")
    assert ep8.weights["experts"] == pytest.approx(36 * 16 * (weights + 3 * 2880 * 2), rel=1e-12)
    with pytest.raises(ValueError, match="MXFP4 weight w_down: its 2880 inputs .* cannot be split 8 ways"):
        _plan("dummy:gpt-oss-120b", "8.yaml", "80GB")


def test_kimi_k25_figures_follow_from_its_config():
    """Hand arithmetic: 60 MoE layers x 384 experts x 3 x 7168 x 2048 int4 weights with a bf16
    scale per 32, split 8 ways; MLA KV of 512 + 64 bf16 values per layer, replicated over tp. On
    8 x 80 GiB the experts alone take 66.45 GiB a device, so even the whole card leaves < 30 GiB."""
    p = _plan("dummy:kimi-k2.5", "8-tp8-ep.yaml", "80GiB", dequant="fused", utilization=1.0)
    assert p.weights["experts"] == 60 * 384 * 3 * 7168 * 2048 * (0.5 + 2 / 32) / 8
    assert p.kv_bytes_per_token == 61 * (512 + 64) * 2
    assert 70 * GiB < p.weight_bytes < 72 * GiB
    assert 0 < p.kv_room < 30 * GiB and p.kv_tokens == int(p.kv_room // p.kv_bytes_per_token)
    assert "KV room per device: " in p.describe() and f"KV tokens that fit: {p.kv_tokens}" in p.describe()
    # Per layer (the XLA path): attention and shared weights are bf16, and routed experts are dequantized
    # one at a time, so the workspace is one bf16 expert: whole on 8-tp8-ep (each device holds 48 whole
    # experts), a quarter of one on 8-tp4-pp2 (384 experts a device, each split 4 ways by width).
    per_layer = _plan("dummy:kimi-k2.5", "8-tp8-ep.yaml", "80GiB", utilization=1.0)
    assert per_layer.workspace == 3 * 7168 * 2048 * 2 and p.kv_room - per_layer.kv_room == per_layer.workspace
    assert _plan("dummy:kimi-k2.5", "8-tp4-pp2.yaml", "80GiB").workspace == 3 * 7168 * 2048 * 2 / 4
    on_h200 = _plan("kimi-k2.5", "8-tp8-ep.yaml", "141GB", dequant="fused")
    assert on_h200.kv_room > 30 * GiB and on_h200.weights == p.weights


def test_llama4_scout_on_two_h200s_counts_the_hybrid_cache(capsys):
    """Issue 33's figures by hand. Scout on 2 x 140 GiB at 0.95, mesh 2.yaml (tp 2): 8 kv heads / 2 x 128
    x (k, v) x 2 bytes = 2048 bytes a layer-token per device; pages of 12 layers (1 global group of
    the NoPE layers, 3 chunked groups of 12) x 16 tokens = 393,216 bytes. A sequence of T tokens holds
    ceil(T / 16) global blocks and at most 8192 / 16 + 1 = 513 blocks in each chunked group; a step of
    8192 tokens takes 512 transient blocks in each chunked group; the null page is not usable."""
    from infire_jax.cli import main

    p = _plan("dummy:llama-4-scout", "2.yaml", "140GiB", utilization=0.95)
    assert p.kv_bytes_per_token == 48 * 2048 and 2 * p.kv_room >= 56 * GiB
    pages = int(p.kv_room // (12 * 16 * 2048))
    assert p.kv_pages == pages
    budget = pages - 1 - 3 * 512
    assert p.context_tokens(1) == 16 * (budget - 3 * 513) >= 1_200_000
    assert p.context_tokens(8) == 16 * (budget // 8 - 3 * 513)
    assert p.context_tokens(64) == 16 * (budget // 64 // 4) < 8192  # shorter than a chunk: 4 groups of ceil(T / 16)
    # Every page kept (no chunk bound): 31.4 GiB / (48 x 2 KiB) = about 343k tokens, under a third.
    assert p.context_tokens(1) > 3.8 * p.kv_room // p.kv_bytes_per_token
    assert main(["plan", "--model", "dummy:llama-4-scout", "--devices", "2", "--device-memory", "140GiB",
                 "--gpu-memory-utilization", "0.95"]) == 0
    out = capsys.readouterr().out
    assert f"KV room in all: 2 x {p.kv_room / GiB:.2f} GiB = {2 * p.kv_room / GiB:.2f} GiB" in out
    assert "1 x global (12 layers), 3 x chunk 8192 (36 layers); a page holds 12 layers" in out
    assert f"KV tokens that fit: {p.context_tokens(1)} (one sequence)" in out
    assert f"KV tokens that fit, 8 sequences: {p.context_tokens(8)} each" in out
    assert f"KV tokens that fit, 64 sequences: {p.context_tokens(64)} each" in out


@pytest.mark.parametrize("name,modes", [("llama-4-scout", ("int8", "int4")), ("gemma-4-26b-a4b", ("fp8", "int4")),
                                        ("gemma-4-31b", ("int8",)), ("glm-4.5-air", ("fp8", "int4"))])
def test_models_of_two_stacks_quantized_at_load_plan_their_kept_parts(name, modes):
    """Llama 4's, Gemma 4's and GLM-4.5's layer weights sit in two stacks ("moe_layers.wqkv", "full_layers.wo",
    ...): the plan keeps each of them as the layout its name in the stack takes (8-bit values and scales, int4
    parts in pieces that divide both stacks' groups: GLM-4.5-Air's dense and MoE w_down differ in width; Gemma
    4's experts too), as the engine's model holds them: the abstract model's bytes, well under bf16's."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from infire_jax.loaders.dummy import CONFIGS
    from infire_jax.loaders.gguf_quant import dummy_layouts
    from infire_jax.models.registry import abstract_model

    mc = MeshConfig.from_yaml(os.path.join(CONFIG_DIR, "1.yaml"))
    cfg = config_from_hf(CONFIGS[name])
    plain = plan_source(f"dummy:{name}", "bfloat16")(mc)
    for mode in modes:
        model = plan_source(f"dummy:{name}", "bfloat16", mode)(mc)
        state = nnx.state(abstract_model(cfg, jnp.bfloat16, dummy_layouts(cfg, mode)))
        built = sum(int(np.prod(v.shape)) * jnp.dtype(v.dtype).itemsize for _, v in nnx.to_flat_state(state))
        # the text model's (Scout's vision tower is planned beside quantized weights as beside float ones)
        planned, float_bytes = (sum(tensor_bytes(t, m, mc, "bfloat16") for t in m.tensors if t.kind != "vision")
                                for m in (model, plain))
        assert planned == built < float_bytes * 0.6, mode


def test_quantization_configs_choose_each_kinds_format():
    with open(os.path.join(ROOT, "infire_jax", "memplan", "configs", "kimi-k2.5.json")) as f:
        kimi = json.load(f)
    assert formats_from_hf(kimi, "bfloat16") == {"attention": "bfloat16", "experts": "int4-g32",
                                                "shared": "bfloat16", "embeddings": "bfloat16",
                                                "vision": "bfloat16", "speculation": "bfloat16"}
    with open(os.path.join(ROOT, "infire_jax", "memplan", "configs", "deepseek-v3.json")) as f:
        ds = json.load(f)
    assert formats_from_hf(ds, "bfloat16") == {"attention": "fp8-block128", "experts": "fp8-block128",
                                              "shared": "fp8-block128", "embeddings": "bfloat16",
                                              "vision": "bfloat16", "speculation": "bfloat16"}
    p = _plan("deepseek-v3", "8-tp4-pp2.yaml", "141GB")
    assert p.kv_bytes_per_token == 31 * 576 * 2  # 61 layers in 2 stages of 31 slots


def _mesh(name: str) -> MeshConfig:
    return MeshConfig.from_yaml(os.path.join(CONFIG_DIR, name))


def _int4_plan(qc: dict, mesh: str):
    """The plan of the dense model quantized as `qc` describes, on `mesh`."""
    mc, cfg = MeshConfig.from_yaml(os.path.join(CONFIG_DIR, mesh)), config_from_hf(MODELS["dense"])
    layouts = kept_layouts(dict(MODELS["dense"], quantization_config=qc), cfg)
    return memory_plan(from_model_config(placed_config(cfg, mc), "bfloat16", quantized=layouts), mc, GiB)


@pytest.mark.parametrize("call, field", [
    (lambda: parse_bytes("80 parsecs"), "--device-memory"),
    (lambda: from_hf_config({"kv_lora_rank": 512, "hidden_size": 64}), "num_hidden_layers"),
    (lambda: formats_from_hf({"kv_lora_rank": 512, "quantization_config": {"quant_method": "fp8",
                                                                             "weight_block_size": [64, 64]}},
                             "bfloat16"), "weight_block_size"),
    (lambda: kept_layouts(dict(MODELS["moe"], quantization_config=quantization_config("awq", 32)),
                          config_from_hf(MODELS["moe"])), "its weights are kept .and planned. for dense"),
    (lambda: kept_layouts(dict(MODELS["dense"], quantization_config=dict(quantization_config("gptq", 32), bits=3)),
                          config_from_hf(MODELS["dense"])), "quantization_config.bits = 3"),
    (lambda: from_hf_config(dict(TINY_MLA, quantization_config=quantization_config("gptq", 32))), "not MLA ones"),
    (lambda: _int4_plan(quantization_config("gptq", 32), "8.yaml"), "w_down.zero: 4 entries cannot be split 8"),
    (lambda: memory_plan(from_model_config(placed_config(config_from_hf(MODELS["dense"]), _mesh("8.yaml")), "bfloat16",
                                           quantized=at_load_layouts(config_from_hf(MODELS["dense"]), "int4", 32)),
                         _mesh("8.yaml"), GiB), "w_down.zero: 4 entries cannot be split 8"),
    (lambda: at_load_layouts(config_from_hf(dict(MODELS["dense"], head_dim=12)), "int4", 32),
     r"layers\.wo: int4 groups of 32 over its 96 inputs \(heads of 12\)"),
    (lambda: plan_source("deepseek-v3", "bfloat16", "int4"), "not MLA ones"),
    (lambda: plan_source(None, "bfloat16", "gguf"), "weights_quantization 'gguf' is not planned at load"),
    (lambda: plan_source(None, "bfloat16", "int4", 64), r"int4_group_size 64: choose from \[32, 128\]"),
    (lambda: memory_plan(from_hf_config(dict(TINY_MLA, num_attention_heads=6)),
                         MeshConfig.from_yaml(os.path.join(CONFIG_DIR, "8.yaml")), GiB), "6 attention heads"),
])
def test_bad_input_names_the_field(call, field):
    with pytest.raises(ValueError, match=field):
        call()


def test_plan_command_picks_a_shipped_mesh(capsys):
    from infire_jax.cli import main

    assert main(["plan", "--model", "dummy:kimi-k2.5", "--devices", "8", "--device-memory", "141GB"]) == 0
    out = capsys.readouterr().out
    assert "KV room per device: " in out and "mesh 8" in out and "experts" in out
    assert main(["plan", "--model", "kimi-k2.5", "--devices", "3", "--device-memory", "80GiB"]) == 2
    assert "no shipped mesh for 3 devices" in capsys.readouterr().err
    # --max-num-batched-tokens reads sizes as serve's does (vLLM's): 8K is 8192, the default
    base = ["plan", "--model", "dummy:llama-3.1-8b", "--devices", "1", "--device-memory", "80GiB"]
    outs = []
    for tokens in ("8192", "8K", "16k"):
        assert main([*base, "--max-num-batched-tokens", tokens]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] != outs[2]
    with pytest.raises(SystemExit) as e:
        main([*base, "--max-num-batched-tokens", "8.5"])
    assert e.value.code == 2 and "argument --max-num-batched-tokens: expected a positive whole number" in \
        capsys.readouterr().err
