"""Checkpoints of placed weights: restored bit-identical to the source loader (one device in both
storage formats, an 8-device tp x pp mesh, two processes), and rebuilt, never served, when stale or
damaged."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from conftest import cpu_env, dying_with_parent
from infire_jax.loaders import checkpoint, load
from infire_jax.loaders.load import load_model
from infire_jax.loaders.paths import DEFAULT_MODEL_NAME
from infire_jax.loaders.dummy import dummy_tokenizer
from infire_jax.loaders.weights import Placed
from infire_jax.models.hf_config import config_from_hf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 8 heads over 2 kv heads and 3 layers: tp=4 repeats each kv head twice, pp=2 pads stage 1 to 2 layers.
# About 20 MB, so a process's share of the reads stands out from metadata and tokenizer reads.
HF_CONFIG = dict(model_type="llama", vocab_size=4096, hidden_size=256, intermediate_size=1024, num_hidden_layers=3,
                 num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5,
                 rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """An HF directory written by hand (HF names and layouts), random weights."""
    path = tmp_path_factory.mktemp("tiny")
    c = HF_CONFIG
    e, f, v, hq, hkv = c["hidden_size"], c["intermediate_size"], c["vocab_size"], 8, 2
    d = e // hq
    rng = np.random.default_rng(0)

    def w(*shape):
        return rng.normal(size=shape).astype(np.float32)

    tensors = {"model.embed_tokens.weight": w(v, e), "model.norm.weight": w(e), "lm_head.weight": w(v, e)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({p + "input_layernorm.weight": w(e), p + "post_attention_layernorm.weight": w(e),
                        p + "self_attn.q_proj.weight": w(hq * d, e), p + "self_attn.k_proj.weight": w(hkv * d, e),
                        p + "self_attn.v_proj.weight": w(hkv * d, e), p + "self_attn.o_proj.weight": w(e, hq * d),
                        p + "mlp.gate_proj.weight": w(f, e), p + "mlp.up_proj.weight": w(f, e),
                        p + "mlp.down_proj.weight": w(e, f)})
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(c))
    dummy_tokenizer(config_from_hf(c)).save(str(path))
    return str(path)


@pytest.fixture(params=["safetensors", "orbax"])
def cache(request, tmp_path, monkeypatch) -> str:
    """A fresh cache; one-device checkpoints in the default format (safetensors) or in orbax."""
    monkeypatch.setenv("INFIRE_JAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("INFIRE_JAX_NO_CHECKPOINT", raising=False)
    monkeypatch.setenv("INFIRE_JAX_CHECKPOINT_FORMAT", request.param)
    return checkpoint.checkpoints_root()


def _weights(placed: Placed) -> dict[str, np.ndarray]:
    return {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(placed.state)}


def _assert_bit_identical(got: dict[str, np.ndarray], source: dict[str, np.ndarray], dtype) -> None:
    assert sorted(got) == sorted(source)
    for name, ref in source.items():
        want = np.asarray(ref).astype(dtype)
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        assert got[name].tobytes() == want.tobytes(), name


def _no_source_reads(monkeypatch) -> None:
    def fail(spec):
        raise AssertionError(f"the source {spec} was read: the checkpoint was not used")

    monkeypatch.setattr(load, "load_model", fail)


def _only_checkpoint(root: str) -> str:
    (entry,) = os.listdir(root)
    return os.path.join(root, entry)


def _format(root: str) -> str:
    return checkpoint._read_manifest(_only_checkpoint(root))["format"]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_restore_is_bit_identical_to_the_source_on_one_device(tiny, cache, monkeypatch, dtype):
    source = load_model(tiny)
    built = load.load_placed(tiny, dtype, None)
    assert built.built_because == "no checkpoint"
    assert _format(cache) == os.environ["INFIRE_JAX_CHECKPOINT_FORMAT"]
    _no_source_reads(monkeypatch)
    restored = load.load_placed(tiny, dtype, None)
    assert restored.built_because is None
    _assert_bit_identical(_weights(restored), source.weights, jnp.dtype(dtype))
    # Independent of our loaders: HF's embedding, read straight from the safetensors file.
    from safetensors.numpy import load_file

    raw = load_file(os.path.join(tiny, "model.safetensors"))["model.embed_tokens.weight"]
    assert _weights(restored)["embed"].tobytes() == raw.astype(jnp.dtype(dtype)).tobytes()
    assert restored.loaded.config == source.config and restored.loaded.name == source.name
    text = "the checkpoint keeps its tokenizer"
    assert restored.loaded.tokenizer.encode(text) == source.tokenizer.encode(text)


def _weight_files(path: str) -> list[str]:
    """The stored weight files (orbax's, or the one safetensors file), largest first."""
    files = {r: st.st_size for r, st in checkpoint._files(path).items() if r.startswith(checkpoint._WEIGHTS + os.sep)}
    return [os.path.join(path, r) for r in sorted(files, key=files.get, reverse=True)]


def _truncate(path: str, source) -> None:
    data = _weight_files(path)[0]
    os.truncate(data, os.path.getsize(data) // 2)


def _overwrite_weight_bytes(path: str, source) -> None:
    """Flips bytes inside the stored embedding, keeping every file's size (orbax alone would serve it)."""
    needle = np.asarray(source.weights["embed"][7]).tobytes()
    for data in _weight_files(path):
        with open(data, "r+b") as f:
            at = f.read().find(needle)
            if at >= 0:
                f.seek(at)
                f.write(bytes(b ^ 0xFF for b in needle[:16]))
                return
    raise AssertionError("the embedding is not stored uncompressed")


def _damage_header_keeping_stat(path: str, source) -> None:
    """Same size, same mtime: only the format's own checks see it (OCDBT's root, safetensors' header)."""
    orbax = os.path.join(path, checkpoint._WEIGHTS, "manifest.ocdbt")
    target = orbax if os.path.exists(orbax) else os.path.join(path, checkpoint._WEIGHTS, checkpoint._SAFETENSORS)
    st = os.stat(target)
    with open(target, "r+b") as f:
        at = st.st_size // 2 if target == orbax else 8  # the safetensors JSON header follows its length
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))


def _drop_manifest(path: str, source) -> None:
    os.remove(os.path.join(path, checkpoint._MANIFEST))


def _edit_tokenizer(path: str, source) -> None:
    tok = os.path.join(path, "tokenizer.json")
    blob = bytearray(open(tok, "rb").read())
    at = blob.index(b"<|dummy_300|>")
    blob[at + 8:at + 11] = b"999"  # same size, a different token
    open(tok, "wb").write(bytes(blob))


# A failed orbax restore leaves a tensorstore callback for its closed event loop: noise, not a failure.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage, reason", [
    (_truncate, "bytes, expected"),
    (_overwrite_weight_bytes, "rewritten after the build"),
    (_damage_header_keeping_stat, "restore failed"),
    (_drop_manifest, "manifest is missing"),
    (_edit_tokenizer, "tokenizer.json fails its CRC32"),
])
def test_damaged_checkpoint_is_rebuilt(tiny, cache, damage, reason):
    source = load_model(tiny)
    load.load_placed(tiny, jnp.float32, None)
    damage(_only_checkpoint(cache), source)
    rebuilt = load.load_placed(tiny, jnp.float32, None)
    assert rebuilt.built_because is not None and reason in rebuilt.built_because
    _assert_bit_identical(_weights(rebuilt), source.weights, np.float32)
    again = load.load_placed(tiny, jnp.float32, None)
    assert again.built_because is None  # repaired in place
    _assert_bit_identical(_weights(again), source.weights, np.float32)
    assert len(os.listdir(cache)) == 1


def test_the_default_model_keeps_its_name_over_its_files_checkpoint(cache, default_gguf):
    """`serve PATH` and `serve` share the default GGUF's checkpoint; only the former is named by the file."""
    assert load.load_placed(default_gguf, jnp.float32, None).loaded.name != DEFAULT_MODEL_NAME
    restored = load.load_placed(None, jnp.float32, None)
    assert restored.built_because is None and restored.loaded.name == DEFAULT_MODEL_NAME


def test_stale_checkpoint_is_rebuilt_in_place(tiny, cache, monkeypatch):
    source = load_model(tiny)
    load.load_placed(tiny, jnp.float32, None)
    monkeypatch.setattr(checkpoint, "CHECKPOINT_FORMAT_VERSION", checkpoint.CHECKPOINT_FORMAT_VERSION + 1)
    rebuilt = load.load_placed(tiny, jnp.float32, None)
    assert rebuilt.built_because == "stale: format_version differs"
    _assert_bit_identical(_weights(rebuilt), source.weights, np.float32)
    other = {"orbax": "safetensors", "safetensors": "orbax"}[_format(cache)]
    monkeypatch.setenv("INFIRE_JAX_CHECKPOINT_FORMAT", other)
    assert load.load_placed(tiny, jnp.float32, None).built_because == "stale: format differs"
    assert _format(cache) == other
    st = os.stat(os.path.join(tiny, "config.json"))
    os.utime(os.path.join(tiny, "config.json"), ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert load.load_placed(tiny, jnp.float32, None).built_because == "stale: source differs"
    assert load.load_placed(tiny, jnp.float32, None).built_because is None
    assert len(os.listdir(cache)) == 1


_MESH_WORKER = """
import json, sys
job = json.loads(sys.argv[1])
if job.get("process_id") is not None:
    from sharding.distributed import initialize
    initialize(job["address"], 2, job["process_id"])
import jax, jax.numpy as jnp, numpy as np, orbax.checkpoint  # imported before any reads are counted
from flax import nnx
from infire_jax.loaders import load
from infire_jax.loaders.load import load_model
from infire_jax.loaders.paths import DEFAULT_MODEL_NAME
from sharding.mesh import load_mesh_config
from sharding.plan import ShardPlan

source = load_model(job["spec"])
plan = ShardPlan.create(source.config, load_mesh_config(job["mesh"], jax.device_count()))
reference = plan.prepare_weights(source.weights)
out = {"process": jax.process_index()}
for attempt in job["attempts"]:
    before = int(open("/proc/self/io").read().split("rchar: ")[1].split()[0])
    placed = load.load_placed(job["spec"], jnp.float32, plan)
    out[attempt] = {"built_because": placed.built_because,
                    "rchar": int(open("/proc/self/io").read().split("rchar: ")[1].split()[0]) - before}
    for path, var in nnx.to_flat_state(placed.state):
        name, arr = ".".join(map(str, path)), var.get_value()
        want = np.asarray(reference[name], np.float32)
        assert arr.shape == want.shape and arr.sharding.spec == plan.spec(var.axes), name
        for shard in arr.addressable_shards:
            assert np.asarray(shard.data).tobytes() == want[shard.index].tobytes(), (name, shard.index)
out["bytes"] = sum(np.asarray(w).nbytes for w in reference.values())
print("RESULT " + json.dumps(out), flush=True)
"""


def _mesh_workers(jobs: list[dict], devices: int, cache_root: str) -> list[dict]:
    env = cpu_env(devices, PYTHONPATH=ROOT, INFIRE_JAX_CACHE=cache_root, INFIRE_JAX_NO_COMPILE_CACHE="1")
    procs = [subprocess.Popen(dying_with_parent([sys.executable, "-c", _MESH_WORKER, json.dumps(job)]), env=env,
                              text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for job in jobs]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-4000:]
        results.append(json.loads(out.split("RESULT ", 1)[1]))
    return results


def test_sharded_restore_reads_only_each_process_shards(tiny, tmp_path):
    """Built on 8 devices (tp=4 x pp=2: kv heads repeated, a padded stage), restored there and by
    2 processes x 4 devices, bit-identical shard by shard; each process reads about its half."""
    import socket

    from sharding.mesh import CONFIG_DIR

    mesh, cache_root = os.path.join(CONFIG_DIR, "8-tp4-pp2.yaml"), str(tmp_path / "cache")
    (one,) = _mesh_workers([{"spec": tiny, "mesh": mesh, "attempts": ["build", "restore"]}], 8, cache_root)
    assert one["build"]["built_because"] == "no checkpoint" and one["restore"]["built_because"] is None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    two = _mesh_workers([{"spec": tiny, "mesh": mesh, "attempts": ["restore"], "address": address, "process_id": i}
                         for i in range(2)], 4, cache_root)
    for r in two:
        assert r["restore"]["built_because"] is None
        # Half the weights, plus metadata; a process that read every shard would read all of them.
        assert r["restore"]["rchar"] < 0.75 * r["bytes"], r
    assert one["restore"]["rchar"] >= r["bytes"]


def test_a_dummy_model_is_checkpointed_only_when_kept_compressed(tiny, cache, monkeypatch):
    """Drawing a `dummy:` model is faster than reading it, coding it is not: compressed, it is coded
    once and then restored (what the GPU's compression check measures), and another model's build
    does not prune its checkpoint (it has no source file)."""
    from infire_jax.loaders import dummy

    monkeypatch.setitem(dummy.CONFIGS, "test-checkpoint", HF_CONFIG)
    spec, kinds = "dummy:test-checkpoint", ("mlp",)
    assert load.load_placed(spec, jnp.bfloat16, None).built_because == "checkpoints bypassed"
    built = load.load_placed(spec, jnp.bfloat16, None, compress=kinds)
    assert built.built_because == "no checkpoint" and len(os.listdir(cache)) == 1
    load.load_placed(tiny, jnp.bfloat16, None)  # writes its own, pruning what has no source
    _no_source_reads(monkeypatch)
    restored = load.load_placed(spec, jnp.bfloat16, None, compress=kinds)
    assert restored.built_because is None and restored.loaded.name == spec
    got, want = _weights(restored), _weights(built)
    assert sorted(got) == sorted(want) and all(got[n].tobytes() == want[n].tobytes() for n in want)


def test_palette_compressed_weights_are_checkpointed_coded(tiny, cache, monkeypatch):
    """Resident compression's coded parts are checkpointed as placed, beside the plain checkpoint:
    the restore reads no source and gives the built parts bit for bit, which decode to the source's
    bfloat16 weights."""
    from infire_jax.compression.palette import decode_palette_block
    from infire_jax.compression.resident import ResidentLayout
    from infire_jax.models.palette_kernels import KernelPaletteWeight, palette_kernel_here

    source = load_model(tiny)
    kinds = ("mlp", "attn")
    plain = load.load_placed(tiny, jnp.bfloat16, None)
    built = load.load_placed(tiny, jnp.bfloat16, None, compress=kinds)
    assert built.built_because == "no checkpoint" and len(os.listdir(cache)) == 2
    manifest = checkpoint._read_manifest(load.checkpoint_path(tiny, jnp.bfloat16, None, kinds))
    layouts = {k: ResidentLayout(tuple(v["grid"]), v["capacity"], v["kernel"]) for k, v in manifest["resident"].items()}
    assert sorted(layouts) == ["w_down", "w_gate_up", "wo", "wqkv"]
    assert {layout.kernel for layout in layouts.values()} == {palette_kernel_here()}
    _no_source_reads(monkeypatch)
    restored = load.load_placed(tiny, jnp.bfloat16, None, compress=kinds)
    assert restored.built_because is None and restored.graphdef == built.graphdef
    got, want = _weights(restored), _weights(built)
    assert sorted(got) == sorted(want) and all(got[n].tobytes() == want[n].tobytes() for n in want)
    assert "layers.w_down.codes" in got and "layers.w_down" not in got
    # The parts decode to the plain checkpoint's bfloat16 weights (the model's own decoder, layer by layer).
    model = nnx.merge(restored.graphdef, restored.state)
    plain_w = _weights(plain)
    for short in layouts:
        parts = getattr(model.layers, short).arrays()
        for layer in range(HF_CONFIG["num_hidden_layers"]):
            one = jax.tree.map(lambda a: a[layer], parts)
            decoded = one.plain() if isinstance(one, KernelPaletteWeight) else decode_palette_block(**one)
            assert np.asarray(decoded).tobytes() == plain_w[f"layers.{short}"][layer].tobytes(), short
    assert source.config == restored.loaded.config
