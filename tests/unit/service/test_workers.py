"""`dualvllm serve --workers`: what each worker is told, and what is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dualvllm.common.errors import InvalidInputError, ServerStartupError
from dualvllm.coordinator.config import CoordinatorConfig
from dualvllm.service.config import ServiceConfig
from dualvllm.service.worker_metrics import WorkerPlace
from dualvllm.service.workers import _spec, started_workers, worker_seed


def test_worker_0_keeps_the_seed_and_the_others_draw_their_own():
    seeds = [worker_seed(0, i) for i in range(4)]
    assert seeds[0] == 0 and len(set(seeds)) == 4  # no two workers' first calls sample alike
    assert seeds == [worker_seed(0, i) for i in range(4)]  # and a restart draws the same again
    assert worker_seed(None, 3) is None  # fresh entropy stays fresh


def test_a_worker_is_told_both_configs_as_given_with_secrets_and_the_bound_port(monkeypatch):
    monkeypatch.delenv("DUALVLLM_API_KEY", raising=False)
    coordinator = CoordinatorConfig(theta_urls=("http://127.0.0.1:9000",), t_urls=("http://127.0.0.1:9001",),
                                    api_key="server-secret", top_k=10)
    service = ServiceConfig(service_port=0, api_key="client-secret", workers=3)
    place = WorkerPlace(0, 3, Path("/tmp/dualvllm-metrics-x"))
    spec = json.loads(_spec(coordinator, service, index=2, place=place, port=43210))
    # Rebuilt in the worker, they equal the parent's (but the seed and the port).
    rebuilt = CoordinatorConfig(**spec["coordinator"])
    assert rebuilt.api_key is not None and rebuilt.api_key.get_secret_value() == "server-secret"
    assert (rebuilt.theta_urls, rebuilt.t_urls, rebuilt.top_k) == (coordinator.theta_urls, coordinator.t_urls, 10)
    assert rebuilt.seed == worker_seed(0, 2) != 0
    served = ServiceConfig(**spec["service"])
    assert served.api_key is not None and served.api_key.get_secret_value() == "client-secret"
    assert (served.service_port, served.workers, spec["index"], spec["count"]) == (43210, 3, 2, 3)
    assert spec["metrics_dir"] == "/tmp/dualvllm-metrics-x"


def test_dev_mode_takes_one_worker():
    with pytest.raises(InvalidInputError, match="dev_mode with workers=2: a weight push through one worker"):
        ServiceConfig(dev_mode=True, workers=2)
    with pytest.raises(InvalidInputError, match="workers"):
        ServiceConfig(workers=0)


async def test_a_worker_that_cannot_start_fails_with_its_log(tmp_path, unused_tcp_port_factory):
    # Nothing listens where its servers should be: its coordinator's start-up check fails.
    nowhere, endpoint = unused_tcp_port_factory(), unused_tcp_port_factory()
    coordinator = CoordinatorConfig(theta_url=f"http://127.0.0.1:{nowhere}", t_url=f"http://127.0.0.1:{nowhere}",
                                    max_retries=0)
    service = ServiceConfig(service_port=0, workers=2)
    with pytest.raises(ServerStartupError, match=r"endpoint worker 1 exited with status 2; its log .*worker-1\.log"
                       r"(.|\n)*dualvllm endpoint worker 1: error: \[theta http://127\.0\.0\.1:\d+/health\] cannot connect"):
        async with started_workers(coordinator, service, count=2, port=endpoint, log_dir=tmp_path):
            pytest.fail("a worker without servers listened")
