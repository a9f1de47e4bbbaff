"""Hot standby: several models in one server, at most `max_resident` on the device (infire_jax/engine/residency.py).

Two real-shaped models (the default SmolLM2 and a random-weight `dummy:smollm2-135m`) share one
device with max_resident=1, so every switch between them demotes one and promotes the other. Each
model's outputs are first taken from its own engine alone (the single-model path, no server), then
compared with what the server answers to alternating and concurrent requests: equal tokens and
logprobs, swaps counted in /metrics, nothing compiled, no KV page left held.
"""

from __future__ import annotations

import asyncio
import re
import socket
import time

import aiohttp
import openai
import pytest
from aiohttp import web

from infire_jax import LLM, EngineConfig, SamplingParams
from infire_jax.errors import ConfigError, ModelNotFoundError
from infire_jax.engine.residency import start_engines
from conftest import SMALL_ENGINE, engine_flags
from server_utils import MODEL, ServerProcess

DUMMY = "dummy:smollm2-135m"
# The suite's small engine: the default model's programs come from the executable cache `smol_llm` filled.
FLAGS = SMALL_ENGINE
CLI_FLAGS = engine_flags()
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def standby():
    engines, residency = start_engines([(None, EngineConfig(**FLAGS)), (None, EngineConfig(model=DUMMY, **FLAGS))],
                                       max_resident=1)
    return engines, residency


def _reference(engines, residency) -> dict[tuple[str, str], tuple[str, list[float]]]:
    """Each model's greedy text and token logprobs from its own engine, with the server not running."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0, ignore_eos=True)
    out = {}
    for name, engine in engines.items():
        assert residency.acquire(name, timeout=60)
        for prompt, result in zip(PROMPTS, LLM(engine=engine).generate(PROMPTS, params)):
            c = result.outputs[0]
            out[name, prompt] = c.text, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]
        residency.release(name)
    return out


async def _serve(app: web.Application, scenario):
    from server.listen import make_runner

    runner = make_runner(app)
    await runner.setup()
    sock = socket.create_server(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{sock.getsockname()[1]}") as session:
            return await scenario(session)
    finally:
        await runner.cleanup()


async def _complete(session: aiohttp.ClientSession, model: str, prompt: str) -> tuple[str, list[float]]:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 0,
            "ignore_eos": True}
    async with session.post("/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        choice = (await r.json())["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"]


def _samples(text: str, metric: str) -> dict[str, float]:
    return {m: float(v) for m, v in re.findall(rf'^{re.escape(metric)}{{model_name="([^"]+)"}} (\S+)$', text, re.M)}


def test_two_models_alternating_answer_as_each_alone(standby):
    from server.app import build_app

    engines, residency = standby
    (a, engine_a), (b, engine_b) = engines.items()
    assert (a, b) == (MODEL, DUMMY) and engine_a.resident and not engine_b.resident
    reference = _reference(engines, residency)
    swaps_before = sum(s.promotions for s in residency.stats.values())

    async def scenario(session: aiohttp.ClientSession):
        async with session.get("/v1/models") as r:
            listed = [m["id"] for m in (await r.json())["data"]]
        async with session.post("/v1/completions", json={"model": "nope", "prompt": "hi"}) as r:
            unknown = r.status, (await r.json())["error"]
        async with session.post("/v1/completions", json={"prompt": "hi"}) as r:  # which of the two?
            unnamed = r.status, (await r.json())["error"]
        alternating = [(m, p, await _complete(session, m, p)) for p in PROMPTS for m in (a, b)]
        started = time.monotonic()  # both models at once: one waits for the other to drain, none fails
        together = await asyncio.gather(*(_complete(session, m, p) for p in PROMPTS for m in (a, b)))
        concurrent = [(m, p, out) for (p, m), out in zip([(p, m) for p in PROMPTS for m in (a, b)], together)]
        elapsed = time.monotonic() - started
        async with session.get("/metrics") as r:
            metrics = await r.text()
        async with session.get("/health") as r:
            health = await r.json()
        return listed, unknown, unnamed, alternating, concurrent, elapsed, metrics, health

    app = build_app([engine_a, engine_b], residency=residency, host_to_device_bytes_per_second=1e9)
    listed, unknown, unnamed, alternating, concurrent, elapsed, metrics, health = asyncio.run(_serve(app, scenario))

    assert listed == [a, b]
    assert unknown[0] == 404 and unknown[1]["code"] == "model_not_found" and a in unknown[1]["message"]
    assert unnamed[0] == 400 and unnamed[1]["param"] == "model" and "serves 2 models" in unnamed[1]["message"]
    for model, prompt, (text, logprobs) in alternating + concurrent:
        want_text, want_logprobs = reference[model, prompt]
        assert text == want_text, (model, prompt)
        assert logprobs == pytest.approx(want_logprobs, rel=1e-4, abs=1e-4), (model, prompt)  # batching order
    swaps = _samples(metrics, "infire:model_swaps_total")
    assert sum(swaps.values()) - swaps_before >= 2 * len(PROMPTS)  # every alternation swapped
    assert sum(swaps.values()) == sum(s.promotions for s in residency.stats.values())
    assert _samples(metrics, "infire:model_swap_bytes_total")[b] == residency.stats[b].bytes > 0
    assert sum(_samples(metrics, "infire:model_resident").values()) == 1
    assert _samples(metrics, "infire:compiles_since_warmup") == {a: 0, b: 0}
    assert health["status"] == "ok" and health["running"] == health["waiting"] == 0
    assert all(engine.kv.usage == 0 for engine in engines.values())


def test_a_model_that_cannot_start_is_named():
    with pytest.raises(ConfigError, match=re.escape(DUMMY)):  # a pool too small for one sequence
        start_engines([(None, EngineConfig(model=DUMMY, **{**FLAGS, "num_kv_pages": 2}))], max_resident=1)
    with pytest.raises(ModelNotFoundError, match="missing.gguf"):
        start_engines([(None, EngineConfig(model="/nonexistent/missing.gguf", **FLAGS))], max_resident=1)


@pytest.mark.parametrize("flags, message", [
    (["--model", DUMMY, "--model", DUMMY], "same name"),
    (["--model", DUMMY, "--model", "dummy:llama-3.2-1b", "--served-model-name", "x"], "one --served-model-name per"),
    (["--model", DUMMY, "--served-model-name", "x", "y", "x"], "given twice"),
    (["--max-resident", "0"], "--max-resident must be >= 1"),
    (["--model", DUMMY, "--model", DUMMY, "--role", "prefill"], "--role both"),
])
def test_serve_refuses_bad_model_flags(flags, message, capsys):
    from infire_jax.cli import main

    names = ["--served-model-name", "a", "--served-model-name", "b"] if "--role" in flags else []
    assert main(["serve", "--port", "0", *CLI_FLAGS, *flags, *names]) == 2
    assert message in capsys.readouterr().err


def test_serve_two_models_boots_with_a_timeline(default_gguf):
    """The CLI: `serve --model A --model B --max-resident 1`: ready in a bounded time, with its boot
    timeline, serving both models under their --served-model-name."""
    server = ServerProcess([*CLI_FLAGS, "--model", default_gguf, "--model", DUMMY, "--served-model-name", "smol",
                            "--served-model-name", "random", "--max-resident", "1"])
    started = time.monotonic()
    try:
        server.wait_ready()
        ready = time.monotonic() - started
        log = server.log_tail(20000)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        served = [m.id for m in client.models.list().data]
        texts = {m: client.completions.create(model=m, prompt="Hello", max_tokens=4, temperature=0).choices[0].text
                 for m in served}
        resident = server.metrics()
    finally:
        server.stop()
    assert ready < 120, f"the server took {ready:.0f} s to be ready"
    assert re.search(r"boot: weights [\d.]+ GB (restored from its checkpoint|loaded from the source)", log)
    assert "warmup of" in log and "hot standby: 1 of" in log and "ready to serve" in log
    assert served == ["smol", "random"] and all(isinstance(t, str) for t in texts.values())
    assert resident["infire:model_resident"] == 1.0
