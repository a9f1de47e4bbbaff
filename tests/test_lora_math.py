"""LoRA adapters without an engine: the batched deltas (jnp BGMV, SGMV tiles, the CPU FFI call)
against float64 numpy, the device-slot layout against PEFT's per-module products, the slot table,
and the refusals of adapters we cannot serve (tests/test_lora.py runs them through the engine)."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from infire_jax.errors import InvalidRequestError
from infire_jax.lora.batched import bgmv, lora_delta, sgmv
from infire_jax.lora.config import LoRAConfig
from infire_jax.lora.layout import MEMBERS, column_members, out_shape, slot_arrays, stack_layout
from infire_jax.lora.peft import AdapterNotFoundError, PeftAdapter, model_modules, read_adapter
from infire_jax.lora.slots import SlotTable
from infire_jax.loaders.weights import fuse_projections, from_hf_layout
from infire_jax.models.config import ModelConfig
from pallas_kernels import cpu_kernels, cpu_lora

CFG = ModelConfig(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16)
MOE = ModelConfig(architecture="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=0, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=16)
HF_NAMES = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo", "gate_proj": "w_gate", "up_proj": "w_up",
            "down_proj": "w_down"}


# ---- the batched deltas ----------------------------------------------------------------------------

def _stacks(rng, name: str, out: tuple[int, ...], k: int, *, layers=2, slots=5, rank=16, dtype=np.float32):
    c = len(MEMBERS[name])
    a = rng.standard_normal((layers, slots, c * rank, k)).astype(np.float32)
    b = rng.standard_normal((layers, slots, rank, int(np.prod(out)))).astype(np.float32)
    a[:, 0], b[:, 0] = 0, 0  # slot 0: the base model
    return a.astype(dtype), b.astype(dtype)


def _np_delta(x, a, b, layer, slots, members):
    """float64: each token's u = A x, then y[n] = sum_j u[member(n) R + j] B[j, n]."""
    r = b.shape[2]
    out = np.zeros((x.shape[0], b.shape[3]))
    for t, s in enumerate(slots):
        u = a[layer, s].astype(np.float64) @ x[t].astype(np.float64)
        rows = u.reshape(-1, r)[members]  # [N, R]
        out[t] = np.einsum("nj,jn->n", rows, b[layer, s].astype(np.float64))
    return out


WEIGHTS = [("wqkv", (2, 4, 16), 32), ("wo", (32,), 64), ("w_gate_up", (2, 48), 32), ("w_down", (32,), 48)]


@pytest.mark.parametrize("name,out,k", WEIGHTS)
@pytest.mark.parametrize("tokens", [7, 70])
def test_deltas_match_float64(name, out, k, tokens, cpu_device):
    """Every path, slot 0 included (zero delta), on each adapted weight's fused layout."""
    rng = np.random.default_rng(tokens)
    a, b = _stacks(rng, name, out, k)
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    slots = rng.integers(0, 5, tokens).astype(np.int32)
    members = column_members(name, out)
    want = _np_delta(x, a, b, 1, slots, members)
    scale = np.abs(want).max()
    paths = {"bgmv": bgmv, "sgmv": sgmv}
    if cpu_kernels.available():
        paths["kernel"] = lambda x, a, b, layer, s, m: cpu_lora.lora_sgmv(x, a, b, s, m, layer)
    with jax.default_matmul_precision("highest"):
        for path, fn in paths.items():
            run = jax.jit(lambda *args, fn=fn: fn(*args, members))
            got = np.asarray(run(jnp.asarray(x), jnp.asarray(a), jnp.asarray(b), jnp.int32(1), jnp.asarray(slots)))
            np.testing.assert_allclose(got, want, atol=2e-6 * scale, rtol=0, err_msg=path)
            assert not got[slots == 0].any(), path


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler for the CPU kernels")
def test_kernel_rows_do_not_depend_on_the_batch(cpu_device):
    """A token's delta is bitwise the same alone and in a batch of other slots (bfloat16 stacks too)."""
    rng = np.random.default_rng(0)
    for dtype in (np.float32, jnp.bfloat16):
        a, b = _stacks(rng, "wqkv", (2, 4, 16), 32, dtype=dtype)
        x = rng.standard_normal((9, 32)).astype(np.float32)
        slots = np.array([3, 1, 0, 3, 2, 4, 3, 1, 2], np.int32)
        members = column_members("wqkv", (2, 4, 16))
        batch = np.asarray(cpu_lora.lora_sgmv(jnp.asarray(x), jnp.asarray(a), jnp.asarray(b), jnp.asarray(slots),
                                              members, jnp.int32(0)))
        for t in range(9):
            alone = np.asarray(cpu_lora.lora_sgmv(jnp.asarray(x[t:t + 1]), jnp.asarray(a), jnp.asarray(b),
                                                  jnp.asarray(slots[t:t + 1]), members, jnp.int32(0)))
            np.testing.assert_array_equal(alone[0], batch[t])
        want = _np_delta(x, np.asarray(a, np.float32), np.asarray(b, np.float32), 0, slots, members)
        np.testing.assert_allclose(batch, want, atol=2e-6 * np.abs(want).max(), rtol=0)


def test_lora_delta_takes_w_shapes(cpu_device):
    """lora_delta reshapes x [T, *in] and returns [T, *out] in x's dtype, whatever path it takes."""
    rng = np.random.default_rng(1)
    a, b = _stacks(rng, "wo", (32,), 64)
    a = a.reshape(2, 5, 16, 4, 16)  # wo's input axes: (heads, head_dim)
    x = rng.standard_normal((3, 4, 16)).astype(np.float32)
    slots = np.array([1, 0, 4], np.int32)
    want = _np_delta(x.reshape(3, 64), a.reshape(2, 5, 16, 64), b, 1, slots, column_members("wo", (32,)))
    for kernel in (False, True):
        with jax.default_matmul_precision("highest"):
            got = lora_delta(jnp.asarray(x), jnp.asarray(a), jnp.asarray(b), jnp.int32(1), jnp.asarray(slots),
                             "wo", kernel)
        assert got.shape == (3, 32) and got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-6 * np.abs(want).max(), rtol=0)


# ---- the slots' layout -----------------------------------------------------------------------------

def _random_adapter(rng, cfg: ModelConfig, rank: int, modules, scale=0.5, layers=None) -> PeftAdapter:
    known = model_modules(cfg)
    mods = {}
    for layer in layers if layers is not None else range(cfg.num_layers):
        for m in modules:
            _, fan_in, fan_out = known[m]
            mods[layer, m] = (rng.standard_normal((rank, fan_in)).astype(np.float32),
                              rng.standard_normal((fan_out, rank)).astype(np.float32))
    return PeftAdapter("mem", rank, scale, mods, "digest")


def _peft_outputs(adapter: PeftAdapter, cfg: ModelConfig, x: dict[str, np.ndarray], layer: int) -> dict[str, np.ndarray]:
    """PEFT's delta of every adapted module, scale * (x A^T) B^T in HF's [T, out] layout, then put in
    the model's fused output layout by the loaders' own conversion of base weights (each delta taken
    as a weight whose input axis is the tokens), flattened to [T, N]."""
    known = model_modules(cfg)
    t = x["h"].shape[0]
    as_weight = dataclasses.replace(cfg, hidden_size=t)  # a delta [T, out] read as a weight [out, in = T]
    hf = {}
    for m, short in HF_NAMES.items():
        if m not in known:
            continue
        src = x["o"] if m == "o_proj" else x["down"] if m == "down_proj" else x["h"]
        src = src.reshape(src.shape[0], -1).astype(np.float64)
        delta = np.zeros((src.shape[0], known[m][2]))
        if (layer, m) in adapter.modules:
            a, b = adapter.modules[layer, m]
            delta = adapter.scale * (src @ a.T.astype(np.float64)) @ b.T.astype(np.float64)
        hf[short] = from_hf_layout(short, delta.T, as_weight) if short in ("wq", "wk", "wv", "w_gate", "w_up") \
            else delta
    fused = fuse_projections({k: v for k, v in hf.items() if k != "wo" and k != "w_down"}, cfg)
    out = {"wqkv": fused["wqkv"].reshape(t, -1), "wo": hf["wo"]}
    if "w_gate_up" in fused:
        out["w_gate_up"], out["w_down"] = fused["w_gate_up"].reshape(t, -1), hf["w_down"]
    return out


@pytest.mark.parametrize("cfg", [CFG, MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("fused", [False, True])
def test_slot_arrays_give_peft_deltas(cfg, fused, cpu_device):
    """An adapter placed in a slot gives, through the batched delta, PEFT's per-module deltas in the
    model's fused layout (q heads grouped by kv head; a fused qkv_proj / gate_up_proj split)."""
    rng = np.random.default_rng(2)
    attn = ["qkv_proj", "o_proj"] if fused else ["q_proj", "k_proj", "v_proj", "o_proj"]
    mlp = [] if cfg.is_moe else (["gate_up_proj", "down_proj"] if fused else ["gate_proj", "up_proj", "down_proj"])
    adapter = _random_adapter(rng, cfg, 4, attn + mlp, layers=[1])
    if fused:  # the reference takes the members: split the fused modules as PEFT's fused layer computes them
        ref = dict(adapter.modules)
        a, b = ref.pop((1, "qkv_proj"))
        hq, hkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        for m, part in zip(("q_proj", "k_proj", "v_proj"), np.split(b, [hq, hq + hkv])):
            ref[1, m] = (a, part)
        if mlp:
            a, b = ref.pop((1, "gate_up_proj"))
            for m, part in zip(("gate_proj", "up_proj"), np.split(b, 2)):
                ref[1, m] = (a, part)
        reference = PeftAdapter("mem", 4, adapter.scale, ref, "d")
    else:
        reference = adapter
    lc = LoRAConfig(max_loras=2, max_lora_rank=8)
    arrays = slot_arrays(adapter, cfg, lc, np.float32)
    layout = stack_layout(cfg, lc)
    assert {k: v.shape for k, v in arrays.items()} == {k: (s[0], *s[2:]) for k, (s, _) in layout.items()}
    t = 3
    x = {"h": rng.standard_normal((t, cfg.hidden_size)).astype(np.float32),
         "o": rng.standard_normal((t, cfg.num_heads, cfg.head_dim)).astype(np.float32),
         "down": rng.standard_normal((t, cfg.intermediate_size)).astype(np.float32)}
    want = _peft_outputs(reference, cfg, x, layer=1)
    slots = jnp.asarray([2, 2, 2], jnp.int32)
    for name in want:
        a = np.zeros(layout[f"lora_{name}_a"][0], np.float32)
        b = np.zeros(layout[f"lora_{name}_b"][0], np.float32)
        a[:, 2], b[:, 2] = arrays[f"lora_{name}_a"], arrays[f"lora_{name}_b"]
        src = {"wo": x["o"], "w_down": x["down"]}.get(name, x["h"])
        with jax.default_matmul_precision("highest"):
            got = lora_delta(jnp.asarray(src), jnp.asarray(a), jnp.asarray(b), jnp.int32(1), slots, name, False)
        assert got.shape == (t, *out_shape(name, cfg))
        np.testing.assert_allclose(np.asarray(got).reshape(t, -1), want[name], atol=1e-4 * np.abs(want[name]).max(),
                                   err_msg=name)


# ---- the slot table --------------------------------------------------------------------------------

def test_slot_table_pins_and_evicts_least_recently_used():
    table = SlotTable(2)
    assert table.acquire("a") == (1, True) and table.acquire("b") == (2, True)
    assert table.acquire("c") is None  # both pinned
    assert table.acquire("a") == (1, False)  # resident: no copy
    table.release(1)
    table.release(1)
    table.release(2)
    assert table.acquire("c") == (1, True)  # a was released first: the least recently used
    assert table.slot_of("a") is None and table.slot_of("b") == 2
    table.release(1)
    table.evict("c")
    assert table.acquire("d") == (1, True)  # an emptied slot is taken before b's
    with pytest.raises(RuntimeError):
        table.evict("d")  # pinned
    table.release(1)
    with pytest.raises(RuntimeError):
        table.release(1)
    table.clear()
    assert table.owner == [None, None, None]


# ---- refusals --------------------------------------------------------------------------------------

def _write(path, config: dict, tensors: dict[str, np.ndarray]) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    return str(path)


def _valid(rank=4, modules=("q_proj", "v_proj"), cfg=CFG):
    rng = np.random.default_rng(3)
    known = model_modules(cfg)
    tensors = {}
    for layer in range(cfg.num_layers):
        for m in modules:
            parent, fan_in, fan_out = known[m]
            key = f"base_model.model.model.layers.{layer}.{parent}.{m}"
            tensors[f"{key}.lora_A.weight"] = rng.standard_normal((rank, fan_in)).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = rng.standard_normal((fan_out, rank)).astype(np.float32)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 8, "target_modules": list(modules), "bias": "none",
              "modules_to_save": None, "use_rslora": False}
    return config, tensors


def test_reads_a_valid_adapter_with_peft_scale(tmp_path):
    config, tensors = _valid()
    adapter = read_adapter(_write(tmp_path / "ok", config, tensors), CFG, max_rank=8)
    assert adapter.rank == 4 and adapter.scale == 2.0 and adapter.module_names == {"q_proj", "v_proj"}
    config["use_rslora"] = True
    assert read_adapter(_write(tmp_path / "rs", config, tensors), CFG, max_rank=8).scale == 4.0  # 8 / sqrt(4)


BAD = [
    ("modules_to_save", lambda c, t: c.update(modules_to_save=["lm_head"]), "modules_to_save"),
    ("dora", lambda c, t: c.update(use_dora=True), "use_dora"),
    ("bias", lambda c, t: c.update(bias="all"), "bias='all'"),
    ("rank_pattern", lambda c, t: c.update(rank_pattern={"q_proj": 2}), "rank_pattern"),
    ("rank", lambda c, t: None, "above the engine's max_lora_rank (2)"),
    ("target", lambda c, t: c.update(target_modules=["q_proj", "lm_head"]), "'lm_head'"),
    ("shape", lambda c, t: t.update({"base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight":
                                    np.zeros((31, 4), np.float32)}), "layer 0 q_proj"),
    ("missing B", lambda c, t: t.pop("base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"),
     "layer 1 v_proj has lora_A but not lora_B"),
    ("layer", lambda c, t: t.update({"base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight":
                                    np.zeros((4, 32), np.float32)}), "layer 7, but the model has 2"),
    ("embedding", lambda c, t: t.update({"base_model.model.model.embed_tokens.lora_embedding_A":
                                        np.zeros((4, 64), np.float32)}), "embed_tokens"),
]


@pytest.mark.parametrize("case,change,message", BAD, ids=[b[0] for b in BAD])
def test_unsupported_adapters_are_refused_by_name(tmp_path, case, change, message):
    config, tensors = _valid()
    change(config, tensors)
    path = _write(tmp_path / "bad", config, tensors)
    with pytest.raises(InvalidRequestError, match=None) as e:
        read_adapter(path, CFG, max_rank=2 if case == "rank" else 8)
    assert message in str(e.value) and not isinstance(e.value, AdapterNotFoundError)


def test_moe_mlp_adapters_and_damaged_files_are_refused(tmp_path):
    config, tensors = _valid(modules=("q_proj", "gate_proj"))
    with pytest.raises(InvalidRequestError, match="mixture of experts"):
        read_adapter(_write(tmp_path / "moe", config, tensors), MOE, max_rank=8)
    config, tensors = _valid()
    path = _write(tmp_path / "cut", config, tensors)
    weights = os.path.join(path, "adapter_model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    with pytest.raises(InvalidRequestError, match="not a readable safetensors file"):
        read_adapter(path, CFG, max_rank=8)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        read_adapter(path, CFG, max_rank=8)
    with pytest.raises(AdapterNotFoundError):
        read_adapter(str(tmp_path / "nowhere"), CFG, max_rank=8)
