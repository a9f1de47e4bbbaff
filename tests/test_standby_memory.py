"""Hot standby within the device's memory (infire_jax/engine/residency.py), on CPU with a faked card.

`kv_pool.device_memory` is the hook through which the engine reads a GPU's memory; faking it
sends the engine down the GPU's sizing path (pool from device memory, compiled before the pool is
allocated). Two small dummy models (SmolLM2 shapes with 2 and 6 layers) share the fake card with
one resident: each pool must leave room for the heavier model's weights, and the live arrays must
stay within the budget through every swap. A promotion that runs out of device memory (jax's
RESOURCE_EXHAUSTED, injected where XLA raises it) must end in an error within seconds, leave
nothing of the model on the device, and let the server answer it and keep serving.
"""

from __future__ import annotations

import asyncio
import socket
import time

import aiohttp
import jax
import pytest
from aiohttp import web

from infire_jax import EngineConfig, SamplingParams
from infire_jax.bench.__main__ import main as bench_main
from infire_jax.errors import DeviceMemoryError
from infire_jax.runner import kv_pool
from infire_jax.loaders import dummy
from infire_jax.engine.residency import start_engines, weight_bytes_bound
from infire_jax.runner.model_runner import ModelRunner

SMALL, LARGE = "dummy:test-standby-small", "dummy:test-standby-large"
FLAGS = dict(max_num_seqs=1, max_num_batched_tokens=1, max_model_len=32, num_decode_steps=1)  # as CLI_FLAGS
CLI_FLAGS = ["--max-num-seqs", "1", "--max-num-batched-tokens", "1", "--max-model-len", "32",
             "--num-decode-steps", "1"]
CARD = 256 << 20  # the fake device's memory
UTILIZATION = 0.9
OOM = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 36775657472 bytes."


_BASELINE = {"bytes": 0}  # live bytes when the fake card was put in (other tests' arrays are not on it)


def live_bytes() -> int:
    return sum(a.nbytes for a in jax.live_arrays()) - _BASELINE["bytes"]


@pytest.fixture(scope="module")
def fake_card():
    """Two small dummy models, and a 256 MiB card whose bytes in use are the live arrays."""
    _BASELINE["bytes"] = 0
    _BASELINE["bytes"] = live_bytes()
    with pytest.MonkeyPatch.context() as mp:
        base = dict(dummy.CONFIGS["smollm2-135m"], vocab_size=1024)
        mp.setitem(dummy.CONFIGS, SMALL[len("dummy:"):], dict(base, num_hidden_layers=2))
        mp.setitem(dummy.CONFIGS, LARGE[len("dummy:"):], dict(base, num_hidden_layers=6))
        mp.setattr(kv_pool, "device_memory", lambda: (CARD, int(0.95 * CARD), live_bytes()))
        yield


@pytest.fixture(scope="module")
def standby(fake_card):
    """The two models' engines, and what each warmup found its KV pool to be."""
    warmup, pools = ModelRunner.warmup, []

    def recording_warmup(self, *args, **kwargs):
        pools.append(type(self.cache.k_pages))
        return warmup(self, *args, **kwargs)

    configs = [(None, EngineConfig(model=m, gpu_memory_utilization=UTILIZATION, **FLAGS)) for m in (SMALL, LARGE)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ModelRunner, "warmup", recording_warmup)
        engines, residency = start_engines(configs, max_resident=1)
    return engines, residency, pools


def _generate(engine) -> None:
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()


def test_each_pool_leaves_room_for_the_heaviest_model(standby):
    engines, residency, _ = standby
    small, large = engines[SMALL], engines[LARGE]
    heaviest = weight_bytes_bound(large.config)
    assert large.runner.weight_bytes == heaviest > 2 * small.runner.weight_bytes
    usable = int(UTILIZATION * CARD)
    for engine in (small, large):
        sizing = engine.pool_sizing
        assert sizing.source == "device memory" and sizing.weight_bytes == heaviest
        assert heaviest + sizing.pool_bytes + sizing.activation_bytes + sizing.other_bytes <= usable
    for name in [SMALL, LARGE, SMALL, LARGE]:
        assert residency.acquire(name, timeout=60)
        _generate(engines[name])
        assert live_bytes() <= usable
        residency.release(name)
    # The pool was allocated after the warmup compiled against its shapes (XLA's autotuning takes
    # memory on a GPU), and nothing compiled since.
    assert standby[2] == [jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]
    assert {n: e.compiles_since_warmup for n, e in engines.items()} == {SMALL: 0, LARGE: 0}


def _fail_restore(monkeypatch, runner: ModelRunner) -> None:
    """The runner's next pool allocation raises what XLA raises when the device is full."""
    def allocate(kv_scales):
        raise jax.errors.JaxRuntimeError(OOM)

    monkeypatch.setattr(runner, "_new_cache", allocate)


def test_a_promotion_out_of_memory_is_an_error_and_frees_what_it_placed(standby, monkeypatch):
    engines, residency, _ = standby
    assert residency.acquire(SMALL, timeout=60)
    residency.release(SMALL)
    before = live_bytes()
    _fail_restore(monkeypatch, engines[LARGE].runner)
    start = time.monotonic()
    with pytest.raises(DeviceMemoryError, match=f"model {LARGE} does not fit on the device .*RESOURCE_EXHAUSTED"):
        residency.acquire(LARGE, timeout=60)
    assert time.monotonic() - start < 10
    assert not engines[LARGE].resident and not residency.should_drain(SMALL)
    assert live_bytes() <= before - engines[SMALL].runner.weight_bytes  # the small model left, nothing came
    monkeypatch.undo()
    assert residency.acquire(LARGE, timeout=60)  # once memory is there, the model comes back
    _generate(engines[LARGE])
    residency.release(LARGE)


async def _post(session: aiohttp.ClientSession, model: str) -> tuple[int, dict]:
    body = {"model": model, "prompt": [1, 2, 3], "max_tokens": 2, "ignore_eos": True}
    async with session.post("/v1/completions", json=body) as r:
        return r.status, await r.json()


def test_the_server_answers_an_out_of_memory_swap_and_keeps_serving(standby, monkeypatch):
    """The request for the model that does not fit gets a 503 naming it, the other model still
    answers, and once memory is there the first model serves again (its engine thread lives on)."""
    from server.app import build_app
    from server.listen import make_runner

    engines, residency, _ = standby
    assert residency.acquire(LARGE, timeout=60)
    residency.release(LARGE)
    _fail_restore(monkeypatch, engines[SMALL].runner)

    async def scenario():
        runner = make_runner(build_app(list(engines.values()), model_names=list(engines), residency=residency))
        await runner.setup()
        sock = socket.create_server(("127.0.0.1", 0))
        await web.SockSite(runner, sock).start()
        try:
            async with aiohttp.ClientSession(f"http://127.0.0.1:{sock.getsockname()[1]}") as session:
                answers = [await asyncio.wait_for(_post(session, SMALL), 20),
                           await asyncio.wait_for(_post(session, LARGE), 20)]
                monkeypatch.undo()
                answers.append(await asyncio.wait_for(_post(session, SMALL), 20))
                async with session.get("/health") as r:
                    answers.append((r.status, await r.json()))
        finally:
            await runner.cleanup()
        return answers

    (status, body), (ok, _), (ok_again, _), (health, _) = asyncio.run(scenario())
    assert status == 503 and body["error"]["code"] == "device_memory"
    assert f"model {SMALL} does not fit on the device" in body["error"]["message"]
    assert ok == ok_again == health == 200


@pytest.mark.parametrize("where", ["allocate_pool", "restore"])  # building a model, promoting one
def test_bench_swap_out_of_memory_exits_with_the_error(fake_card, monkeypatch, capsys, where):
    def out_of_memory(self):
        raise jax.errors.JaxRuntimeError(OOM)

    monkeypatch.setattr(ModelRunner, where, out_of_memory)
    # The standby fixture's engines are not on this card.
    monkeypatch.setitem(_BASELINE, "bytes", _BASELINE["bytes"] + live_bytes())
    start = time.monotonic()
    code = bench_main(["swap", "--model", SMALL, "--model", LARGE, "--swaps", "2", *CLI_FLAGS])
    assert code == 2 and time.monotonic() - start < 60
    assert f"error: model {SMALL} does not fit on the device: RESOURCE_EXHAUSTED" in capsys.readouterr().err
