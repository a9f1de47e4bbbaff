"""`bench fleet`: its pure parts (stream accounting, TPOT, arrivals, overlap, hit ratios), and both
workloads end to end against a fake router in this process (no engine, a few seconds).

Real fleets are benchmarked by hand: `python -m infire_jax.bench fleet --fleet router/configs/...`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading

import numpy as np
import pytest
from aiohttp import web

from infire_jax.bench import fleet as bf
from infire_jax.bench import fleet_workloads as fw
from infire_jax.bench.__main__ import SUBCOMMANDS, build_parser
from infire_jax.bench.common import BenchError, add_output_args


def _timing(start, ttft, e2el, n, prompt=10, cached=0, itl=None):
    return fw.StreamTiming(ttft=ttft, e2el=e2el, itl=itl or [], prompt_tokens=prompt, output_tokens=n, start=start,
                           cached_tokens=cached)


# ---- pure parts -----------------------------------------------------------------------------------------

def test_registered_and_every_flag_documented():
    assert SUBCOMMANDS["fleet"] is bf
    p = argparse.ArgumentParser(**bf.PARSER_OPTIONS)
    bf.add_args(p)
    add_output_args(p)
    assert all(a.help and a.help.strip() for a in p._actions)
    args = build_parser().parse_args(["fleet"])
    assert (args.workload, args.streams, args.decode_len, args.long_len, args.long_rate, args.duration) == \
        ("interference", 4, 128, 2048, 0.1, 120.0)
    assert (args.sessions, args.turns, args.concurrency, args.reply_len, args.no_session_header) == \
        (16, 6, 4, 32, False)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["fleet", "--base-url", "http://x", "--fleet", "f.yaml"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["fleet", "--long-rate", "-1"])


def test_completion_stream_accounting():
    r = fw.StreamReader(start=10.0, chat=False)
    chunks = [({"choices": [{"text": "a", "finish_reason": None}]}, 10.5),
              ({"choices": [{"text": "", "finish_reason": None}]}, 10.6),  # a token with no text yet counts
              ({"choices": [{"text": "b", "finish_reason": None}]}, 10.8),
              ({"choices": [{"text": "", "finish_reason": "length"}]}, 10.9),  # finish only: no token
              ({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3,
                                         "prompt_tokens_details": {"cached_tokens": 4}}}, 10.95)]
    for chunk, now in chunks:
        assert r.feed(chunk, now) is None
    t = r.result(11.0)
    assert t.ttft == pytest.approx(0.5) and t.e2el == pytest.approx(1.0)
    assert t.itl == pytest.approx([0.1, 0.2])
    assert (t.prompt_tokens, t.output_tokens, t.cached_tokens, t.text) == (7, 3, 4, "ab")
    assert t.tpot == pytest.approx((1.0 - 0.5) / 2)  # (E2E - TTFT) / (n - 1)
    assert t.prefill_interval == pytest.approx((10.0, 10.5)) and t.decode_interval == pytest.approx((10.5, 11.0))


def test_chat_stream_accounting_and_errors():
    r = fw.StreamReader(start=0.0, chat=True)
    r.feed({"choices": [{"delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}, 0.1)
    r.feed({"choices": [{"delta": {"content": "Hi"}, "finish_reason": None}]}, 0.3)
    r.feed({"choices": [{"delta": {"content": " there"}, "finish_reason": None}]}, 0.4)
    r.feed({"choices": [{"delta": {}, "finish_reason": "stop"}]}, 0.5)
    t = r.result(0.6, prompt_len=5)  # no usage: counts from the stream
    assert t.ttft == pytest.approx(0.3) and t.output_tokens == 2 and t.prompt_tokens == 5 and t.cached_tokens == 0
    assert t.text == "Hi there"
    assert fw.StreamReader(0.0, chat=True).result(1.0) == "the stream held no tokens"
    assert "error event" in fw.StreamReader(0.0, chat=False).feed({"error": {"message": "boom"}}, 1.0)


def test_tpot_of_one_token_is_none():
    assert _timing(0, 0.2, 0.2, 1).tpot is None
    assert _timing(0, 0.2, 1.2, 11).tpot == pytest.approx(0.1)


def test_poisson_arrivals():
    assert fw.poisson_arrivals(0.0, 100.0, np.random.default_rng(0)) == []
    times = fw.poisson_arrivals(2.0, 1000.0, np.random.default_rng(0))
    assert all(0 < a < b < 1000 for a, b in zip(times, times[1:]))
    assert abs(len(times) - 2000) < 150  # about rate * duration
    gaps = np.diff(times)
    assert gaps.mean() == pytest.approx(0.5, rel=0.1) and gaps.std() == pytest.approx(0.5, rel=0.15)  # exponential


def test_overlap_split():
    assert fw.overlaps((1, 2), [(1.5, 3)]) and fw.overlaps((1, 4), [(2, 3)]) and fw.overlaps((2, 3), [(1, 4)])
    assert not fw.overlaps((1, 2), [(2, 3)]) and not fw.overlaps((1, 2), [])
    assert not fw.overlaps((3, 4), [(0, 1), (5, 6)])
    longs = [_timing(start=5.0, ttft=2.0, e2el=3.0, n=16)]  # prefill 5..7
    d_hit = _timing(start=4.0, ttft=0.5, e2el=4.0, n=10)  # decodes 4.5..8
    d_before = _timing(start=0.0, ttft=0.5, e2el=4.9, n=10)  # decodes 0.5..4.9
    d_ttft_only = _timing(start=6.0, ttft=1.5, e2el=3.0, n=10)  # prefill 6..7.5 overlaps, decode 7.5..9 does not
    hit, clean = fw.split_by_overlap([d_hit, d_before, d_ttft_only], longs)
    assert hit == [d_hit] and clean == [d_before, d_ttft_only]


def test_class_summary_percentiles():
    timings = [_timing(0, ttft=0.1 * (i + 1), e2el=0.1 * (i + 1) + 1.0, n=11, itl=[0.1] * 10) for i in range(10)]
    row = fw.class_summary("decode", timings, failed=2, duration=10.0, percentiles=[50, 90, 99])
    assert (row["label"], row["completed"], row["failed"], row["output_tokens"]) == ("decode", 10, 2, 110)
    assert row["output_throughput"] == pytest.approx(11.0)
    assert row["p50_ttft_ms"] == pytest.approx(550.0) and row["p90_ttft_ms"] == pytest.approx(910.0)
    assert row["p99_ttft_ms"] == pytest.approx(991.0)
    assert row["p50_tpot_ms"] == pytest.approx(100.0) and row["p99_tpot_ms"] == pytest.approx(100.0)
    assert row["p90_itl_ms"] == pytest.approx(100.0)
    empty = fw.class_summary("long prompt", [], failed=0, duration=10.0, percentiles=[50, 90])
    assert empty["completed"] == 0 and empty["p50_ttft_ms"] is None and empty["output_throughput"] is None


def test_hit_ratio_accounting():
    turns = [fw.Turn(0, 0, _timing(0, 0.1, 0.5, 4, prompt=100, cached=0)),
             fw.Turn(0, 1, _timing(0, 0.1, 0.5, 4, prompt=200, cached=96)),
             fw.Turn(1, 0, _timing(0, 0.1, 0.5, 4, prompt=100, cached=32)),
             fw.Turn(1, 1, _timing(0, 0.1, 0.5, 4, prompt=300, cached=192))]
    assert fw.hit_ratio(turns) == pytest.approx(320 / 700)
    assert fw.hit_ratio([]) is None
    first, later, every = fw.multiturn_rows(turns, failed_first=1, failed_later=2, duration=1.0, percentiles=[50])
    assert (first["label"], first["completed"], first["failed"], first["cache_hit_ratio"]) == \
        ("first turns", 2, 1, pytest.approx(32 / 200))
    assert (later["completed"], later["failed"], later["cached_tokens"], later["cache_hit_ratio"]) == \
        (2, 2, 288, pytest.approx(288 / 500))
    assert (every["completed"], every["failed"], every["prompt_tokens"]) == (4, 3, 700)
    # Reusable: the previous turn's prompt and its 4 output tokens.
    assert fw.reusable_tokens(turns) == {(0, 1): 104, (1, 1): 104}
    assert (later["reusable_tokens"], later["reusable_hit_ratio"]) == (208, pytest.approx(288 / 208))
    assert first["reusable_tokens"] == 0 and first["reusable_hit_ratio"] is None


def test_user_message_length_and_variety():
    rng = np.random.default_rng(0)
    a, b = fw.user_message(rng, 100), fw.user_message(rng, 100)
    assert a != b and a.endswith(".") and a[0].isupper()
    assert 80 <= len(a.split()) <= 100


def test_worker_counters_from_metrics_text():
    page = """# HELP infire:prompt_tokens_total Prompt tokens of admitted sequences.
# TYPE infire:prompt_tokens_total counter
infire:prompt_tokens_total{model_name="m"} 120.0
# HELP infire:request_success_total Finished sequences, by finish reason.
# TYPE infire:request_success_total counter
infire:request_success_total{finished_reason="length",model_name="m"} 3.0
infire:request_success_total{finished_reason="stop",model_name="m"} 2.0
infire:request_success_created{finished_reason="stop",model_name="m"} 1.7e9
# TYPE infire:num_requests_running gauge
infire:num_requests_running{model_name="m"} 1.0
"""
    before = bf.parse_counters(page)
    assert before == {"infire:prompt_tokens_total": 120.0, "infire:request_success_total": 5.0}
    after = {"infire:prompt_tokens_total": 300.0, "infire:request_success_total": 9.0}
    deltas = bf.counter_deltas(before, after)
    assert deltas["prompt_tokens"] == 180.0 and deltas["requests"] == 4.0 and deltas["prefix_cache_hits"] == 0.0
    assert set(bf.counter_deltas(None, after).values()) == {None}  # the worker did not answer
    assert set(bf.counter_deltas(before, None).values()) == {None}


# ---- both workloads against a fake router -------------------------------------------------------------

class FakeRouter:
    """Streams 'x' tokens; a chat request's cached_tokens is the prompt_tokens of the previous request
    of the same x-session-affinity session (0 without the header)."""

    def __init__(self):
        self.last_prompt: dict[str, int] = {}
        self.requests: list[tuple[str, dict, str | None]] = []
        self.loop = asyncio.new_event_loop()
        self.url = ""
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait(10)

    def _run(self, ready):
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        ready.set()
        self.loop.run_forever()

    async def _models(self, request):
        return web.json_response({"data": [{"id": "fake"}]})

    async def _complete(self, request):
        body = await request.json()
        chat = request.path.endswith("/chat/completions")
        session = request.headers.get(fw.SESSION_HEADER)
        self.requests.append((request.path, body, session))
        if chat:
            prompt = sum(len(m["content"].split()) for m in body["messages"])
            cached = self.last_prompt.get(session, 0) if session else 0
            if session:
                self.last_prompt[session] = prompt
        else:
            prompt, cached = len(body["prompt"]), 0
        n = body["max_tokens"]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(obj):
            await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

        if chat:
            await send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                     "finish_reason": None}]})
        await asyncio.sleep(0.02 if prompt > 500 else 0.002)  # "prefill"
        for _ in range(n):
            await send({"choices": [{"index": 0, "delta": {"content": " x"}, "finish_reason": None}]} if chat else
                       {"choices": [{"index": 0, "text": " x", "finish_reason": None}]})
            await asyncio.sleep(0.001)
        await send({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]} if chat else
                   {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
        await send({"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": n,
                                             "prompt_tokens_details": {"cached_tokens": cached}}})
        await resp.write(b"data: [DONE]\n\n")
        return resp

    def close(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def fake_router():
    r = FakeRouter()
    yield r
    r.close()


def test_interference_against_fake_router(fake_router, tmp_path):
    args = build_parser().parse_args([
        "fleet", "--base-url", fake_router.url, "--streams", "2", "--decode-len", "8", "--prompt-len", "16",
        "--long-len", "600", "--long-rate", "20", "--duration", "0.5", "--label", "fake"])
    result = bf.run(args)
    decode, hit, clean, long = result.payload["results"]
    assert [r["label"] for r in (decode, hit, clean, long)] == [
        "decode", "decode, overlapping a long prefill", "decode, no long prefill", "long prompt"]
    assert decode["completed"] >= 4 and decode["failed"] == 0 and long["completed"] >= 1
    assert hit["completed"] + clean["completed"] == decode["completed"]
    assert decode["output_tokens"] == 8 * decode["completed"] and decode["p50_tpot_ms"] > 0
    assert long["prompt_tokens"] == 600 * long["completed"]
    sent = [b for path, b, _ in fake_router.requests if path == "/v1/completions"]
    assert all(b["ignore_eos"] and b["temperature"] == 0 and b["stream"] for b in sent)
    assert all(100 <= t < 40000 for b in sent for t in b["prompt"])
    assert result.title.startswith("fleet interference: fake (fake)")
    assert "decode, no long prefill" in result.table and "p90 TPOT" in result.table


@pytest.mark.parametrize("header", [True, False])
def test_multiturn_against_fake_router(fake_router, header):
    argv = ["fleet", "--workload", "multiturn", "--base-url", fake_router.url, "--sessions", "3", "--turns", "3",
            "--reply-len", "4", "--user-len", "20", "--concurrency", "2", "--num-warmups", "0"]
    result = bf.run(build_parser().parse_args(argv + ([] if header else ["--no-session-header"])))
    first, later, every = result.payload["results"]
    assert (first["completed"], later["completed"], every["completed"], every["failed"]) == (3, 6, 9, 0)
    chats = [(b, s) for path, b, s in fake_router.requests if path == "/v1/chat/completions"]
    assert len(chats) == 9
    assert {s for _, s in chats} == ({"session-0", "session-1", "session-2"} if header else {None})
    # each turn sends the whole history: user, assistant, user, ...
    assert sorted(len(b["messages"]) for b, _ in chats) == [1, 1, 1, 3, 3, 3, 5, 5, 5]
    assert all(b["messages"][1]["content"] == " x x x x" for b, _ in chats if len(b["messages"]) > 1)
    if header:
        assert first["cache_hit_ratio"] == 0 and later["cache_hit_ratio"] > 0.3
        assert later["cached_tokens"] == every["cached_tokens"]
        assert "router at" in result.title and "; x-session-affinity header" in result.title
        assert "hit ratio" in result.title
    else:
        assert every["cache_hit_ratio"] == 0 and "; no x-session-affinity header" in result.title


def test_no_router_is_a_bench_error():
    args = build_parser().parse_args(["fleet", "--base-url", "http://127.0.0.1:9", "--duration", "0.2"])
    with pytest.raises(BenchError, match="cannot list the models"):
        bf.run(args)
