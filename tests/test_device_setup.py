"""Set-up the GPU needs, checked on CPU: XLA flags in place before the backend starts, merged with
the user's, and a KV pool sized from device memory (here a stated one) minus weights and the
largest step's measured activations."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from infire_jax.errors import ConfigError
from infire_jax.runner.kv_pool import PAGE_MULTIPLE, size_from_device_memory
from infire_jax.runner.xla_flags import merged_flags

GIB = 1 << 30


def test_defaults_are_added_and_the_users_flags_win():
    assert merged_flags("") == ("--xla_gpu_enable_triton_gemm=false --xla_gpu_graph_min_graph_size=1 "
                                "--xla_disable_hlo_passes=rematerialization")
    user = "--xla_gpu_enable_triton_gemm=true --xla_dump_to=/tmp/x"
    got = merged_flags(user).split()
    assert got[:2] == user.split()  # kept as given, first
    assert "--xla_gpu_enable_triton_gemm=false" not in got
    assert got[2:] == ["--xla_gpu_graph_min_graph_size=1", "--xla_disable_hlo_passes=rematerialization"]
    assert merged_flags("xla_gpu_graph_min_graph_size=4").count("graph_min_graph_size") == 1
    assert merged_flags(merged_flags("")) == merged_flags("")  # idempotent


def _import_in_subprocess(env: dict, code: str) -> dict:
    probe = ("import json, os, sys\n" + code + "\n"
             "import infire_jax\n"
             "from jax._src import xla_bridge\n"
             "started_at_import = bool(xla_bridge._backends)\n"
             "import jax; jax.devices()\n"
             "print(json.dumps(dict(flags=os.environ.get('XLA_FLAGS', ''), started=started_at_import,\n"
             "    fraction=os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION'))))\n")
    base = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION")}
    out = subprocess.run([sys.executable, "-c", probe], env={**base, **env, "JAX_PLATFORMS": "cpu"},
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_sets_flags_before_the_backend_starts():
    got = _import_in_subprocess({"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=true"}, "")
    assert not got["started"]  # importing infire_jax touches no device
    flags = got["flags"].split()
    assert "--xla_gpu_enable_triton_gemm=true" in flags and "--xla_gpu_enable_triton_gemm=false" not in flags
    assert "--xla_gpu_graph_min_graph_size=1" in flags  # every backend parses it, so jax started fine
    assert got["fraction"] == "0.95"
    got = _import_in_subprocess({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}, "")
    assert got["fraction"] == "0.5"  # the user's allocator fraction wins too
    got = _import_in_subprocess({"INFIRE_JAX_NO_XLA_FLAGS": "1"}, "")
    assert got["flags"] == "" and got["fraction"] is None


def test_backend_started_first_is_reported():
    probe = ("import logging; logging.basicConfig(level=logging.WARNING)\n"
             "import jax; jax.devices()\n"
             "import infire_jax\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True,
                         env={**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "JAX_PLATFORMS": "cpu"})
    assert "started its backend before infire_jax was imported" in out.stderr


# ---- the KV pool ----------------------------------------------------------------------------------

def test_pool_fills_the_stated_fraction_of_device_memory():
    s = size_from_device_memory(device_bytes=80 * GIB, allocator_limit=76 * GIB, utilization=0.9,
                                weight_bytes=16 * GIB, activation_bytes=3 * GIB, other_bytes=GIB // 2,
                                page_bytes=2 << 20, min_pages=513)
    assert s.usable_bytes == int(80 * GIB * 0.9)
    fits = (int(80 * GIB * 0.9) - 16 * GIB - 3 * GIB - GIB // 2) // (2 << 20)
    assert s.num_pages == fits // PAGE_MULTIPLE * PAGE_MULTIPLE  # a stable shape for the compilation cache
    assert s.pool_bytes <= s.usable_bytes - s.weight_bytes - s.activation_bytes - s.other_bytes
    text = s.describe()
    assert "0.90 x 80.00 GiB" in text and "16.00 GiB weights" in text and "3.00 GiB activations" in text


def test_pool_is_capped_by_the_allocator_limit():
    s = size_from_device_memory(device_bytes=80 * GIB, allocator_limit=60 * GIB, utilization=0.9,
                                weight_bytes=16 * GIB, activation_bytes=0, other_bytes=0, page_bytes=GIB,
                                min_pages=2)
    assert s.usable_bytes == 60 * GIB and s.num_pages == 44 and "allocator limit" in s.describe()


@pytest.mark.parametrize("kwargs,match", [
    (dict(weight_bytes=75 * GIB), "no room for the KV pool"),
    (dict(utilization=0.0), r"gpu_memory_utilization must be in \(0, 1\]"),
    (dict(utilization=1.5), r"gpu_memory_utilization must be in \(0, 1\]"),
])
def test_pool_that_cannot_fit_is_refused_with_the_numbers(kwargs, match):
    args = {**dict(device_bytes=80 * GIB, allocator_limit=80 * GIB, utilization=0.9, weight_bytes=16 * GIB,
                   activation_bytes=GIB, other_bytes=0, page_bytes=2 << 20, min_pages=513), **kwargs}
    with pytest.raises(ConfigError, match=match):
        size_from_device_memory(**args)


def test_engine_sizes_its_pool_from_a_stated_device_memory(monkeypatch):
    """The engine with a fake 4 GiB device: it measures the largest step's activations with XLA's
    memory analysis, subtracts the weights, and allocates the pool that is left."""
    from infire_jax import Engine, EngineConfig
    from infire_jax.runner import kv_pool

    page = 2 * 30 * 16 * 3 * 64 * 4  # SmolLM2, float32
    weights = 134_515_008 * 4  # its parameters, float32
    monkeypatch.setattr(kv_pool, "device_memory", lambda: (4 * GIB, 3 * GIB, weights + 12345))
    engine = Engine(EngineConfig(dtype="float32", max_num_seqs=2, max_num_batched_tokens=16, max_model_len=128))
    s = engine.pool_sizing
    assert s.source == "device memory" and s.weight_bytes == weights
    assert 0 < s.activation_bytes < 64 << 20  # a 16-token step of a 135M model
    assert s.usable_bytes == 3 * GIB  # capped by the stated allocator limit
    want = (3 * GIB - weights - s.activation_bytes - s.other_bytes) // page // PAGE_MULTIPLE * PAGE_MULTIPLE
    assert s.num_pages == want == engine.runner.rc.num_pages == engine.kv.num_pages
    assert engine.runner.cache.k_pages.shape[1] == want
    from infire_jax import SamplingParams
    from infire_jax.llm import LLM

    out = LLM(engine=engine).generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0))
    assert out[0].text.startswith(" Paris")


def test_cpu_devices_split_the_default_budget():
    """Without a device memory figure (CPU) the default 1 GiB is the host's: 8 virtual devices share it,
    each taking an eighth, as the tiny 8-device engines of the mesh tests did not (8 GiB for 2 layers).
    Budgets a user states stay per device, as vLLM's --kv-cache-memory is."""
    from infire_jax.runner.kv_pool import PoolPlanner

    def planner(devices, kv_cache_memory=None):
        return PoolPlanner(page_bytes=1 << 16, page_size=16, max_model_len=256, num_kv_pages=None,
                           kv_cache_memory=kv_cache_memory, gpu_memory_utilization=0.9, devices=devices)

    one, eight = planner(1).fixed(), planner(8).fixed()
    assert one.num_pages == GIB >> 16 and eight.num_pages == GIB >> 19
    assert eight.num_pages * eight.page_bytes * 8 <= GIB
    assert planner(8, kv_cache_memory=GIB).fixed().num_pages == GIB >> 16


@pytest.mark.parametrize("value", [0.0, 1.5, -0.1])
def test_engine_refuses_a_bad_gpu_memory_utilization_before_loading(value):
    from infire_jax import Engine, EngineConfig

    with pytest.raises(ConfigError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        Engine(EngineConfig(model="dummy:smollm2-135m", gpu_memory_utilization=value))
