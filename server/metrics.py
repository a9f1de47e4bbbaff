"""Prometheus metrics of one server: vLLM's metric names under an `infire:` prefix.

Latency histograms are observed on the event loop as deltas arrive (each model's AsyncEngine has a
LatencyObserver). Engine gauges and counters are read at scrape time from the snapshot the engine
thread publishes after every step, so a scrape never touches the engine itself.
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from infire_jax.engine.async_engine import EngineSnapshot
from infire_jax.runner.kv_pool import PoolSizing
from infire_jax.engine.residency import Residency
from infire_jax.speculative.controller import SpecStats

PREFIX = "infire:"
# Gauges also published under vLLM's own names, as autoscalers and inference gateways read them (KEDA
# rules, the Gateway API inference extension's endpoint picker): they mean what vLLM's mean.
VLLM_GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)


class _EngineCollector(Collector):
    """Each model's engine counters, from the snapshots its engine thread publishes."""

    def __init__(self):
        self._models: list[tuple[str, Callable[[], EngineSnapshot], PoolSizing | None]] = []

    def add(self, model_name: str, snapshot: Callable[[], EngineSnapshot], pool: PoolSizing | None) -> None:
        self._models.append((model_name, snapshot, pool))

    @staticmethod
    def _pool_gauges(p: PoolSizing | None) -> list[tuple]:
        """The KV pool's size and the arithmetic that chose it (fixed at start-up)."""
        if p is None:
            return []
        return [(GaugeMetricFamily, name, doc, value) for name, doc, value in (
            ("kv_pool_pages", "Pages in the KV pool (one is the null page).", p.num_pages),
            ("kv_pool_bytes", "Bytes of the KV pool on one device.", p.pool_bytes),
            ("kv_pool_page_bytes", "Bytes of one KV page on one device.", p.page_bytes),
            ("kv_pool_device_memory_bytes", "One device's memory (0 where the pool has a fixed budget).",
             p.device_bytes),
            ("kv_pool_gpu_memory_utilization", "The fraction of device memory the engine may use.", p.utilization),
            ("kv_pool_weight_bytes", "Weights on one device, as counted when sizing the pool.", p.weight_bytes),
            ("kv_pool_activation_bytes", "The largest step's activation peak on one device (XLA's analysis).",
             p.activation_bytes),
        )]

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for model, snapshot, pool in self._models:
            snap = snapshot()
            for cls, name, doc, value in (*self._pool_gauges(pool), *self._engine_values(snap)):
                for full in (PREFIX + name, *(("vllm:" + name,) if name in VLLM_GAUGES else ())):
                    if full not in families:
                        families[full] = cls(full, doc, labels=["model_name"])
                    families[full].add_metric([model], value)
            if snap.spec is not None:
                self._spec_values(families, model, snap.spec)
            if pool is not None and pool.capacity is not None:
                self._group_values(families, model, snap, pool)
        yield from families.values()

    @staticmethod
    def _group_values(families: dict[str, Metric], model: str, snap: EngineSnapshot, pool: PoolSizing) -> None:
        """Pages in use per group of layers (a hybrid KV cache's groups; one group for other models), and
        the tokens of context the pool holds for 1, 8 and 64 sequences (+Inf: any length)."""
        cap = pool.capacity
        name = "kv_cache_group_pages_in_use"
        if name not in families:
            families[name] = GaugeMetricFamily(
                PREFIX + name, "KV pages held by requests, per group of layers (hybrid KV cache).",
                labels=["model_name", "group", "kind"])
        for g, (group, pages) in enumerate(zip(cap.groups.groups, snap.kv_group_pages)):
            families[name].add_metric([model, str(g), group.kind], pages)
        name = "kv_pool_context_tokens"
        if name not in families:
            families[name] = GaugeMetricFamily(
                PREFIX + name, "Tokens of context each of `sequences` sequences can hold at once in the KV "
                "pool (+Inf: any length, every layer being chunked or windowed).", labels=["model_name", "sequences"])
        for n in cap.SEQUENCES:
            tokens = cap.context_tokens(n)
            families[name].add_metric([model, str(n)], float("inf") if tokens is None else tokens)

    @staticmethod
    def _spec_values(families: dict[str, Metric], model: str, s: SpecStats) -> None:
        """Speculative decoding, under vLLM's names (with our prefix)."""
        for name, doc, value in (
                ("spec_decode_num_drafts", "Verifying steps of a sequence with proposed tokens.", s.num_drafts),
                ("spec_decode_num_draft_tokens", "Proposed tokens.", s.num_draft_tokens),
                ("spec_decode_num_accepted_tokens", "Proposed tokens accepted.", s.num_accepted_tokens)):
            if name not in families:
                families[name] = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            families[name].add_metric([model], value)
        name = "spec_decode_num_accepted_tokens_per_pos"
        if name not in families:
            families[name] = CounterMetricFamily(PREFIX + name, "Proposed tokens accepted, by position in the proposal.",
                                                 labels=["model_name", "position"])
        for pos, value in enumerate(s.accepted_per_pos):
            families[name].add_metric([model, str(pos)], value)

    @staticmethod
    def _engine_values(s: EngineSnapshot) -> tuple[tuple, ...]:
        return (
            (GaugeMetricFamily, "num_requests_running", "Sequences in the running batch.", s.num_running),
            (GaugeMetricFamily, "num_requests_waiting", "Sequences waiting to be scheduled.", s.num_waiting),
            (GaugeMetricFamily, "kv_cache_usage_perc", "Fraction of KV pages held by requests (1 = full).",
             s.kv_usage),
            (GaugeMetricFamily, "compiles_since_warmup", "XLA compilations after warmup (should stay 0).",
             s.compiles_since_warmup),
            (CounterMetricFamily, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             s.prefix_queries),
            (CounterMetricFamily, "prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_hits),
            (CounterMetricFamily, "num_preemptions", "Sequences preempted (recomputed later).", s.num_preemptions),
            (CounterMetricFamily, "prompt_tokens", "Prompt tokens of admitted sequences.", s.prompt_tokens),
            (CounterMetricFamily, "generation_tokens", "Generated tokens.", s.generation_tokens),
            (CounterMetricFamily, "images_encoded", "Images through the vision tower (one whose tokens were cached, "
             "or imported from a prefill worker, is not encoded).", s.images_encoded),
            (CounterMetricFamily, "engine_step_seconds", "Wall time of the engine thread inside steps.",
             s.step_seconds),
            (CounterMetricFamily, "engine_device_wait_seconds",
             "Part of the step time blocked on the device's results (the rest is host work).",
             s.device_wait_seconds),
            (CounterMetricFamily, "grammar_seconds",
             "Host time in the grammar engine (structured outputs: filling token masks, advancing matchers).",
             s.grammar_seconds),
        )


class _ResidencyCollector(Collector):
    """Hot standby: which models are on the device, and what their promotions cost."""

    def __init__(self, residency: Residency, host_to_device_bytes_per_second: float):
        self._residency = residency
        self._bandwidth = host_to_device_bytes_per_second

    def collect(self) -> Iterator[Metric]:
        r = self._residency
        bandwidth = GaugeMetricFamily(PREFIX + "host_to_device_bytes_per_second",
                                      "Measured host-to-device copy speed at start (the floor of a promotion).")
        bandwidth.add_metric([], self._bandwidth)
        yield bandwidth
        for cls, name, doc, value in (
            (GaugeMetricFamily, "model_resident", "1 if the model's weights are on the device.",
             lambda n: float(r.is_resident(n))),
            (CounterMetricFamily, "model_swaps", "Promotions of the model onto the device.",
             lambda n: r.stats[n].promotions),
            (CounterMetricFamily, "model_swap_seconds", "Wall time of those promotions (demotions included).",
             lambda n: r.stats[n].seconds),
            (CounterMetricFamily, "model_swap_bytes", "Weight bytes copied to the device by those promotions.",
             lambda n: r.stats[n].bytes),
        ):
            family = cls(PREFIX + name, doc, labels=["model_name"])
            for model in r.engines:
                family.add_metric([model], value(model))
            yield family


class _ModelObserver:
    """The LatencyObserver of one model's engine."""

    def __init__(self, metrics: ServerMetrics, model_name: str):
        self._ttft = metrics._ttft.labels(model_name)
        self._itl = metrics._itl.labels(model_name)
        self._e2e = metrics._e2e.labels(model_name)
        self._success = metrics._success
        self._model = model_name

    def first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def inter_token(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def finished(self, seconds: float, reason: str) -> None:
        self._e2e.observe(seconds)
        self._success.labels(self._model, reason).inc()


class ServerMetrics:
    """The registry of one app. KV-transfer metrics carry the first model's name (fleet workers
    serve one model)."""

    def __init__(self, model_names: Sequence[str]):
        self.model_name = model_names[0]
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]):
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)

        self._ttft = histogram("time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self._itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens.", _ITL_BUCKETS)
        self._e2e = histogram("e2e_request_latency_seconds", "Arrival to last token, per sequence.", _E2E_BUCKETS)
        self._success = Counter(PREFIX + "request_success", "Finished sequences, by finish reason.",
                                labels + ["finished_reason"], registry=self.registry)
        self._kv_bytes = Counter(PREFIX + "kv_transfer_received_bytes", "KV bytes fetched from prefill workers.",
                                 labels, registry=self.registry).labels(self.model_name)
        self._kv_seconds = Counter(PREFIX + "kv_transfer_received_seconds", "Time spent in those fetches.",
                                   labels, registry=self.registry).labels(self.model_name)
        self._kv_failures = Counter(PREFIX + "kv_transfer_failures",
                                    "KV transfers that failed (the prompt was computed locally), by reason.",
                                    labels + ["reason"], registry=self.registry)
        self._engines = _EngineCollector()
        self.registry.register(self._engines)

    def observer(self, model_name: str) -> _ModelObserver:
        return _ModelObserver(self, model_name)

    def track_engine(self, model_name: str, snapshot: Callable[[], EngineSnapshot],
                     pool: PoolSizing | None = None) -> None:
        self._engines.add(model_name, snapshot, pool)

    def track_residency(self, residency: Residency, host_to_device_bytes_per_second: float) -> None:
        self.registry.register(_ResidencyCollector(residency, host_to_device_bytes_per_second))

    def track_holds(self, holds: Callable[[], int], free_bytes: Callable[[], int]) -> None:
        """A prefill or decode worker's live KV holds and its staging buffer's room, read at scrape time."""
        Gauge(PREFIX + "kv_transfer_holds", "KV regions held for decode workers to fetch.", ["model_name"],
              registry=self.registry).labels(self.model_name).set_function(holds)
        Gauge(PREFIX + "kv_transfer_buffer_free_bytes", "Free bytes of the KV staging buffer (not held for a "
              "decode worker, nor being fetched into).", ["model_name"],
              registry=self.registry).labels(self.model_name).set_function(free_bytes)

    def kv_transferred(self, nbytes: int, seconds: float) -> None:
        self._kv_bytes.inc(nbytes)
        self._kv_seconds.inc(seconds)

    def kv_transfer_failed(self, reason: str) -> None:
        self._kv_failures.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def release(self) -> None:
        """Drops the collectors and gauges that read the engines (the server has stopped)."""
        self.registry = CollectorRegistry()
        self._engines = _EngineCollector()
