"""/metrics of an endpoint served by several workers (`dualvllm serve --workers N`): every
worker's series, whichever worker the scrape reaches.

The kernel hands a scrape's connection to one worker, so each worker also serves its own
metrics on a private Unix socket (`<dir>/worker-<i>.sock`, in a directory that `serve` creates
for this user alone and removes at exit). The scraped worker asks the others there and answers
every worker's series, each labelled worker="<i>": `sum without (worker) (...)` in PromQL is
the endpoint's total. A worker that does not answer within PEER_TIMEOUT_S is left out, and
`dualvllm_workers_scraped` says how many did answer, against `dualvllm_workers`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Metric, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

PEER_TIMEOUT_S = 2.0  # a worker busy for longer than this is left out of one scrape
WORKER_LABEL = "worker"

Render = Callable[[], tuple[bytes, str]]


@dataclass(frozen=True)
class WorkerPlace:
    """This process is worker `index` of `count` serving one endpoint; `metrics_dir` holds the
    workers' private metrics sockets."""

    index: int
    count: int
    metrics_dir: Path

    @property
    def name(self) -> str:
        return f"{self.index}/{self.count}"

    def socket_path(self, index: int) -> Path:
        return self.metrics_dir / f"worker-{index}.sock"


async def serve_own(place: WorkerPlace, render: Render) -> web.AppRunner:
    """Serve this worker's own metrics on its private socket (cleaned up by the caller)."""

    async def own(request: web.Request) -> web.Response:
        body, content_type = render()
        return web.Response(body=body, headers={"Content-Type": content_type})

    app = web.Application()
    app.router.add_get("/metrics", own)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.UnixSite(runner, str(place.socket_path(place.index))).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner


async def every_worker(place: WorkerPlace, render: Render) -> tuple[bytes, str]:
    """The Prometheus text of every worker that answers, labelled by worker."""
    texts = {place.index: render()[0].decode()}
    others = [i for i in range(place.count) if i != place.index]
    answers = await asyncio.gather(*(_peer(place.socket_path(i)) for i in others))
    texts.update({i: text for i, text in zip(others, answers) if text is not None})
    return merge(texts, count=place.count), CONTENT_TYPE_LATEST


async def _peer(path: Path) -> str | None:
    """A worker's own metrics, or None if it does not answer in time (busy, or exiting)."""
    timeout = aiohttp.ClientTimeout(total=PEER_TIMEOUT_S)
    connector = aiohttp.UnixConnector(path=str(path))
    try:
        async with (
            aiohttp.ClientSession(connector=connector, timeout=timeout) as session,
            session.get("http://worker/metrics") as response,
        ):
            response.raise_for_status()
            return await response.text()
    except (TimeoutError, aiohttp.ClientError, OSError):
        return None


def merge(texts: dict[int, str], *, count: int) -> bytes:
    """One exposition of every worker's families (`texts`: worker index -> its Prometheus text),
    each sample labelled with its worker, plus how many workers answered of `count`."""
    families: dict[str, Metric] = {}
    for index, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                merged.add_sample(
                    sample.name,
                    {**sample.labels, WORKER_LABEL: str(index)},
                    sample.value,
                    sample.timestamp,
                    sample.exemplar,
                )
    registry = CollectorRegistry()
    registry.register(_Families([*families.values(), *_workers_answered(len(texts), count)]))
    return generate_latest(registry)


def _workers_answered(answered: int, count: int) -> list[Metric]:
    return [
        GaugeMetricFamily("dualvllm_workers", "Worker processes serving this endpoint", value=count),
        GaugeMetricFamily("dualvllm_workers_scraped", "Workers whose metrics this scrape holds", value=answered),
    ]


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)
