"""Lossless BF16 compression: bit-exact round trips of both formats (adversarial arrays, every
tensor of the default model and of a tiny random one), compressed checkpoints that refuse damage,
and engines serving compressed weights with the bfloat16 model's exact tokens and logprobs."""

from __future__ import annotations

import json
import os
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infire_jax.compression import (
    BF16, as_bf16, decode_entropy, decode_palette, encode_entropy, encode_palette, merge_bf16, parse_kinds, split_bf16)
from infire_jax.compression.palette import ROW, decode_palette_block
from infire_jax.compression.resident import parse_resident
from infire_jax.errors import ConfigError, CorruptCheckpointError
from infire_jax.loaders.compressed import MANIFEST, WEIGHTS, _json_crc32, write_compressed
from infire_jax.loaders.load import load_model
from infire_jax.models.config import ModelConfig

PROMPTS = ["The capital of France is", "Once upon a time,", "def add(a, b):"]
ENGINE = dict(dtype="bfloat16", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, token_buckets=[4, 32],
              num_kv_pages=32)


def bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).view(np.uint16)


def from_bits(b) -> np.ndarray:
    return np.asarray(b, np.uint16).view(BF16)


def assert_round_trips(x: np.ndarray, stacked: bool, grids=(None,)) -> None:
    """Both formats, and the device decoder of every palette group, give back `x` bit for bit."""
    for grid in grids:
        t = encode_palette(x, stacked=stacked, grid=grid)
        np.testing.assert_array_equal(bits(decode_palette(t)), bits(x))
        again = encode_palette(x, stacked=stacked, grid=grid)
        assert all(np.array_equal(a, b) for a, b in zip(t.arrays().values(), again.arrays().values()))
    np.testing.assert_array_equal(bits(decode_entropy(encode_entropy(x))), bits(x))
    if stacked:
        assert_device_decoder_exact(x, layers=range(x.shape[0]))


def assert_device_decoder_exact(x: np.ndarray, layers) -> None:
    """The jitted device decoder of one layer (what the scanned layer body runs) gives it back exactly."""
    t = encode_palette(x, stacked=True)
    decode = jax.jit(decode_palette_block)
    for layer in layers:
        parts = [jnp.asarray(a[layer]) for a in (t.codes, t.sign_mantissa, t.palette, t.esc_rows, t.esc_exp)]
        np.testing.assert_array_equal(bits(np.asarray(decode(*parts))), bits(x[layer]))


# ---- the formats ----------------------------------------------------------------------------------

def test_split_and_merge_cover_every_bit_pattern():
    x = from_bits(np.arange(1 << 16))
    e, sm = split_bf16(x)
    np.testing.assert_array_equal(bits(merge_bf16(e, sm)), np.arange(1 << 16))
    assert (e == (np.arange(1 << 16) >> 7) % 256).all()


ADVERSARIAL = {
    # all 65536 bit patterns: every exponent, +-0, subnormals, +-inf and every NaN
    "every_pattern": from_bits(np.arange(1 << 16)).reshape(4, 128, 128),
    "all_exponents_equal": from_bits(np.full((2, 64, 96), 0x3F00) | np.arange(2 * 64 * 96).reshape(2, 64, 96) % 128),
    # 32 exponents in every row: no palette of 16 covers any row, so every row is an escape row
    "only_escapes": from_bits(((np.arange(3 * 64 * 64) % 32 + 100) << 7) | 5).reshape(3, 64, 64),
    "zeros_subnormals_inf_nan": from_bits(np.resize(np.array([0x0000, 0x8000, 0x0001, 0x807F, 0x7F80, 0xFF80, 0x7FC0,
                                                              0xFFFF, 0x3F80], np.uint16), (2, 64, 64))),
}


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_adversarial_arrays_round_trip(name):
    x = ADVERSARIAL[name]
    assert_round_trips(x, stacked=True, grids=(None, (x.shape[0], 2, 2)))
    assert_round_trips(x.reshape(-1, x.shape[-1]), stacked=False, grids=(None, (4, 2)))
    t = encode_palette(x, stacked=True)
    if name == "only_escapes":
        assert (t.esc_rows < x[0].size // ROW).all() and t.esc_rows.shape[-1] == x[0].size // ROW
    if name == "all_exponents_equal":
        assert (t.esc_rows == x[0].size // ROW).all()  # padding only
        assert encode_entropy(x).stream.size == 0  # one symbol costs nothing


def test_bad_layouts_and_damaged_parts_are_refused():
    x = as_bf16(np.ones((2, 64, 32), np.float32))
    with pytest.raises(ValueError, match="does not split shape"):
        encode_palette(x, stacked=True, grid=(2, 3, 1))
    with pytest.raises(ValueError, match="no whole number of 64-weight rows"):
        encode_palette(as_bf16(np.ones((2, 10, 6), np.float32)), stacked=True)
    with pytest.raises(ValueError, match="must be even"):
        encode_palette(as_bf16(np.ones((2, 64, 3), np.float32)), stacked=True)
    with pytest.raises(TypeError, match="bfloat16"):
        split_bf16(np.ones(4, np.float32))
    t = encode_palette(x, stacked=True)
    with pytest.raises(ValueError, match="escape rows outside"):
        decode_palette(type(t)(**{**t.arrays(), "esc_rows": t.esc_rows + 100}, stacked=True))
    e = encode_entropy(as_bf16(np.linspace(-1, 1, 4096, dtype=np.float32)))
    with pytest.raises(ValueError, match="do not describe"):
        decode_entropy(type(e)(**{**e.arrays(), "counts": e.counts + 1}))
    with pytest.raises(ValueError, match="blocks"):
        decode_entropy(type(e)(**{**e.arrays(), "stream": e.stream[:-1]}))
    with pytest.raises(ValueError, match="unknown tensor kinds"):
        parse_kinds("mlp,bias")
    with pytest.raises(ValueError, match="not \\['embed'\\]"):
        parse_resident("palette:mlp,embed")
    with pytest.raises(ValueError, match="unknown weights compression"):
        parse_resident("huffman")


@pytest.fixture(scope="module")
def smol():
    return load_model(None)


def test_device_decoder_on_the_default_models_layer_weights(smol):
    """Every tensor of the default model round-trips in both formats in test_checkpoint_loads_the_bf16_weights;
    here the device decoder on real layer weights and their escape rows."""
    for name in ("layers.w_gate_up", "layers.w_down", "layers.wqkv", "layers.wo"):
        x = as_bf16(smol.weights[name])
        assert (encode_palette(x, stacked=True).esc_rows < x[0].size // ROW).any(), name  # real escapes
        assert_device_decoder_exact(x, layers=(0, x.shape[0] - 1))


def test_every_tensor_of_a_tiny_random_model_round_trips():
    from infire_jax.models.registry import abstract_placement

    cfg = ModelConfig(architecture="qwen3_moe", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, qk_norm=True)
    _, flat, _ = abstract_placement(cfg, jnp.bfloat16, None)
    rng = np.random.default_rng(3)
    weights = {".".join(map(str, p)): as_bf16(rng.normal(0, 0.02, var.shape).astype(np.float32)) for p, var in flat}
    assert {"layers.w_gate_up", "layers.router", "layers.q_norm", "embed", "lm_head"} <= set(weights)
    for name, x in weights.items():
        if x.ndim > 1 and x[0].size % ROW == 0:
            assert_round_trips(x, stacked=name.startswith("layers."))
        else:
            np.testing.assert_array_equal(bits(decode_entropy(encode_entropy(x))), bits(x))


# ---- compressed checkpoints ---------------------------------------------------------------------

def compress(capsys, out, *args: str) -> str:
    from infire_jax.cli import main

    assert main(["compress", "--out", str(out), *args]) == 0
    printed = capsys.readouterr().out
    assert "model:" in printed and "mlp:" in printed and "attn:" in printed
    return str(out)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The default model with every matrix compressed, in each format (so every tensor round-trips)."""
    base = tmp_path_factory.mktemp("compressed")
    model = load_model(None)
    for fmt in ("entropy", "palette"):
        write_compressed(model, str(base / fmt), fmt, ("mlp", "attn", "embed"))
    return {fmt: str(base / fmt) for fmt in ("entropy", "palette")}


def test_compress_command(tmp_path, capsys):
    out = compress(capsys, tmp_path / "mlp", "--format", "palette")
    tensors = json.loads(open(os.path.join(out, MANIFEST)).read())["body"]["tensors"]
    assert {n for n, e in tensors.items() if e["codec"] == "palette"} == {"layers.w_gate_up", "layers.w_down"}
    from infire_jax.cli import main

    assert main(["compress", "--out", str(tmp_path / "x"), "--tensors", "mlp,bias"]) == 2
    assert "unknown tensor kinds ['bias']" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["entropy", "palette"])
def test_checkpoint_loads_the_bf16_weights(checkpoints, smol, fmt):
    loaded = load_model(checkpoints[fmt])
    assert loaded.config == smol.config and set(loaded.weights) == set(smol.weights)
    for name, w in smol.weights.items():
        np.testing.assert_array_equal(bits(loaded.weights[name]), bits(as_bf16(w)), err_msg=name)
    stored = os.path.getsize(os.path.join(checkpoints[fmt], WEIGHTS))
    bf16_bytes = sum(as_bf16(w).nbytes for w in smol.weights.values())
    assert stored < (0.70 if fmt == "entropy" else 0.77) * bf16_bytes


def test_damaged_checkpoints_are_refused(tmp_path, smol):
    import shutil

    from infire_jax.loaders.weights import LoadedModel

    cfg = ModelConfig(architecture="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16)
    rng = np.random.default_rng(0)
    weights = {"embed": rng.normal(0, 0.02, (256, 64)), "final_norm": np.ones(64),
               "layers.attn_norm": np.ones((2, 64)), "layers.mlp_norm": np.ones((2, 64)),
               "layers.wqkv": rng.normal(0, 0.02, (2, 64, 2, 4, 16)),
               "layers.wo": rng.normal(0, 0.02, (2, 4, 16, 64)),
               "layers.w_gate_up": rng.normal(0, 0.02, (2, 64, 2, 128)),
               "layers.w_down": rng.normal(0, 0.02, (2, 128, 64))}
    tiny = LoadedModel(cfg, smol.tokenizer, "tiny", {k: v.astype(np.float32) for k, v in weights.items()})
    src = str(tmp_path / "src")
    write_compressed(tiny, src, "entropy", ("mlp", "attn"))
    np.testing.assert_array_equal(bits(load_model(src).weights["layers.w_down"]),
                                  bits(as_bf16(tiny.weights["layers.w_down"])))
    cases = {"flipped": lambda f: (f.seek(os.path.getsize(f.name) // 2), f.write(b"\x5a")),
             "truncated": lambda f: f.truncate(os.path.getsize(f.name) - 1000)}
    for case, damage in cases.items():
        bad = str(tmp_path / case)
        shutil.copytree(src, bad)
        with open(os.path.join(bad, WEIGHTS), "r+b") as f:
            damage(f)
        with pytest.raises(CorruptCheckpointError, match=f"{WEIGHTS} (fails its SHA-256|has .* bytes)"):
            load_model(bad)
    bad = str(tmp_path / "manifest")
    shutil.copytree(src, bad)
    doc = json.loads(open(os.path.join(bad, MANIFEST)).read())
    doc["body"]["tensors"]["layers.w_down"]["crc32"] ^= 1
    open(os.path.join(bad, MANIFEST), "w").write(json.dumps(doc))
    with pytest.raises(CorruptCheckpointError, match=f"{MANIFEST} fails its CRC32"):
        load_model(bad)
    doc["crc32"] = _json_crc32(doc["body"])
    open(os.path.join(bad, MANIFEST), "w").write(json.dumps(doc))  # a consistent manifest, wrong tensor checksum
    with pytest.raises(CorruptCheckpointError, match="tensor 'layers.w_down' decodes to wrong weights"):
        load_model(bad)
    os.remove(os.path.join(bad, "tokenizer.json"))
    with pytest.raises(CorruptCheckpointError, match="tokenizer.json is missing"):
        load_model(bad)
    with pytest.raises(ConfigError, match="exists and is not empty"):
        write_compressed(tiny, src, "palette", ("mlp",))


def test_compression_ratio_of_a_foreign_safetensors_file(tmp_path, capsys):
    """`bench.compression_ratio --safetensors`: any checkpoint's float tensors rounded to bfloat16,
    the MLP group picked by name (BERT's intermediate/output dense, not attention's output), each
    method's bytes those of its own encoder on the same tensors."""
    from safetensors.numpy import save_file

    from infire_jax.bench import compression_ratio

    rng = np.random.default_rng(3)
    tensors = {"encoder.layer.0.intermediate.dense.weight": rng.normal(0, 0.05, (128, 64)),
               "encoder.layer.0.output.dense.weight": rng.normal(0, 0.05, (64, 128)),
               "encoder.layer.0.attention.output.dense.weight": rng.normal(0, 0.05, (64, 64)),
               "encoder.layer.0.output.LayerNorm.weight": np.ones(64), "position_ids": np.arange(8)}
    path = str(tmp_path / "model.safetensors")
    save_file({n: t.astype(np.int64 if n == "position_ids" else np.float32) for n, t in tensors.items()}, path)
    out = str(tmp_path / "ratio.json")
    assert compression_ratio.main(["--safetensors", path, "--methods", "palette,entropy", "--json", out]) == 0
    rows = {(r["group"], r["method"]): r for r in json.load(open(out))}
    mlp = [as_bf16(tensors[n].astype(np.float32)) for n in list(tensors)[:2]]
    assert rows["mlp", "palette"]["bf16_bytes"] == sum(x.nbytes for x in mlp)
    assert rows["mlp", "palette"]["bytes"] == sum(encode_palette(x, stacked=False).nbytes for x in mlp)
    assert rows["mlp", "entropy"]["bytes"] == sum(encode_entropy(x).nbytes for x in mlp)
    assert rows["model", "palette"]["bf16_bytes"] == sum(x.nbytes for x in mlp) + 2 * (64 * 64 + 64)
    assert "mlp" in capsys.readouterr().out


# ---- engines on compressed weights ------------------------------------------------------------------

def generate(monkeypatch, **kwargs) -> list[tuple[list[int], list[float]]]:
    from infire_jax import LLM, SamplingParams

    monkeypatch.setenv("INFIRE_JAX_NO_CHECKPOINT", "1")  # no placed-weights cache written for tmp models
    llm = LLM(**ENGINE, **kwargs)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=1))
    llm.engine.close()
    return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


def test_compressed_checkpoint_and_resident_weights_serve_the_bf16_model_exactly(checkpoints, monkeypatch):
    reference = generate(monkeypatch)
    assert generate(monkeypatch, model=checkpoints["palette"]) == reference
    assert generate(monkeypatch, weights_compression="palette:mlp,attn") == reference
    with pytest.raises(ConfigError, match="use dtype bfloat16"):
        from infire_jax import LLM

        LLM(**{**ENGINE, "dtype": "float32"}, weights_compression="palette")


def test_sharded_resident_compression_equals_unsharded(tmp_path, smol):
    """tp x pp and tp x ep on 8 virtual devices: compressed weights give the bfloat16 run of the same
    mesh exactly, and every device holds only its shard of them. Against the single device, bfloat16
    sums in another order (psum), so only the first token and the logprobs up to where they part."""
    from test_sharding import _assert_each_device_holds_its_shard, _hf_dir, _results, _run_worker

    from sharding.mesh import CONFIG_DIR

    models = {family: _hf_dir(tmp_path / family, family, smol.tokenizer) for family in ("llama", "mixtral")}
    runs = [{"model": models["llama"], "mesh": "1.yaml"}]
    runs += [{"model": models[f], "mesh": m, "weights_compression": wc}
             for f, m in (("llama", "8-tp4-pp2.yaml"), ("mixtral", "8-tp2-ep4.yaml"))
             for wc in (None, "palette:mlp,attn")]
    runs = [{**r, "mesh": os.path.join(CONFIG_DIR, r["mesh"]), "dtype": "bfloat16"} for r in runs]
    # one bucket, one decode step a launch: a burst is the same layers again, and the small bucket another forward
    # (on meshes: test_sharding's), each another compile; the scheduler's steps are the same (chunked by the budget)
    engine = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, token_buckets=[32], num_kv_pages=32,
                  num_decode_steps=1)
    results = _results(_run_worker({"runs": runs, "prompts": PROMPTS, "max_tokens": 4, "engine": engine},
                                   8, tmp_path, "compressed"))
    assert len(results) == len(runs) and all(r["fits"] for r in results)
    by = {(r["model"], os.path.basename(r["mesh"]), r["weights_compression"]): r for r in results}
    for (model, mesh, wc), r in by.items():
        if not wc:
            continue
        plain = by[(model, mesh, None)]
        assert (r["tokens"], r["logprobs"]) == (plain["tokens"], plain["logprobs"]), (model, mesh)
        assert any(name.endswith(".esc_rows") for name in r["params"])
        _assert_each_device_holds_its_shard(r)
    single, sharded = by[(models["llama"], "1.yaml", None)], by[(models["llama"], "8-tp4-pp2.yaml", "palette:mlp,attn")]
    for a, b, la, lb in zip(single["tokens"], sharded["tokens"], single["logprobs"], sharded["logprobs"]):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        assert same >= 1
        np.testing.assert_allclose(la[:same], lb[:same], rtol=0.05, atol=0.02)


# ---- the GPU kernel, in interpret mode ------------------------------------------------------------

def test_palette_matmul_kernel_reconstructs_exactly_and_multiplies():
    """The Pallas kernel's tile decoder gives the weights bit for bit (escape rows, +-0, subnormals,
    inf, NaN); its matmul matches a float64 reference of the same bfloat16 operands."""
    from infire_jax.compression.tiles import encode_tiles
    from pallas_kernels.palette_matmul import palette_decode, palette_matmul

    rng = np.random.default_rng(1)
    w = rng.normal(0, 0.02, (192, 128)).astype(np.float32)
    w[5, :64] = 2.0 ** (np.arange(64) % 32 - 20)  # a row of 32 exponents: an escape row
    w[100, 70], w[130, 3], w[131, 4], w[150, 100] = 3e5, -1e-40, 0.0, -0.0
    finite = as_bf16(w)
    special = finite.copy()
    special[7, 9], special[8, 10], special[9, 11] = np.inf, -np.inf, np.nan
    for x in (finite, special):
        parts = {k: jnp.asarray(v) for k, v in encode_tiles(x).items()}
        assert int((parts["esc_rows"] < 64).sum()) >= 2
        np.testing.assert_array_equal(bits(np.asarray(palette_decode(**parts, interpret=True))), bits(x))
    parts = {k: jnp.asarray(v) for k, v in encode_tiles(finite).items()}
    x = rng.normal(size=(3, 192)).astype(np.float32)
    xb = np.asarray(as_bf16(x), np.float64)
    y = np.asarray(palette_matmul(jnp.asarray(x), **parts, interpret=True))
    scale = np.abs(xb) @ np.abs(np.asarray(finite, np.float64))
    np.testing.assert_array_less(np.abs(y - xb @ np.asarray(finite, np.float64)), 1e-5 * scale + 1e-30)
    with pytest.raises(ValueError, match="tiles"):
        encode_tiles(finite[:100])
