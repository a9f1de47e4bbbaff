"""Shared fixtures: the real default model (ours and HF's), and a small engine on it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

# The suite is mostly XLA compilation (every engine compiles its buckets): XLA CPU's legacy fusion
# emitters compile the suite's programs two to three times faster than its new MLIR ones, and the
# programs run within ~10% as fast. Set before jax starts a backend; subprocesses take it through `cpu_env`.
# Not on a GPU machine, whose GPU test files run as users run them. XLA aborts on a flag it does not
# know, so a jax without it gets none (probed once per run, in a subprocess).
_CANDIDATE_XLA_FLAGS = ("--xla_cpu_use_fusion_emitters=false", "")


def _test_xla_flags() -> str:
    if shutil.which("nvidia-smi"):
        return ""
    if "TEST_XLA_FLAGS_PROBED" not in os.environ:  # re-imports (`tests.conftest`) and subprocesses reuse it
        probe = "import jax; jax.devices('cpu')"
        os.environ["TEST_XLA_FLAGS_PROBED"] = next(
            flags for flags in _CANDIDATE_XLA_FLAGS if not flags or subprocess.run(
                [sys.executable, "-c", probe], env=dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu"),
                capture_output=True, timeout=120).returncode == 0)
    return os.environ["TEST_XLA_FLAGS_PROBED"]


TEST_XLA_FLAGS = _test_xla_flags()
if TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):  # once, though imported as `tests.conftest` too
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()


def cpu_env(devices: int, **extra: str) -> dict[str, str]:
    """The environment of a test's subprocess on `devices` virtual CPU devices (the suite's XLA flags kept)."""
    return dict(os.environ, XLA_FLAGS=f"{TEST_XLA_FLAGS} --xla_force_host_platform_device_count={devices}".strip(),
                JAX_PLATFORMS="cpu", **extra)


# Small enough to compile quickly on 2 CPU cores, big enough for batches and chunked prefill. Three
# buckets, not the default seven: each is compiled (with its decode burst) by every engine a test builds.
SMALL_ENGINE = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1024,
                    token_buckets=(4, 8, 64))


@pytest.fixture(scope="module", autouse=True)
def release_memory_after_each_module():
    """The whole suite runs in one process on a 24 GiB machine: a module's engines and reference
    models are usually in reference cycles (threads, callbacks), which Python's collector may leave
    for a long time, and freed heap pages stay with the process until trimmed. Collect and trim
    after every module, so that memory does not grow with the number of modules."""
    yield
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


@pytest.fixture(scope="session")
def default_gguf() -> str:
    from infire_jax.loaders.paths import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smol_llm():
    from infire_jax import LLM

    return LLM(**SMALL_ENGINE)


@pytest.fixture(scope="session")
def hf_smol(default_gguf):
    """HF transformers' own load of the same GGUF, in float32: the reference implementation."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(default_gguf), gguf_file=os.path.basename(default_gguf), dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="module")
def smol_server(smol_llm):
    """`smol_llm`'s engine behind the server's own app (server/app.py), on a free port, its event loop
    on a thread of its own so that blocking clients (urllib, lm-eval) can call it; yields the base URL.
    Module-scoped: while it serves, its engine thread owns the engine (the module must not call
    `smol_llm` itself); at the end the engine is handed back idle."""
    import asyncio
    import socket
    import threading

    from aiohttp import web

    from server.app import build_app
    from server.listen import make_runner

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="smol-server", daemon=True)
    thread.start()
    runner = make_runner(build_app(smol_llm.engine))
    sock = socket.create_server(("127.0.0.1", 0))

    async def start():
        await runner.setup()
        await web.SockSite(runner, sock).start()

    asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=60)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=60)
        loop.close()
        sock.close()


@pytest.fixture
def cpu_device():
    """Runs a test on the CPU device, kernel choices included (`pallas_kernels.placement`): CPU-kernel
    tests then check the CPU path on a GPU machine too; where the CPU is the default, nothing changes."""
    import jax

    with jax.default_device(jax.devices("cpu")[0]):
        yield
