"""The fleet, live: prefill and decode workers and `both` replicas behind two routers, on the real model.

Workers: P (`--role prefill`), D (`--role decode`), B and R (`both`). Routers: `disagg` (P -> D,
every request disaggregated) and `replicas` (B and R). B alone is the reference: greedy output
through router, P and D must equal B's, token for token, logprobs within 1e-5 (and 1e-5 relative). The fault tests
kill workers, so they come last.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import numpy as np
import pytest

from conftest import engine_flags
from server_utils import MODEL, ServerProcess, wait_until

WORKER_ARGS = [*engine_flags(), "--kv-buffer-mb", "64"]
ROUTER_ARGS = ["--health-interval", "0.5", "--health-timeout", "1"]
HOLD_S = 5
SENTENCE = ("The history of the printing press begins with movable type in East Asia and continues with "
            "Gutenberg's press in Mainz around 1440, which spread across Europe within a few decades. ")
PROMPTS = [
    "Hello",  # shorter than a page: nothing to transfer, the decode worker computes it all
    SENTENCE * 2,  # a few pages
    SENTENCE * 9,  # ~350 tokens: several 64-token chunks on the prefill worker
    [1] + [200 + (13 * i) % 4000 for i in range(150)],  # token ids
]


@pytest.fixture(scope="module")
def fleet():
    # B first: the others then load its programs from the executable cache, instead of four
    # processes compiling the same programs at once on a cold cache.
    workers = {"B": ServerProcess(WORKER_ARGS)}
    routers = {}
    try:
        workers["B"].wait_ready()
        workers.update(P=ServerProcess([*WORKER_ARGS, "--role", "prefill", "--kv-hold-seconds", str(HOLD_S)]),
                       D=ServerProcess([*WORKER_ARGS, "--role", "decode"]), R=ServerProcess(WORKER_ARGS))
        for w in workers.values():
            w.wait_ready()
        routers["disagg"] = ServerProcess([*ROUTER_ARGS, "--prefill", workers["P"].url, "--decode", workers["D"].url,
                                           "--disagg-min-tokens", "0"], command="router")
        routers["replicas"] = ServerProcess([*ROUTER_ARGS, "--worker", workers["B"].url, "--worker",
                                             workers["R"].url], command="router")
        for r in routers.values():
            r.wait_ready()
        yield {**workers, **routers}
    finally:
        for p in [*routers.values(), *workers.values()]:
            p.stop()


async def _post(url: str, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict, dict]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        async with s.post(url + path, json=body, headers=headers or {}) as r:
            return r.status, await r.json(), dict(r.headers)


def post(url: str, body: dict, headers: dict | None = None, path: str = "/v1/completions") -> tuple[int, dict, dict]:
    return asyncio.run(_post(url, path, body, headers))


def events_of(raw: bytes) -> list:
    out = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def stream_text(url: str, body: dict, headers: dict | None = None) -> tuple[str, dict]:
    async def go():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
            async with s.post(url + "/v1/chat/completions", json={**body, "stream": True}, headers=headers or {}) as r:
                assert r.status == 200, await r.text()
                return await r.read(), dict(r.headers)

    raw, hdrs = asyncio.run(go())
    events = events_of(raw)
    assert events[-1] == "[DONE]"
    return "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"]), hdrs


def greedy(prompt, max_tokens: int = 20, **kw) -> dict:
    return dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=2, **kw)


def same_output(got: dict, want: dict, rtol: float = 1e-5) -> None:
    """Equal tokens; logprobs within 1e-5 + 1e-5 relative: the decode worker recomputes a prompt's
    tail past its last whole imported page, in another token bucket than the one server's chunk, and
    float32 sums a bucket's rows in its own order."""
    g, w = got["choices"][0], want["choices"][0]
    assert g["text"] == w["text"]
    assert g["logprobs"]["tokens"] == w["logprobs"]["tokens"]
    np.testing.assert_allclose(g["logprobs"]["token_logprobs"], w["logprobs"]["token_logprobs"], atol=1e-5, rtol=rtol)
    for a, b in zip(g["logprobs"]["top_logprobs"], w["logprobs"]["top_logprobs"]):
        assert a.keys() == b.keys()  # unlikely alternatives (logprob ~ -9) may differ in float32's 7th digit
        np.testing.assert_allclose([a[t] for t in a], [b[t] for t in a], atol=1e-5, rtol=1e-5)


def idle(worker: ServerProcess) -> bool:
    m = worker.metrics()
    return m["infire:num_requests_running"] == 0 and m["infire:kv_cache_usage_perc"] == 0


# ---- exactness -------------------------------------------------------------------------------------

def test_disaggregated_output_equals_one_server(fleet):
    """Router -> prefill worker -> KV over Mooncake -> decode worker equals one `both` server."""
    router, p, d, b = fleet["disagg"], fleet["P"], fleet["D"], fleet["B"]
    for i, prompt in enumerate(PROMPTS):
        status, want, _ = post(b.url, greedy(prompt))
        assert status == 200, want
        status, got, hdrs = post(router.url, greedy(prompt), {"x-tenant-id": f"exact-{i}"})
        assert status == 200, got
        assert hdrs["x-infire-prefill-worker"] == p.url and hdrs["x-infire-decode-worker"] == d.url
        same_output(got, want)
        if i > 0:  # at least one full page: it arrived over Mooncake and counts as cached on D
            assert hdrs.get("x-infire-kv-transfer") == "imported", hdrs
            page_tokens = got["usage"]["prompt_tokens"] // 16 * 16
            assert got["usage"]["prompt_tokens_details"]["cached_tokens"] in (page_tokens, page_tokens - 16)
    messages = [{"role": "user", "content": SENTENCE * 3 + "Summarize this."}]
    chat = dict(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    want_text, _ = stream_text(b.url, chat)
    got_text, hdrs = stream_text(router.url, chat, {"x-tenant-id": "exact-chat"})
    assert got_text == want_text and hdrs["x-infire-decode-worker"] == d.url

    wait_until(lambda: idle(p) and idle(d), 30, "both workers to drain")
    assert p.metrics()["infire:kv_transfer_holds"] == 0  # every hold was fetched and released
    assert d.metrics()["infire:kv_transfer_received_bytes_total"] > 0
    r = router.metrics()
    assert r["infire_router:kv_transfer_bytes_total"] == d.metrics()["infire:kv_transfer_received_bytes_total"]
    assert r["infire_router:disaggregated_requests_total"] == len(PROMPTS)  # all but "Hello", and the chat


def test_workers_speak_vllm_kv_transfer_params(fleet):
    """vLLM's proxy protocol straight to the workers, a replayed hold, a hold nobody fetches, and
    params that do not fit."""
    p, d, b = fleet["P"], fleet["D"], fleet["B"]
    prompt = SENTENCE * 4
    vllm_prefill = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                    "remote_block_ids": None, "remote_host": None, "remote_port": None}
    status, pre, _ = post(p.url, greedy(prompt, max_tokens=1, kv_transfer_params=vllm_prefill))
    assert status == 200, pre
    params = pre["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["num_tokens"] % 16 == 0 and params["num_bytes"] > 0
    assert params["first_token_id"] is not None
    assert params["first_token_logprob"] == pytest.approx(pre["choices"][0]["logprobs"]["token_logprobs"][0])
    _, want, _ = post(b.url, greedy(prompt))
    status, got, hdrs = post(d.url, greedy(prompt, kv_transfer_params=params))
    assert status == 200 and hdrs["x-infire-kv-transfer"] == "imported"
    assert int(hdrs["x-infire-kv-bytes"]) == params["num_bytes"]
    same_output(got, want)
    # The hold was released on the first fetch: a replay computes the prompt locally, still exactly.
    status, again, hdrs = post(d.url, greedy(prompt, kv_transfer_params=params))
    assert status == 200 and hdrs["x-infire-kv-transfer"] == "failed"
    same_output(again, want)

    # Params for another prompt, or sent to the wrong role, are the client's error.
    status, err, _ = post(d.url, greedy("Another start. " + prompt, kv_transfer_params=params))
    assert status == 400 and err["error"]["param"] == "kv_transfer_params"
    assert "another prompt" in err["error"]["message"]
    status, err, _ = post(b.url, greedy(prompt, kv_transfer_params=vllm_prefill))
    assert status == 400 and "--role prefill" in err["error"]["message"]
    status, err, _ = post(p.url, greedy(prompt, kv_transfer_params=vllm_prefill, stream=True))
    assert status == 400 and err["error"]["param"] == "stream"

    # A hold nobody fetches expires, and its region comes back.
    status, pre, _ = post(p.url, greedy(SENTENCE * 6, max_tokens=1, kv_transfer_params=vllm_prefill))
    assert status == 200 and p.metrics()["infire:kv_transfer_holds"] == 1
    wait_until(lambda: p.metrics()["infire:kv_transfer_holds"] == 0, HOLD_S + 5, "the hold to expire")
    status, err, _ = post(p.url, {"transfer_id": pre["kv_transfer_params"]["transfer_id"]},
                          path="/v1/kv_transfer/release")
    assert status == 404 and err["error"]["code"] == "kv_hold_not_found"
    wait_until(lambda: idle(p) and idle(d), 30, "both workers to drain")


def expired_holds(worker: ServerProcess) -> float:
    return sum(s.value for s in worker.metric_samples()
               if s.name == "infire:kv_transfer_failures_total" and s.labels.get("reason") == "expired")


def test_a_decode_failure_after_the_prefill_releases_the_hold_at_once(fleet):
    """The decode worker refuses what its prefill worker ran (min_tokens goes to the decode side only):
    the hold is released before the client gets the error, not --kv-hold-seconds later (by the decode
    worker, or by the router if its release lands first), and the prefill worker's staging buffer is
    whole again. tests/test_router_holds.py has the other failures (5xx, broken or timed-out
    connection, dead worker, client gone); tests/test_kv_transfer.py the decode worker's own releases."""
    router, p = fleet["disagg"], fleet["P"]
    before = p.metrics()
    assert before["infire:kv_transfer_holds"] == 0
    assert before["infire:kv_transfer_buffer_free_bytes"] == 64 << 20  # --kv-buffer-mb 64: nothing held
    expired, released = expired_holds(p), router.metrics()["infire_router:kv_holds_released_total"]
    status, err, hdrs = post(router.url, greedy(SENTENCE * 6, max_tokens=4, min_tokens=8), {"x-tenant-id": "doomed"})
    assert status == 400 and err["error"]["param"] == "min_tokens"
    assert hdrs["x-infire-prefill-worker"] == p.url  # the prefill ran, and held the prompt's pages
    after = p.metrics()
    assert after["infire:kv_transfer_holds"] == 0
    assert after["infire:kv_transfer_buffer_free_bytes"] == before["infire:kv_transfer_buffer_free_bytes"]
    # 0: the decode worker's release came first, and the router's answered 404
    assert router.metrics()["infire_router:kv_holds_released_total"] - released in (0, 1)
    assert expired_holds(p) == expired  # released, not expired


# ---- sessions and tenants --------------------------------------------------------------------------

def test_sessions_stick_to_one_replica_and_hit_its_cache(fleet):
    router, b, r = fleet["replicas"], fleet["B"], fleet["R"]
    placed = {}
    for s in range(12):
        status, out, hdrs = post(router.url, greedy(f"Session {s} says hello.", max_tokens=2),
                                 {"x-session-affinity": f"user-{s}"})
        assert status == 200, out
        assert hdrs["x-session-affinity"] == f"user-{s}"
        placed[s] = hdrs["x-infire-decode-worker"]
    assert set(placed.values()) == {b.url, r.url}  # 12 sessions spread over both (fails with p = 2**-11)
    before = router.metrics()
    for s in range(4):  # a second, longer turn: same replica, and the first turn's prefix is cached
        history = SENTENCE * 3 + f"Session {s}."
        status, first, hdrs = post(router.url, greedy(history, max_tokens=4), {"x-session-affinity": f"user-{s}"})
        assert status == 200 and hdrs["x-infire-decode-worker"] == placed[s]
        status, second, hdrs = post(router.url, greedy(history + first["choices"][0]["text"] + " And then?",
                                                        max_tokens=4), {"x-session-affinity": f"user-{s}"})
        assert status == 200 and hdrs["x-infire-decode-worker"] == placed[s]
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 48
    after = router.metrics()
    asked = after["infire_router:affinity_requests_total"] - before["infire_router:affinity_requests_total"]
    hits = after["infire_router:affinity_hits_total"] - before["infire_router:affinity_hits_total"]
    assert asked == 8 and hits == 8


def test_embeddings_through_both_routers(fleet):
    """The workers run `--runner pooling`: /v1/embeddings, /score and /rerank through either router
    equal B's own answers (never disaggregated: the decode worker computes the inputs itself, P takes
    no request)."""
    body = {"model": MODEL, "input": [SENTENCE * 3, PROMPTS[3]]}
    status, want, _ = post(fleet["B"].url, body, path="/v1/embeddings")
    assert status == 200, want
    prefilled = fleet["P"].metrics()["infire:prompt_tokens_total"]
    for router in ("replicas", "disagg"):
        status, got, hdrs = post(fleet[router].url, body, path="/v1/embeddings")
        assert status == 200, got
        assert hdrs["x-infire-decode-worker"] in (fleet["B"].url, fleet["R"].url, fleet["D"].url)
        assert got["usage"] == want["usage"]
        for g, w in zip(got["data"], want["data"]):
            np.testing.assert_allclose(g["embedding"], w["embedding"], atol=2e-6)
    status, out, _ = post(fleet["replicas"].url, {"model": MODEL, "input": []}, path="/v1/embeddings")
    assert status == 400 and out["error"]["param"] == "input"
    query = {"model": MODEL, "query": "What did Gutenberg build?", "documents": [SENTENCE, "Bananas are yellow."]}
    status, want, _ = post(fleet["B"].url, query, path="/rerank")
    assert status == 200, want
    for router in ("replicas", "disagg"):
        status, got, _ = post(fleet[router].url, query, path="/v1/rerank")
        assert status == 200 and [r["index"] for r in got["results"]] == [r["index"] for r in want["results"]]
        status, scored, _ = post(fleet[router].url, {"model": MODEL, "text_1": query["query"],
                                                     "text_2": query["documents"]}, path="/score")
        assert status == 200, scored
        np.testing.assert_allclose([d["score"] for d in scored["data"]],
                                   [r["relevance_score"] for r in sorted(want["results"], key=lambda r: r["index"])],
                                   atol=2e-6)
    assert fleet["P"].metrics()["infire:prompt_tokens_total"] == prefilled


def test_tenants_stay_apart_across_the_fleet(fleet):
    replicas, disagg, p = fleet["replicas"], fleet["disagg"], fleet["P"]
    prompt = SENTENCE * 3 + "Tenants."
    session = {"x-session-affinity": "shared-session"}
    _, first, _ = post(replicas.url, greedy(prompt, max_tokens=2), {**session, "x-tenant-id": "alpha"})
    _, other, _ = post(replicas.url, greedy(prompt, max_tokens=2), {**session, "x-tenant-id": "beta"})
    _, again, _ = post(replicas.url, greedy(prompt, max_tokens=2), {**session, "x-tenant-id": "alpha"})
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # same replica, other tenant
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # Disaggregated: the prefill worker computes the second tenant's prompt from scratch.
    post(disagg.url, greedy(prompt, max_tokens=2), {"x-tenant-id": "gamma"})
    hits = p.metrics()["infire:prefix_cache_hits_total"]
    status, out, hdrs = post(disagg.url, greedy(prompt, max_tokens=2), {"x-tenant-id": "delta"})
    assert status == 200 and hdrs["x-infire-kv-transfer"] == "imported"
    assert p.metrics()["infire:prefix_cache_hits_total"] == hits


# ---- faults (these kill workers: last) -------------------------------------------------------------

async def _stream_until_killed(url: str, body: dict, headers: dict, victim: ServerProcess) -> tuple[list, float]:
    """Streams, kills `victim` after the first content chunks; returns the events and the seconds
    from the kill to the end of the stream."""
    killed_at = None
    raw = b""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        async with s.post(url + "/v1/completions", json={**body, "stream": True}, headers=headers) as r:
            assert r.status == 200
            async for chunk in r.content.iter_any():
                raw += chunk
                if killed_at is None and raw.count(b"data: ") >= 3:
                    victim.kill()
                    killed_at = time.monotonic()
    assert killed_at is not None
    return events_of(raw), time.monotonic() - killed_at


def test_a_killed_replica_fails_its_stream_promptly_and_the_other_serves(fleet):
    router, b, r = fleet["replicas"], fleet["B"], fleet["R"]
    session = {"x-session-affinity": "doomed"}
    _, _, hdrs = post(router.url, greedy("Which replica?", max_tokens=1), session)
    victim, survivor = (b, r) if hdrs["x-infire-decode-worker"] == b.url else (r, b)
    body = greedy("Count to a thousand:", max_tokens=600, ignore_eos=True)
    events, seconds = asyncio.run(_stream_until_killed(router.url, body, session, victim))
    assert seconds < 5
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert errors and errors[0]["error"]["type"] == "server_error" and victim.url in errors[0]["error"]["message"]
    assert events[-1] == "[DONE]"

    def marked_down() -> bool:
        with_health = asyncio.run(_get_json(router.url + "/health"))
        return any(w["url"] == victim.url and not w["healthy"] for w in with_health["workers"])

    wait_until(marked_down, 10, "the router to mark the killed replica down")
    status, out, hdrs = post(router.url, greedy("Still there?", max_tokens=4), session)
    assert status == 200 and hdrs["x-infire-decode-worker"] == survivor.url
    wait_until(lambda: idle(survivor), 30, "the survivor to drain")


async def _get_json(url: str) -> dict:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        async with s.get(url) as r:
            return await r.json()


def test_killed_prefill_then_decode_workers(fleet):
    """Prefill dies mid-request: the decode worker computes the prompt instead, so the client still
    gets the exact answer. Then decode dies mid-stream: the client gets an error event promptly."""
    router, p, d = fleet["disagg"], fleet["P"], fleet["D"]
    reference = next(w for w in (fleet["B"], fleet["R"]) if w.proc.poll() is None)  # one replica was killed
    prompt = SENTENCE * 20  # ~800 tokens: long enough to be mid-prefill at the kill

    async def request_and_kill_prefill():
        task = asyncio.create_task(_post(router.url, "/v1/completions", greedy(prompt, max_tokens=8)))
        wait = time.monotonic() + 30
        while p.metrics()["infire:num_requests_running"] == 0 and time.monotonic() < wait:
            await asyncio.sleep(0.05)
        p.kill()
        return await task

    status, got, hdrs = asyncio.run(request_and_kill_prefill())
    assert status == 200, got
    assert hdrs["x-infire-decode-worker"] == d.url and "x-infire-prefill-worker" not in hdrs
    _, want, _ = post(reference.url, greedy(prompt, max_tokens=8))
    # The decode worker may hold part of this prompt from earlier tests, so its chunks (and float32
    # summation order) differ from the reference's: 1.4e-5 on a logprob of -1.58 was seen.
    same_output(got, want)
    health = asyncio.run(_get_json(router.url + "/health"))
    assert [w["healthy"] for w in health["workers"] if w["url"] == p.url] == [False]
    wait_until(lambda: idle(d), 30, "the decode worker to drain")

    events, seconds = asyncio.run(_stream_until_killed(
        router.url, greedy("Count to a thousand:", max_tokens=600, ignore_eos=True), {}, d))
    assert seconds < 5
    assert any(isinstance(e, dict) and "error" in e for e in events) and events[-1] == "[DONE]"
    status, err, _ = post(router.url, greedy("Anyone?", max_tokens=2))
    assert status == 503 and err["error"]["type"] == "server_error"
