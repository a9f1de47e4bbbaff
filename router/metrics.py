"""Prometheus metrics of the router, under an `infire_router:` prefix, on a registry of its own.

Counters are counted as requests go; worker health and requests in flight are read from the
workers at scrape time.
"""

from __future__ import annotations

from typing import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.workers import Worker

PREFIX = "infire_router:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _WorkerCollector(Collector):
    def __init__(self, workers: Sequence[Worker]):
        self._workers = workers

    def collect(self) -> Iterator[Metric]:
        healthy = GaugeMetricFamily(PREFIX + "worker_healthy", "1 while the worker takes traffic.", labels=["worker"])
        in_flight = GaugeMetricFamily(PREFIX + "in_flight", "Requests sent to the worker and not finished.",
                                      labels=["worker"])
        for w in self._workers:
            healthy.add_metric([w.url], float(w.healthy))
            in_flight.add_metric([w.url], w.in_flight)
        yield healthy
        yield in_flight


class RouterMetrics:
    def __init__(self, workers: Sequence[Worker]):
        self.registry = CollectorRegistry()

        def counter(name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=self.registry)

        self._requests = counter("requests", "Requests sent to a worker, by the role it played.", ["worker", "role"])
        self._errors = counter("request_errors", "Requests a worker failed (connection_lost, timeout, worker_down, "
                                                 "http_5xx) or no worker could take (no_healthy_worker).",
                               ["worker", "code"])
        self._affinity = counter("affinity_requests", "Requests with a session (x-session-affinity).")
        self._affinity_hits = counter("affinity_hits", "Session requests sent to the session's previous worker.")
        self._disaggregated = counter("disaggregated_requests", "Requests prefilled on a prefill worker.")
        self._kv_bytes = counter("kv_transfer_bytes", "KV bytes decode workers imported (x-infire-kv-bytes).")
        self._kv_seconds = counter("kv_transfer_seconds", "Seconds decode workers spent importing KV "
                                                          "(x-infire-kv-seconds).")
        self._holds_released = counter("kv_holds_released", "KV holds the router released on a prefill worker "
                                                            "because the decode worker did not import them.")
        for w in workers:  # every series exists from the start, at 0
            self._requests.labels(w.url, w.role)
        self.registry.register(_WorkerCollector(workers))

    def request(self, worker: Worker, role: str) -> None:
        self._requests.labels(worker.url, role).inc()

    def error(self, worker: str, code: str) -> None:
        self._errors.labels(worker, code).inc()

    def affinity(self, hit: bool) -> None:
        self._affinity.inc()
        if hit:
            self._affinity_hits.inc()

    def disaggregated(self) -> None:
        self._disaggregated.inc()

    def kv_transfer(self, num_bytes: float, seconds: float) -> None:
        self._kv_bytes.inc(num_bytes)
        self._kv_seconds.inc(seconds)

    def hold_released(self) -> None:
        self._holds_released.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
