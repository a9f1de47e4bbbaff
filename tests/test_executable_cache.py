"""The executable cache (infire_jax/runner/executable_cache.py): a warm start deserializes every step
program without tracing it, runs them to the same tokens, and never serves a damaged entry."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infire_jax.runner import executable_cache
from infire_jax.sample.sampling_params import SamplingParams
from tests.conftest import SMALL_ENGINE, cpu_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _program():
    """A small program with a reduction, an iota and a scan, and its float64 reference."""
    def f(x, w):
        return jnp.cumsum(jnp.tanh(x @ w) * jnp.arange(w.shape[1], dtype=x.dtype), axis=1)

    def reference(x, w):
        x, w = x.astype(np.float64), w.astype(np.float64)
        return np.cumsum(np.tanh(x @ w) * np.arange(w.shape[1]), axis=1)

    args = (jax.ShapeDtypeStruct((4, 64), jnp.float32), jax.ShapeDtypeStruct((64, 32), jnp.float32))
    return jax.jit(f), reference, args


def _inputs():
    rng = np.random.default_rng(0)
    return rng.standard_normal((4, 64), np.float32), rng.standard_normal((64, 32), np.float32) / 8


def test_second_cache_loads_what_the_first_compiled(tmp_path):
    jitted, reference, args = _program()
    first = executable_cache.ExecutableCache(str(tmp_path), "ctx")
    compiled = first.get("f", args, lambda: jitted.lower(*args))
    assert (first.compiled, first.loaded) == (1, 0)
    second = executable_cache.ExecutableCache(str(tmp_path), "ctx")
    loaded = second.get("f", args, lambda: pytest.fail("a cached program was traced again"))
    assert (second.compiled, second.loaded) == (0, 1)
    x, w = _inputs()
    np.testing.assert_array_equal(np.asarray(loaded(x, w)), np.asarray(compiled(x, w)))
    np.testing.assert_allclose(np.asarray(loaded(x, w)), reference(x, w), rtol=1e-5, atol=1e-4)


def test_key_covers_context_shapes_and_dtypes(tmp_path):
    _, _, args = _program()
    cache = executable_cache.ExecutableCache(str(tmp_path), "ctx")
    other = executable_cache.ExecutableCache(str(tmp_path), "another runner")
    wider = (jax.ShapeDtypeStruct((8, 64), jnp.float32), args[1])
    halves = tuple(jax.ShapeDtypeStruct(a.shape, jnp.bfloat16) for a in args)
    paths = {cache.path("f", args), cache.path("g", args), other.path("f", args), cache.path("f", wider),
             cache.path("f", halves)}
    assert len(paths) == 5


def test_runners_of_other_settings_share_the_programs_they_both_lower(tmp_path):
    """A program that another runner stored (the same lowered text on the same devices) is traced,
    then loaded, not compiled again, and is kept under this runner's key too; another program compiles."""
    jitted, reference, args = _program()
    executable_cache.ExecutableCache(str(tmp_path), "a pool of 512 pages").get("f", args, lambda: jitted.lower(*args))
    other = executable_cache.ExecutableCache(str(tmp_path), "a pool of 24 pages")
    shared = other.get("f", args, lambda: jitted.lower(*args))
    assert (other.compiled, other.shared, other.loaded) == (0, 1, 0)
    x, w = _inputs()
    np.testing.assert_allclose(np.asarray(shared(x, w)), reference(x, w), rtol=1e-5, atol=1e-4)
    again = executable_cache.ExecutableCache(str(tmp_path), "a pool of 24 pages")
    again.get("f", args, lambda: pytest.fail("the shared program was not kept under this runner's key"))
    doubled = jax.jit(lambda x, w: 2 * jitted(x, w))
    twice = other.get("g", args, lambda: doubled.lower(*args))
    assert (other.compiled, other.shared) == (1, 1)
    np.testing.assert_allclose(np.asarray(twice(x, w)), 2 * reference(x, w), rtol=1e-5, atol=1e-4)


def test_programs_differing_only_in_arguments_they_do_not_read_share_nothing(tmp_path, caplog):
    """jax leaves an unread argument out of the lowered text (a kept-quantized model's program that reads
    only the embedding lowers as a dequantized one's does), but an executable loads only for the
    arguments it was compiled with: the second program compiles under its own file, and the first's
    stays, neither rebuilt."""
    jitted = jax.jit(lambda x, unread: x * 2)
    ints = (jax.ShapeDtypeStruct((4,), jnp.float32), jax.ShapeDtypeStruct((8,), jnp.int8))
    floats = (ints[0], jax.ShapeDtypeStruct((8,), jnp.float8_e4m3fn))
    assert jitted.lower(*ints).as_text() == jitted.lower(*floats).as_text()
    for context, args in (("int8", ints), ("fp8", floats), ("int8 again", ints)):
        cache = executable_cache.ExecutableCache(str(tmp_path), context)
        cache.get("f", args, lambda: jitted.lower(*args))
        assert (cache.compiled, cache.shared) == ((1, 0) if context != "int8 again" else (0, 1)), context
    assert "rebuilding" not in caplog.text


def test_key_covers_the_source_of_every_package_that_builds_programs(monkeypatch):
    """The model, sampler and speculation code (infire_jax/models, sample, speculative...) builds the
    step programs as much as the runner does: a change to any of it must be a new key. (The source
    fingerprint hashed only infire_jax/runner once the cache moved there: an edited verify.py kept
    running its stale executables.)"""
    import infire_jax
    import pallas_kernels

    walked, real_walk = [], os.walk

    def walk(top, *args, **kwargs):
        walked.append(os.path.abspath(top))
        return real_walk(top, *args, **kwargs)

    monkeypatch.setattr(os, "walk", walk)
    executable_cache._source_fingerprint.__wrapped__()
    for package in (infire_jax, pallas_kernels):
        assert os.path.dirname(os.path.abspath(package.__file__)) in walked, walked


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_damaged_entry_is_rebuilt_not_run(tmp_path, damage, caplog):
    jitted, reference, args = _program()
    executable_cache.ExecutableCache(str(tmp_path), "ctx").get("f", args, lambda: jitted.lower(*args))
    path = executable_cache.ExecutableCache(str(tmp_path), "ctx").path("f", args)
    blob = bytearray(open(path, "rb").read())
    if damage == "flip":
        blob[len(blob) // 2] ^= 0xFF
    elif damage == "truncate":
        blob = blob[:len(blob) // 3]
    else:
        blob = bytearray()
    open(path, "wb").write(blob)
    cache = executable_cache.ExecutableCache(str(tmp_path), "ctx")
    compiled = cache.get("f", args, lambda: jitted.lower(*args))
    assert (cache.compiled, cache.loaded) == (1, 0) and "rebuilding" in caplog.text
    x, w = _inputs()
    np.testing.assert_allclose(np.asarray(compiled(x, w)), reference(x, w), rtol=1e-5, atol=1e-4)
    again = executable_cache.ExecutableCache(str(tmp_path), "ctx")  # the rebuilt entry is sound
    again.get("f", args, lambda: pytest.fail("the rebuilt entry was not stored"))
    assert again.loaded == 1


def test_size_bound_drops_the_oldest(tmp_path):
    jitted, _, args = _program()
    cache = executable_cache.ExecutableCache(str(tmp_path), "ctx")
    cache.get("old", args, lambda: jitted.lower(*args))
    size = os.path.getsize(cache.path("old", args))
    os.utime(cache.path("old", args), (1, 1))  # written long ago
    bounded = executable_cache.ExecutableCache(str(tmp_path), "ctx", max_bytes=int(size * 1.5))
    other = jax.jit(lambda x, w: 2 * jitted(x, w))  # not the same program: not shared with "old"
    bounded.get("new", args, lambda: other.lower(*args))
    # "new" stays under both its names (its runner's key, its lowered text's); "old" goes under both
    assert len(os.listdir(tmp_path)) == 2 and os.path.exists(bounded.path("new", args))


def test_engine_warm_start_loads_every_step_program():
    """A second engine of the same settings deserializes all its programs and generates exactly what
    the first one does. The first is built here, so that the cache holds its programs whatever ran
    before in this process (the session engine may have been built under another test's environment,
    which keys its programs apart, or its entries may have aged out of the bounded cache)."""
    from infire_jax import LLM

    first = LLM(**SMALL_ENGINE)
    llm = LLM(**SMALL_ENGINE)
    runner = llm.engine.runner
    steps = runner.steps
    programs = (len(steps.compiled_forward) + len(steps.compiled_samplers) + len(steps.compiled_bursts)
                + len(steps.compiled_prompt_rows) + len(steps.compiled_pool) + len(steps.compiled_small))
    assert len(steps.compiled_prompt_rows) == len(runner.rc.buckets.shapes)  # prompt logprobs' gathers
    assert len(steps.compiled_pool) == len(runner.rc.buckets.shapes)  # embeddings' (runner="pooling")
    assert len(steps.compiled_bursts) == len(runner.rc.buckets.decode_shapes) == 2
    assert steps.executables.compiled == 0 and runner.executables_loaded == programs
    assert llm.engine.boot.compiled == 0
    prompts = ["Warm start check: the capital of France is", "Warm start check: a haiku about the sea."]
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=3)
    for ours, theirs in zip(llm.generate(prompts, params), first.generate(prompts, params)):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
        for a, b in zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs):
            assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) <= 1e-6 for t in a)
    llm.engine.close()
    first.engine.close()


def _boot(cache: str, **env: str) -> dict:
    """An engine start in a fresh process that sees two CPU devices and uses one (1.yaml)."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "boot_worker.py"),
                           os.path.join(ROOT, "sharding", "configs", "1.yaml")], capture_output=True,
                          text=True, timeout=900, cwd=ROOT,
                          env=cpu_env(2, INFIRE_JAX_CACHE=cache, PYTHONPATH=ROOT, **env))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[len("RESULT "):])


@pytest.fixture(scope="module")
def plain_boot(tmp_path_factory) -> tuple[str, dict]:
    """A start without the executable cache (XLA's persistent cache filled), and its cache dir."""
    cache = str(tmp_path_factory.mktemp("boots"))
    plain = _boot(cache, INFIRE_JAX_NO_EXECUTABLE_CACHE="1")
    assert plain["executables_loaded"] == 0 and plain["compiled"] > 0
    return cache, plain


def test_fresh_processes_after_xla_cache_filled(plain_boot):
    """XLA's persistent cache holds the steps first (a start without this cache); the next start
    must compile them afresh to store them (an executable XLA's cache loaded cannot be serialized
    again), and the one after runs them deserialized: the same tokens and logprobs each time. The
    engine uses one of the two devices it sees, so a loaded program must not assume both."""
    cache, plain = plain_boot
    storing = _boot(cache)
    assert storing["executables_loaded"] == 0 and storing["executables_stored"] > 0
    warm = _boot(cache)
    assert warm["compiled"] == 0 and warm["executables_loaded"] == storing["executables_stored"]
    for run in (storing, warm):
        assert run["tokens"] == plain["tokens"] and run["compiles_since_warmup"] == 0
        np.testing.assert_allclose(run["logprobs"], plain["logprobs"], atol=1e-6)


def test_a_precompiled_cache_is_what_the_next_start_loads(tmp_path, plain_boot):
    """`infire-jax precompile` for this machine, in a fresh process, from the weights' and the pool's
    shapes alone (nothing drawn or allocated): the next start with the same settings loads every step
    program from it, compiles and stores none, and generates what a start that compiled its own does."""
    from tests.boot_worker import ENGINE

    cache = str(tmp_path)
    flags = [f for name, value in ENGINE.items()
             for f in (f"--{name.replace('_', '-')}", *map(str, value if isinstance(value, tuple) else (value,)))]
    proc = subprocess.run([sys.executable, "-m", "infire_jax", "precompile", *flags, "--mesh",
                           os.path.join(ROOT, "sharding", "configs", "1.yaml")], capture_output=True, text=True,
                          timeout=600, cwd=ROOT, env=cpu_env(2, INFIRE_JAX_CACHE=cache, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-4000:]
    stored = int(proc.stdout.split(" programs (")[0].rsplit("\n", 1)[-1])
    warm = _boot(cache)
    assert warm["executables_loaded"] == stored and warm["executables_stored"] == 0
    assert warm["compiles_since_warmup"] == 0 and warm["tokens"] == plain_boot[1]["tokens"]
    np.testing.assert_allclose(warm["logprobs"], plain_boot[1]["logprobs"], atol=1e-6)


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine compiles for its own GPU")
def test_a_gpu_program_compiled_without_the_gpu_is_keyed_as_the_gpu_asks_for_it(tmp_path, monkeypatch):
    """A program compiled for an H100 topology device on this CPU machine is stored under the key the
    card's own engine computes: its arrays on device 0, or shapes without a placement, in a process
    that chose the GPU platform, set the allocator's share and runs in a CUDA container. What changes
    the program (the card, XLA_FLAGS) changes the key, and this machine's own CPU programs are apart."""
    from infire_jax.bench import gpu_target

    h100 = gpu_target.target("h100")
    (device,) = gpu_target.devices(h100)
    jitted, _, args = _program()
    placed = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=jax.sharding.SingleDeviceSharding(device))
                   for a in args)
    platform = executable_cache.gpu_platform(h100.device_kind)
    assert executable_cache.ExecutableCache(str(tmp_path), "ctx", platform=platform).put(
        "f", placed, jitted.lower(*placed).compile()) > 0
    for name, value in (("JAX_PLATFORMS", "cuda"), ("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95"),
                        ("CUDA_VERSION", "12.8"), ("NVIDIA_VISIBLE_DEVICES", "all")):
        monkeypatch.setenv(name, value)
    on_the_card = executable_cache.ExecutableCache(str(tmp_path), "ctx", platform=platform)
    on_device_0 = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=jax.sharding.SingleDeviceSharding(
        jax.devices()[0])) for a in args)
    assert os.path.exists(on_the_card.path("f", args)) and os.path.exists(on_the_card.path("f", on_device_0))
    h200 = executable_cache.ExecutableCache(str(tmp_path), "ctx", platform=executable_cache.gpu_platform("NVIDIA H200"))
    assert not os.path.exists(h200.path("f", args))
    assert not os.path.exists(executable_cache.ExecutableCache(str(tmp_path), "ctx").path("f", args))
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_triton_gemm=true")
    assert not os.path.exists(executable_cache.ExecutableCache(str(tmp_path), "ctx", platform=platform).path("f", args))


def _placed_programs(directory: str) -> None:
    """Run in a process with two CPU devices: programs on one of them (uncommitted, and committed
    to the second) and on both in reverse order are stored, then loaded by a fresh cache object and
    run on their arguments; each must give its compiled twin's result on the same devices."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    d0, d1 = jax.devices()
    jitted, reference, _ = _program()
    x, w = _inputs()
    mesh = Mesh(np.array([d1, d0]), ("tp",))
    placements = {"uncommitted": (x, w), "second device": tuple(jax.device_put(a, d1) for a in (x, w)),
                  "two devices, reversed": (jax.device_put(x, NamedSharding(mesh, PartitionSpec("tp"))),
                                            jax.device_put(w, NamedSharding(mesh, PartitionSpec())))}
    for name, args in placements.items():
        compiled = executable_cache.ExecutableCache(directory, "ctx").get(name, args, lambda: jitted.lower(*args))
        fresh = executable_cache.ExecutableCache(directory, "ctx")
        loaded = fresh.get(name, args, lambda: pytest.fail(f"{name}: a cached program was traced again"))
        assert fresh.loaded == 1, name
        got, want = loaded(*args), compiled(*args)
        assert got.sharding == want.sharding, name
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        np.testing.assert_allclose(np.asarray(got), reference(x, w), rtol=1e-5, atol=1e-4)
    print("PLACEMENTS OK")


def test_programs_load_onto_the_devices_they_were_compiled_for(tmp_path):
    """A process sees more devices than a program uses (a one-device engine on a multi-GPU host):
    the executable must load onto its own devices, in their order, not onto all of them."""
    proc = subprocess.run([sys.executable, "-c", f"from tests.test_executable_cache import _placed_programs; "
                           f"_placed_programs({str(tmp_path)!r})"], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=cpu_env(2, PYTHONPATH=ROOT))
    assert proc.returncode == 0 and "PLACEMENTS OK" in proc.stdout, proc.stderr[-4000:]
