"""The service's Prometheus metrics (prometheus_client, in a registry of its own).

Counted here as requests pass: requests by route and status, request latency, sequences
started/finished/failed/cancelled, generated tokens, server-call latency per server and
route. Read at each scrape: from the coordinator tokens/s, mean alpha, step latency percentiles;
from the service active and queued sequences and its live asyncio tasks.
"""

from __future__ import annotations

import asyncio
from typing import Any
from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from dualvllm.coordinator.core import DualVLLMCoordinator
from dualvllm.coordinator.outputs import GenerationOutput
from dualvllm.service.jobs import RequestQueue

# Request latency buckets (s): a q* request runs from a few ms (one token) to minutes.
REQUEST_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# Server-call buckets (s): a per-token step call takes ms; a lockstep request lasts a sequence.
SERVER_CALL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10, 60)


class ServiceMetrics:
    def __init__(self, coordinator: DualVLLMCoordinator, admission: RequestQueue) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._requests = Counter(
            "dualvllm_requests", "HTTP requests answered, by route and status", ("route", "status"), registry=r
        )
        self._request_s = Histogram(
            "dualvllm_request_seconds",
            "HTTP request latency, by route",
            ("route",),
            buckets=REQUEST_BUCKETS_S,
            registry=r,
        )
        self._sequences = Counter(
            "dualvllm_sequences",
            "Sequences by outcome: started, finished, failed, cancelled (the client left)",
            ("outcome",),
            registry=r,
        )
        self._tokens = Counter("dualvllm_generated_tokens", "Tokens generated for finished sequences", registry=r)
        self._server_s = Histogram(
            "dualvllm_server_call_seconds",
            "Requests to the model servers (retries included), by server and route",
            ("server", "route"),
            buckets=SERVER_CALL_BUCKETS_S,
            registry=r,
        )
        self._server_failures = Counter(
            "dualvllm_server_call_failures",
            "Requests to the model servers that failed after their retries",
            ("server", "route"),
            registry=r,
        )
        r.register(_CoordinatorCollector(coordinator, admission))

    def request_done(self, route: str, status: int, seconds: float) -> None:
        """`route`: one of the service's routes, or "other" (the labels stay a bounded set)."""
        self._requests.labels(route, str(status)).inc()
        self._request_s.labels(route).observe(seconds)

    def server_call(self, server: str, route: str, seconds: float, ok: bool) -> None:
        self._server_s.labels(server, route).observe(seconds)
        if not ok:
            self._server_failures.labels(server, route).inc()

    def sequences_started(self, count: int) -> None:
        self._sequences.labels("started").inc(count)

    def sequence_done(self, output: GenerationOutput) -> None:
        self._sequences.labels("failed" if output.error else "finished").inc()
        self._tokens.inc(len(output.generated_tokens))

    def cancelled(self, count: int) -> None:
        """Sequences whose request ended (the client left, another choice failed) before them."""
        if count:
            self._sequences.labels("cancelled").inc(count)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _CoordinatorCollector(Collector):
    """Gauges read from the coordinator and the service's queue at scrape time."""

    def __init__(self, coordinator: DualVLLMCoordinator, admission: RequestQueue) -> None:
        self._coordinator = coordinator
        self._admission = admission

    def collect(self) -> Iterator[Any]:
        stats = self._coordinator.get_statistics()
        gauges = {
            "dualvllm_tokens_per_second": ("Tokens sampled per second of coordinator work", stats["tokens_per_s"]),
            "dualvllm_alpha_mean": ("Mean alpha of every token sampled so far", stats["mean_alpha"]),
            "dualvllm_step_latency_p50_seconds": (
                "Median coordinator step, recent steps",
                stats["step_latency_p50_ms"] / 1e3,
            ),
            "dualvllm_step_latency_p95_seconds": (
                "95th percentile coordinator step, recent steps",
                stats["step_latency_p95_ms"] / 1e3,
            ),
            "dualvllm_coordinator_tokens": ("Tokens sampled by the coordinator (every caller)", stats["tokens"]),
            "dualvllm_coordinator_sequences_failed": (
                "Sequences the coordinator failed (every caller)",
                stats["sequences_failed"],
            ),
            "dualvllm_server_retries": ("Requests to the model servers that were retried", stats["retries"]),
            # Tasks of handlers, streams and the coordinator: a leak shows as growth at rest.
            "dualvllm_asyncio_tasks": ("Live asyncio tasks in the service's event loop", len(asyncio.all_tasks())),
            "dualvllm_active_sequences": ("Sequences in the running batch", self._admission.running),
            "dualvllm_queued_sequences": (
                "Sequences waiting for the running batch",
                self._admission.sequences - self._admission.running,
            ),
        }
        for name, (text, value) in gauges.items():
            yield GaugeMetricFamily(name, text, value=value)
