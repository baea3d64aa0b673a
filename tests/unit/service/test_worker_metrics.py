"""/metrics with several workers (dualvllm.service.worker_metrics): every worker's series, whichever
worker is scraped, over the workers' private sockets."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dualvllm.service.worker_metrics import WorkerPlace, every_worker, merge, serve_own


def worker_text(requests: int, active: float) -> str:
    registry = CollectorRegistry()
    Counter("dualvllm_requests", "HTTP requests", ("route",), registry=registry).labels("completions").inc(requests)
    Histogram("dualvllm_request_seconds", "latency", buckets=(0.1, 1), registry=registry).observe(0.5)
    Gauge("dualvllm_active_sequences", "running", registry=registry).set(active)
    return generate_latest(registry).decode()


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text.decode()) for s in family.samples}


def test_every_workers_series_is_labelled_with_its_worker_and_each_family_is_named_once():
    text = merge({0: worker_text(3, 2), 1: worker_text(5, 7)}, count=3)
    got = samples(text)
    assert got[("dualvllm_requests_total", (("route", "completions"), ("worker", "0")))] == 3
    assert got[("dualvllm_requests_total", (("route", "completions"), ("worker", "1")))] == 5
    assert got[("dualvllm_active_sequences", (("worker", "1"),))] == 7
    assert got[("dualvllm_request_seconds_bucket", (("le", "1.0"), ("worker", "0")))] == 1
    assert got[("dualvllm_workers", ())] == 3 and got[("dualvllm_workers_scraped", ())] == 2
    assert text.decode().count("# TYPE dualvllm_requests_total counter") == 1


async def test_a_scraped_worker_asks_the_others_and_leaves_out_one_that_is_gone(tmp_path):
    places = [WorkerPlace(i, 3, tmp_path) for i in range(3)]
    renders = [lambda i=i: (worker_text(10 * (i + 1), i).encode(), "text/plain") for i in range(3)]
    runners = [await serve_own(places[i], renders[i]) for i in (0, 1)]  # worker 2 never listens
    try:
        body, _ = await asyncio.wait_for(every_worker(places[1], renders[1]), 10)
    finally:
        for runner in runners:
            await runner.cleanup()
    got = samples(body)
    requests = {dict(labels)["worker"]: value for (name, labels), value in got.items() if name == "dualvllm_requests_total"}
    assert requests == {"0": 10, "1": 20}
    assert got[("dualvllm_workers_scraped", ())] == 2 and got[("dualvllm_workers", ())] == 3
