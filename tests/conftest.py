"""Shared fixtures: the real default model (ours and HF's), and a small engine on it."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys

import pytest

# The suite is mostly XLA compilation (every engine compiles its buckets): XLA CPU's legacy fusion
# emitters compile the suite's programs two to three times faster than its new MLIR ones, and the
# programs run within ~10% as fast; LLVM at -O0 (`--xla_backend_optimization_level=0`) took test_llama4
# from 128 to 92 s (docs/PERFORMANCE.md). Set before jax starts a backend; subprocesses take it through
# `cpu_env`. Not on a GPU machine, whose GPU test files run as users run them. XLA aborts on a flag it does
# not know, so a jax without one gets the next set (probed once per run, in a subprocess).
_CANDIDATE_XLA_FLAGS = ("--xla_cpu_use_fusion_emitters=false --xla_backend_optimization_level=0",
                        "--xla_cpu_use_fusion_emitters=false", "")


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


# Without a GPU, jax starts its CPU backend alone: the dev extra's CUDA plugin (bench gpu-compile's
# compiler) would otherwise fail to start a CUDA backend in every test process, print its traceback and
# unregister itself. Set before the probe below, so its subprocess and every test's inherit it.
if not shutil.which("nvidia-smi"):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

# On a CPU with AMX, bfloat16 panel steps go to oneDNN (pallas_kernels/cpu_onednn.py), whose sums are
# not the hand-written kernels' to the bit; the suite holds those kernels (and the paths built on them:
# panels, palette-coded weights) to bitwise equalities, so it keeps oneDNN off, wherever it runs, except
# in tests/test_cpu_onednn.py, which forces it on. Subprocesses inherit it.
os.environ.setdefault("INFIRE_JAX_NO_ONEDNN", "1")

# The C++ kernels' library is built once per run (26 s on 2 cores), in the cache this process uses, and
# shared with every subprocess, also those given a fresh INFIRE_JAX_CACHE of their own (cold boots).
os.environ.setdefault("INFIRE_JAX_KERNEL_CACHE", os.path.join(
    os.environ.get("INFIRE_JAX_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "infire_jax")), "cpu_kernels"))

TEST_XLA_FLAGS = _test_xla_flags()
if TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):  # once, though imported as `tests.conftest` too
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()


def cpu_env(devices: int, **extra: str) -> dict[str, str]:
    """The environment of a test's subprocess on `devices` virtual CPU devices (the suite's XLA flags kept)."""
    return dict(os.environ, XLA_FLAGS=f"{TEST_XLA_FLAGS} --xla_force_host_platform_device_count={devices}".strip(),
                JAX_PLATFORMS="cpu", **extra)


_SETPRIV = shutil.which("setpriv")


def dying_with_parent(command: list[str]) -> list[str]:
    """`command` for the tests' long-lived subprocesses (servers, routers, mesh workers), started so that the
    kernel kills it when the test process that started it dies (util-linux's `setpriv --pdeathsig`, which
    then execs it; unchanged where setpriv is missing). A test process killed for memory (an xdist worker)
    otherwise left its servers running, holding their memory, beside the worker that replaced it. A
    `preexec_fn` would do the same from Python, but makes subprocess fork the multithreaded test process."""
    return [_SETPRIV, "--pdeathsig", "KILL", "--", *command] if _SETPRIV else command


# Small enough to compile quickly on 2 CPU cores, big enough for batches and chunked prefill. Three
# buckets, not the default seven: each is compiled (with its decode burst) by every engine a test builds.
# 512 pages hold all 8 sequences at max_model_len; a CPU engine's default pool is 1 GiB (1,455 pages).
# The pooling runner also serves embeddings (a small program a bucket), so the shared engine and server
# test those too, and an engine with another pooler_config loads every program from the executable cache.
SMALL_ENGINE = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1024,
                    token_buckets=(4, 8, 64), num_kv_pages=512, runner="pooling")


def engine_flags(**overrides) -> list[str]:
    """`infire-jax serve` flags of SMALL_ENGINE (with `overrides`), for the tests' server subprocesses.
    An engine of the same settings compiles the same programs: a server started with these loads them
    from the executable cache that `smol_llm` (or an earlier server) filled, in seconds, instead of
    compiling them again (15 programs; the CLI's default buckets make 27)."""
    flags = []
    for name, value in {**SMALL_ENGINE, **overrides}.items():
        if name != "dtype":  # ServerProcess passes --dtype float32
            flags += [f"--{name.replace('_', '-')}", *map(str, value if isinstance(value, tuple) else (value,))]
    return flags


# CI's machine has 24 GiB and the suite runs on two workers: the aim is a test process under half of
# it. The run prints each worker's peak at its end, and says when one passed the aim (a cold run at
# 01960a8: 10.1 and 10.0 GiB, in test_lora and test_parity).
RSS_AIM_GIB = 12.0
_memory: dict[str, object] = {"peak_gib": 0.0, "peak_module": "no test module", "modules_done": 0}


def _peak_rss_gib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)  # KiB on Linux


# Every this many modules, a test process's collector looks at all its objects again (below).
FULL_COLLECTION_EVERY = 8


@pytest.fixture(scope="module", autouse=True)
def release_memory_after_each_module(request):
    """A test process runs many modules: a module's engines and reference models are usually in
    reference cycles (threads, callbacks), which Python's collector may leave for a long time, and
    freed heap pages stay with the process until trimmed. Collect and trim after every module, so
    that memory does not grow with the number of modules; note which module set the peak.

    What survives a collection (imports, session fixtures, jax's caches: 0.6 to 2.6 million objects)
    is then frozen out of the collector's sight (`gc.freeze`): the collections after each module
    took 0.4 to 14 s, 268 s of a full run's test time, and Python's own full collections went over
    the same objects again while tests ran. Every FULL_COLLECTION_EVERY modules they are unfrozen
    first, so that a cycle among them that has since become garbage (an engine a cache let go) is
    still freed.

    jax's own caches (traces, lowerings, the executables of every jitted function a module called) are
    cleared first: engines hold their programs themselves, and XLA's persistent cache reloads the rest.
    Six model modules in one process ended at 2.5 GiB with it and 3.7 GiB without, in the same time."""
    yield
    import gc

    import jax

    _memory["modules_done"] += 1
    if _memory["modules_done"] % FULL_COLLECTION_EVERY == 0:
        gc.unfreeze()
    jax.clear_caches()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass
    gc.freeze()
    peak = _peak_rss_gib()
    if peak > _memory["peak_gib"] + 0.05:
        _memory.update(peak_gib=peak, peak_module=request.module.__name__)


# The slowest files of a full run (per-file wall time, two workers, 2026-12-02 at 93826e2), slowest first. They
# are collected first, and run.sh has xdist hand files out in that order (`--dist loadfile
# --no-loadscope-reorder`): a worker then runs its heaviest files while its memory is fresh, and the run ends
# with short files on both workers. xdist's default order (the most tests first) put test_eagle3 and test_mtp
# last on a worker that had grown to 10.7 GiB.
SLOWEST_FILES = ("test_gpu_compile.py", "test_mtp.py", "test_speculative.py", "test_llama4.py", "test_qwen3_5.py",
                 "test_eagle3.py", "test_sharding.py", "test_quant.py", "test_server.py", "test_bench.py",
                 "test_gpt_oss.py", "test_kept_8bit.py", "test_gemma4.py", "test_lora.py", "test_quant_kernels.py",
                 "test_sampling.py", "test_fleet.py")


def pytest_collection_modifyitems(config, items):
    """The slowest files first (SLOWEST_FILES), every other file after them in its own order."""
    rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_sessionfinish(session, exitstatus):
    """Under pytest-xdist each worker is a test process of its own: it hands its peak to the controller."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["peak_rss"] = (max(_memory["peak_gib"], _peak_rss_gib()), _memory["peak_module"])


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist's controller: note each worker's peak (the controller itself runs no test)."""
    peak = getattr(node, "workeroutput", {}).get("peak_rss")
    if peak is not None:
        _memory.setdefault("workers", {})[node.gateway.id] = peak


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    workers = _memory.get("workers") or {"the test process": (max(_memory["peak_gib"], _peak_rss_gib()),
                                                               _memory["peak_module"])}
    for name, (peak, module) in sorted(workers.items()):
        over = peak > RSS_AIM_GIB
        terminalreporter.write_line(
            f"peak RSS of {name}: {peak:.1f} GiB (reached in {module})"
            + (f"; over the aim of {RSS_AIM_GIB} GiB" if over else ""), red=over)


@pytest.fixture(scope="module")
def models_choose_cpu_kernels():
    """The models take every C++ matmul kernel on any CPU, for the modules that test them in a model
    (without AVX-512 the models keep XLA's ops for the panel and head products: `cpu_kernels.wide_chosen`)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("INFIRE_JAX_FORCE_CPU_KERNELS", "1")
        yield


@pytest.fixture(scope="session")
def default_gguf() -> str:
    from infire_jax.loaders.paths import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smol_llm():
    from infire_jax import LLM

    return LLM(**SMALL_ENGINE)


@pytest.fixture(scope="session")
def smol_greedy_64(smol_llm) -> tuple[list[list[int]], list[list[int]]]:
    """test_parity's prompts as token ids, and `smol_llm`'s greedy 64 tokens after each (EOS ignored):
    the teacher-forcing contexts of the lossy weight options' tests, computed once."""
    from test_parity import PROMPTS

    from infire_jax import SamplingParams

    prompts = [smol_llm.tokenizer.encode(p) for p in PROMPTS]
    out = smol_llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    return prompts, [o.token_ids for o in out]


@pytest.fixture(scope="session", autouse=True)
def references_read_gguf_through_a_plain_view():
    """transformers reads a GGUF (config, tokenizer and weights, each a pass over its ~250k metadata
    values) with gguf's reader: give it ours, the same reader over a plain view of the same mapped
    bytes (loaders/gguf.py), which took HF's load of the default model from 59 s to 39 s."""
    import gguf

    from infire_jax.loaders.gguf import PlainGGUFReader

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", PlainGGUFReader)
        yield


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
