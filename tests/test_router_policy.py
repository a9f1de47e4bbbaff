"""The router's choices and bookkeeping, without servers or a model: affinity, cache-aware routing,
loads, worker health, prompt estimates, error bodies and the command line's checks."""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import subprocess
import sys

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from router.app import RouterConfig, add_router_args, config_from_args
from router.errors import APIError, error_middleware, no_healthy_worker, worker_unavailable
from router.policy import (BALANCE_ABS, IMAGE_TOKENS, RUNNING_WEIGHT, TEXT_CHUNK, Policy, PrefixIndex, SessionMap,
                           estimate_prompt_tokens, prefix_chain, rendezvous, route_key)
from router.workers import InFlight, Worker, WorkerDown

SESSIONS = [f"session-{i}" for i in range(2000)]


def _workers(n: int, role: str = "both") -> list[Worker]:
    ws = [Worker(f"http://10.0.0.{i}:8000", role) for i in range(n)]
    for w in ws:
        w.probe_result(True)
    return ws


def _assign(pool: list[Worker]) -> dict[str, str]:
    return {s: rendezvous(s, pool).url for s in SESSIONS}


# ---- session affinity -----------------------------------------------------------------------------
def test_rendezvous_is_stable_and_spreads_sessions():
    pool = _workers(4)
    first = _assign(pool)
    assert first == _assign(list(reversed(pool)))  # the pool's order does not matter
    counts = {w.url: list(first.values()).count(w.url) for w in pool}
    assert all(400 < c < 600 for c in counts.values()), counts  # ~500 each


def test_removing_a_worker_moves_only_its_sessions():
    pool = _workers(5)
    before = _assign(pool)
    gone = pool[2]
    after = _assign([w for w in pool if w is not gone])
    moved = {s for s in SESSIONS if before[s] != after[s]}
    assert moved == {s for s in SESSIONS if before[s] == gone.url}
    assert len(moved) > 300


def test_adding_a_worker_moves_about_its_share():
    pool = _workers(6)
    before = _assign(pool[:5])
    after = _assign(pool)
    moved = [s for s in SESSIONS if before[s] != after[s]]
    assert all(after[s] == pool[5].url for s in moved)  # sessions only move to the new worker
    assert abs(len(moved) - len(SESSIONS) / 6) < 80, len(moved)


def test_down_worker_gets_no_sessions_and_gets_them_back():
    workers = _workers(3)
    policy = Policy("round_robin")  # affinity wins over the policy for sessions

    def route() -> dict[str, str]:
        pool = [w for w in workers if w.healthy]
        return {s: policy.choose(pool, route_key("completions", {"prompt": "hi"}, session=s)).worker.url
                for s in SESSIONS[:300]}

    before = route()
    down = workers[1]
    down.probe_result(False, hard=True, detail="refused")
    during = route()
    assert down.url not in during.values()
    assert all(during[s] == before[s] for s in during if before[s] != down.url)
    down.probe_result(True)
    assert route() == before


def test_affinity_hits_and_no_affinity():
    workers = _workers(3)
    policy = Policy("round_robin")
    key = route_key("completions", {"prompt": "hello"}, session="s1")
    first = policy.choose(workers, key)
    assert first.reason == "affinity" and first.affinity_hit is False  # a new session
    again = policy.choose(workers, key)
    assert again.worker is first.worker and again.affinity_hit is True

    off = Policy("round_robin", affinity=False)
    urls = [off.choose(workers, key).worker.url for _ in range(3)]
    assert urls == [w.url for w in workers]  # round robin, even with a session
    hits = [off.choose(workers, key).affinity_hit for _ in range(3)]
    assert hits == [False, False, False]  # still measured: round robin breaks sessions


def test_session_map_is_bounded():
    sessions = SessionMap(capacity=3)
    for s in "abcd":
        sessions.record(s, "w0")
    assert len(sessions) == 3
    assert sessions.record("a", "w0") is False  # the oldest was forgotten
    assert sessions.record("d", "w0") is True


# ---- cache-aware -----------------------------------------------------------------------------------
LONG = "You are a helpful assistant. " * 20  # 580 characters: 10 chunks


def test_repeated_prefix_goes_back_to_its_worker():
    workers = _workers(3)
    policy = Policy("cache_aware")
    first = policy.choose(workers, route_key("completions", {"prompt": LONG + "Q1"}))
    assert first.reason == "load" and first.cached_tokens == 0
    first.worker.load.sent(500)  # busy, but within the balance slack
    again = policy.choose(workers, route_key("completions", {"prompt": LONG + "Q2, longer"}))
    assert again.worker is first.worker and again.reason == "cache"
    key = route_key("completions", {"prompt": LONG + "Q2, longer"})
    assert key.tokens * 0.85 < again.cached_tokens < key.tokens  # all but the last chunk was seen
    other = policy.choose(workers, route_key("completions", {"prompt": "Something else entirely. " * 20}))
    assert other.worker is not first.worker and other.reason == "load"


def test_chat_prefix_matches_a_longer_conversation():
    workers = _workers(2)
    policy = Policy("cache_aware")
    system = {"role": "system", "content": LONG}
    turn = [system, {"role": "user", "content": "hi"}]
    first = policy.choose(workers, route_key("chat", {"messages": turn}))
    first.worker.load.sent(100)
    longer = turn + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    assert policy.choose(workers, route_key("chat", {"messages": longer})).worker is first.worker


def test_tenants_never_match_each_other():
    assert not set(prefix_chain(LONG, "alice")) & set(prefix_chain(LONG, "bob"))
    workers = _workers(2)
    policy = Policy("cache_aware")
    first = policy.choose(workers, route_key("completions", {"prompt": LONG}, tenant="alice"))
    first.worker.load.sent(100)
    bob = policy.choose(workers, route_key("completions", {"prompt": LONG}, tenant="bob"))
    assert bob.worker is not first.worker and bob.cached_tokens == 0
    alice = policy.choose(workers, route_key("completions", {"prompt": LONG}, tenant="alice"))
    assert alice.worker is first.worker and alice.reason == "cache"


def test_token_id_prompts_are_indexed():
    workers = _workers(2)
    policy = Policy("cache_aware")
    ids = list(range(1000, 1100))
    first = policy.choose(workers, route_key("completions", {"prompt": ids}))
    first.worker.load.sent(50)
    again = policy.choose(workers, route_key("completions", {"prompt": ids + [7, 8, 9]}))
    assert again.worker is first.worker and again.reason == "cache"
    assert prefix_chain(ids, "") != prefix_chain([str(i) for i in ids][0], "")  # ids and text never mix


def test_overload_falls_back_to_least_loaded():
    workers = _workers(3)
    policy = Policy("cache_aware")
    first = policy.choose(workers, route_key("completions", {"prompt": LONG}))
    workers[2].load.sent(10)
    first.worker.load.sent(BALANCE_ABS + 1)  # beyond min + BALANCE_ABS (and 1.5x min)
    over = policy.choose(workers, route_key("completions", {"prompt": LONG}))
    assert over.worker is workers[1] and over.reason == "load"


def test_busy_workers_have_a_relative_slack():
    workers = _workers(3)
    policy = Policy("cache_aware")
    first = policy.choose(workers, route_key("completions", {"prompt": LONG}))
    for w, queued in zip(workers, (14_000, 10_000, 12_000)):  # the cached worker 1.4x the least busy one
        w.load.queued_tokens = queued
    assert policy.choose(workers, route_key("completions", {"prompt": LONG})).worker is first.worker
    first.worker.load.queued_tokens = 16_000  # 1.6x
    assert policy.choose(workers, route_key("completions", {"prompt": LONG})).worker is workers[1]


def test_short_match_goes_to_least_loaded_with_the_longest_match_on_ties():
    workers = _workers(3)
    policy = Policy("cache_aware")
    policy.index(workers[2].url).insert(prefix_chain(LONG[:TEXT_CHUNK], ""))
    choice = policy.choose(workers, route_key("completions", {"prompt": LONG}))  # 1 chunk of 10: < 50%
    assert choice.reason == "load" and choice.worker is workers[2]


def test_prefix_index_is_a_bounded_lru():
    index = PrefixIndex(capacity=100)
    old = prefix_chain("a" * TEXT_CHUNK * 80, "")
    index.insert(old)
    assert index.match(old) == 80
    new = prefix_chain("b" * TEXT_CHUNK * 50, "")
    index.insert(new)
    assert len(index) == 100
    assert index.match(new) == 50
    assert index.match(old) == 0  # its head was the least recently used


def test_round_robin_and_least_load():
    workers = _workers(3)
    rr = Policy("round_robin")
    key = route_key("completions", {"prompt": "x"})
    assert [rr.choose(workers, key).worker for _ in range(4)] == [*workers, workers[0]]
    ll = Policy("least_load")
    workers[0].load.sent(10)
    workers[1].load.sent(0)  # one request (RUNNING_WEIGHT), its prompt all cached
    assert ll.choose(workers, key).worker is workers[2]
    workers[2].load.sent(RUNNING_WEIGHT - 9)  # loads now 74, 64, 119
    assert ll.choose(workers, key).worker is workers[1]
    workers[0].load.answering(10)  # its first byte: the prompt is done, the request still counts
    assert workers[0].load.outstanding == RUNNING_WEIGHT
    assert ll.choose(workers, key).worker is workers[0]  # a tie goes to the first in order


def test_prefill_choice_is_least_queued_tokens():
    prefills = _workers(3, "prefill")
    prefills[0].load.sent(300)
    prefills[1].load.sent(100)
    prefills[2].load.sent(200)
    assert Policy.choose_prefill(prefills) is prefills[1]


def test_unknown_policy_and_empty_pool():
    with pytest.raises(ValueError):
        Policy("random")
    with pytest.raises(ValueError):
        Policy().choose([], route_key("completions", {"prompt": "x"}))


# ---- prompt estimates -------------------------------------------------------------------------------
@pytest.mark.parametrize("body,tokens", [
    ({"prompt": "abcdefgh"}, 2),
    ({"prompt": "abcdefghi"}, 3),  # rounded up
    ({"prompt": [1, 2, 3, 4, 5]}, 5),
    ({"prompt": ["abcd", "abcdefgh"]}, 3),
    ({"prompt": [[1, 2], [3, 4, 5]]}, 5),
    ({"prompt": None}, 0),
])
def test_completion_prompt_estimates(body, tokens):
    assert estimate_prompt_tokens("completions", body) == tokens


def test_prompt_counts():
    assert route_key("completions", {"prompt": [1, 2, 3]}).prompts == 1
    assert route_key("completions", {"prompt": ["a", "b"]}).prompts == 2
    assert route_key("completions", {"prompt": [[1], [2], [3]]}).prompts == 3
    assert route_key("chat", {"messages": [{"role": "user", "content": "a"}] * 3}).prompts == 1
    # A batch is keyed by its first prompt: it matches that prompt sent alone.
    assert route_key("completions", {"prompt": [LONG, "x"]}).chain == route_key("completions", {"prompt": LONG}).chain
    # Embeddings, scores and reranks: every text is a prompt, the first (the query) keys the request.
    assert route_key("embeddings", {"input": [LONG, "x"]}).chain == route_key("completions", {"prompt": LONG}).chain
    rerank = route_key("rerank", {"query": LONG, "documents": ["a" * 40, "b" * 40]})
    assert rerank.prompts == 3 and rerank.tokens == estimate_prompt_tokens("completions", {"prompt": LONG}) + 20
    assert rerank.chain == route_key("completions", {"prompt": LONG}).chain
    score = route_key("score", {"queries": "q" * 8, "documents": ["a" * 40, "b" * 40]})
    assert score.prompts == 3 and score.tokens == 2 + 20


def test_chat_prompt_estimates():
    messages = [{"role": "system", "content": "a" * 40},
                {"role": "user", "content": [{"type": "text", "text": "b" * 20}, {"type": "text", "text": "c" * 20}]}]
    assert estimate_prompt_tokens("chat", {"messages": messages}) == 80 // 4 + 2 * 4
    assert estimate_prompt_tokens("chat", {"messages": "not a list"}) == 0
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with_images = [messages[0], {"role": "user", "content": [*messages[1]["content"], image, image]}]
    assert estimate_prompt_tokens("chat", {"messages": with_images}) == 80 // 4 + 2 * 4 + 2 * IMAGE_TOKENS


# ---- worker health and requests in flight -------------------------------------------------------------
def test_health_transitions():
    w = Worker("http://w:1", "decode")
    assert not w.healthy  # until its first 200
    w.probe_result(True)
    w.probe_result(False, detail="timed out")
    assert w.healthy  # one timeout is not enough
    w.probe_result(True)
    w.probe_result(False, detail="timed out")
    assert w.healthy  # a 200 in between resets the count
    w.probe_result(False, detail="timed out")
    assert not w.healthy
    w.probe_result(True)
    w.probe_result(False, hard=True, detail="refused")
    assert not w.healthy  # one refused connection is


def test_in_flight_load_and_failure_when_the_worker_goes_down():
    async def main() -> None:
        w = _workers(1)[0]
        started = asyncio.Event()

        async def request() -> str:
            with InFlight(w, 100) as flight:
                assert (w.load.queued_tokens, w.load.requests, w.in_flight) == (100, 1, 1)
                flight.answering()
                assert w.load.outstanding == RUNNING_WEIGHT
                started.set()
                await asyncio.sleep(60)  # a worker that never answers
            return "answered"

        task = asyncio.create_task(request())
        await started.wait()
        w.mark_down("hung")
        with pytest.raises(WorkerDown, match="hung"):
            await asyncio.wait_for(task, 1)
        assert (w.load.outstanding, w.in_flight) == (0, 0)
        with pytest.raises(WorkerDown):  # a down worker takes nothing new
            with InFlight(w, 1):
                pass

    asyncio.run(main())


def test_client_disconnect_stays_a_cancellation():
    async def main() -> None:
        w = _workers(1)[0]

        async def request() -> None:
            with InFlight(w, 10):
                await asyncio.sleep(60)

        task = asyncio.create_task(request())
        await asyncio.sleep(0)
        task.cancel()  # what aiohttp does when the client goes away
        w.mark_down("and the worker died too")
        with pytest.raises(asyncio.CancelledError):
            await task
        assert w.load.outstanding == 0

    asyncio.run(main())


# ---- errors and flags -------------------------------------------------------------------------------
def _is_openai_error(body: dict) -> bool:
    return set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}


def test_error_bodies_have_the_openai_schema():
    down = worker_unavailable("http://w:1", "is unhealthy (hung)")
    assert down.status == 503 and _is_openai_error(down.body())
    assert down.body()["error"]["code"] == "worker_unavailable" and "http://w:1" in down.body()["error"]["message"]
    assert down.body()["error"]["type"] == "server_error"
    none = no_healthy_worker("decode")
    assert none.status == 503 and none.body()["error"]["code"] == "no_healthy_worker"
    event = down.event()
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert json.loads(event[len(b"data: "):]) == down.body()


@pytest.mark.parametrize("exc,status", [(APIError(400, "bad"), 400), (web.HTTPNotFound(), 404),
                                        (RuntimeError("boom"), 500)])
def test_error_middleware(exc, status):
    async def handler(request):
        raise exc

    response = asyncio.run(error_middleware(make_mocked_request("POST", "/v1/completions"), handler))
    assert response.status == status
    assert _is_openai_error(json.loads(response.body))


def test_the_router_imports_no_jax():
    """The router is a light process: its errors come from server/api_error.py, not the engine's."""
    code = "import sys, router.app, router.fleet; assert 'jax' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=pathlib.Path(__file__).parents[1])


def _config(*argv: str) -> RouterConfig:
    p = argparse.ArgumentParser()
    add_router_args(p)
    return config_from_args(p.parse_args(list(argv)))


def test_flags():
    c = _config("--prefill", "http://p:1/", "--decode", "http://d:1", "--worker", "http://r:1", "--no-affinity",
                "--policy", "least_load", "--disagg-min-tokens", "0")
    assert c.workers == (("http://p:1", "prefill"), ("http://d:1", "decode"), ("http://r:1", "both"))
    assert (c.policy, c.affinity, c.disagg_min_tokens) == ("least_load", False, 0)
    for bad in ([], ["--decode", "http://d:1"], ["--worker", "localhost:1"], ["--worker", "http://a:1"] * 2,
                ["--worker", "http://a:1", "--health-timeout", "0"], ["--worker", "http://a:1", "--disagg-min-tokens",
                                                                      "-1"]):
        with pytest.raises(ValueError):
            _config(*bad)
