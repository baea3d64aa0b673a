"""More than one core for the q* endpoint: `dualvllm serve --workers N`.

One coordinator process decides q* tokens on one core: 123,000 tokens per CPU-second at batch
256 on this project's 2-core AMD EPYC (benchmarks/coordinator_capacity.py). A GPU node whose
pairs decode more than that needs more coordinator processes. Each worker here is one: its own
coordinator on the same servers (its own lockstep channel: the plugin answers each request's
coordinator on that coordinator's own connection), behind the one endpoint. Every worker binds
the endpoint's port with SO_REUSEPORT and the kernel spreads connections over them by their
address, so one API (and one URL) serves from N processes, as a pre-forked web server does.

What each worker keeps to itself: its sequences, its batch (`--max-batch-size` is per worker:
the servers see up to N times it), its /v1/statistics. /metrics, on any worker, holds every
worker's series, labelled by worker (dualvllm.service.worker_metrics). A request's tokens never
cross workers. Weight pushes through the dev-mode routes would pause one worker's sequences
and not the others', so `--dev-mode` takes one worker (ServiceConfig refuses both).

Worker 0 is the `dualvllm serve` process itself; workers 1..N-1 are started here, with their
configs on stdin (secrets included: never in argv or the environment), log to
`<log dir>/worker-<i>.log`, die with the parent (PR_SET_PDEATHSIG), and are stopped with
SIGTERM, then SIGKILL, on every way out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import SecretStr

from dualvllm.common.errors import DualVLLMError, ServerStartupError
from dualvllm.common.process import log_tail
from dualvllm.coordinator.config import CoordinatorConfig
from dualvllm.service.config import ServiceConfig
from dualvllm.service.worker_metrics import WorkerPlace

log = logging.getLogger(__name__)

# A worker's start: its coordinator checks both servers, loads the tokenizers and the compiled
# step (seconds on CPU; a first compile of the kernel takes about a minute).
WORKER_START_S = 300.0
WORKER_STOP_S = 30.0  # SIGTERM's grace: the coordinator's own close is bounded below this
READY = b"ready\n"  # what a worker writes on its ready pipe once it listens
LOG_TAIL_LINES = 40  # of a worker's log, in the error when it exits


@dataclass
class Worker:
    index: int
    process: subprocess.Popen[bytes]
    log_path: Path

    def exit_problem(self) -> str | None:
        """Why this worker is gone (None: it runs)."""
        code = self.process.poll()
        if code is None:
            return None
        return f"endpoint worker {self.index} exited with status {code}; its log {self.log_path}:\n{log_tail(self.log_path, LOG_TAIL_LINES)}"


def worker_seed(seed: int | None, index: int) -> int | None:
    """Worker `index`'s coordinator seed: the user's for worker 0, and one derived from it for the
    others, so that two workers' first calls do not draw the same samples (None stays fresh entropy)."""
    if seed is None or index == 0:
        return seed
    return int(np.random.SeedSequence([seed, index]).generate_state(1, np.uint64)[0] >> 1)


def _spec(coordinator: CoordinatorConfig, service: ServiceConfig, index: int, place: WorkerPlace, port: int) -> bytes:
    """What a worker is told, on its stdin: both configs as given (secrets revealed), its place."""

    def given(config: CoordinatorConfig | ServiceConfig) -> dict[str, Any]:
        fields = config.model_dump(include=config.model_fields_set)
        return {k: v.get_secret_value() if isinstance(v, SecretStr) else v for k, v in fields.items()}

    coordinator_fields = given(coordinator) | {"seed": worker_seed(coordinator.seed, index)}
    service_fields = given(service) | {"service_port": port}
    return json.dumps(
        {
            "coordinator": coordinator_fields,
            "service": service_fields,
            "index": index,
            "count": place.count,
            "metrics_dir": str(place.metrics_dir),
            "parent": os.getpid(),
        }
    ).encode()


@contextlib.asynccontextmanager
async def started_workers(
    coordinator: CoordinatorConfig, service: ServiceConfig, *, count: int, port: int, log_dir: Path
) -> AsyncIterator[tuple[list[Worker], WorkerPlace]]:
    """Workers 1..count-1 of an endpoint on `port`, each listening when this yields, and this
    process's place among them (worker 0); stopped on exit, and their metrics sockets' directory
    (this user's alone) removed."""
    workers: list[Worker] = []
    abandon = threading.Event()  # a start still waiting (Ctrl-C during start-up) stops its worker
    place = WorkerPlace(0, count, Path(tempfile.mkdtemp(prefix="dualvllm-metrics-")))
    try:
        for index in range(1, count):
            workers.append(await asyncio.to_thread(_start, coordinator, service, index, place, port, log_dir, abandon))
        yield workers, place
    finally:
        abandon.set()
        await asyncio.to_thread(_stop_all, workers)
        shutil.rmtree(place.metrics_dir, ignore_errors=True)


def _start(
    coordinator: CoordinatorConfig,
    service: ServiceConfig,
    index: int,
    place: WorkerPlace,
    port: int,
    log_dir: Path,
    abandon: threading.Event,
) -> Worker:
    log_dir.mkdir(parents=True, exist_ok=True)
    read_end, write_end = os.pipe()
    log_path = log_dir / f"worker-{index}.log"
    try:
        with log_path.open("wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "dualvllm.service.workers", str(write_end)],
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT,
                pass_fds=(write_end,),
                start_new_session=True,  # Ctrl-C reaches the parent, which stops it
            )
        os.close(write_end)
        write_end = -1
        worker = Worker(index, process, log_path)
        try:
            assert process.stdin is not None
            process.stdin.write(_spec(coordinator, service, index, place, port))
            process.stdin.close()
            _wait_ready(worker, read_end, time.monotonic() + WORKER_START_S, abandon)
        except BaseException:
            _stop_all([worker])
            raise
        return worker
    finally:
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)


def _wait_ready(worker: Worker, read_end: int, deadline: float, abandon: threading.Event) -> None:
    """Until `worker` says it listens; raises ServerStartupError, with its log, if it exits or
    takes longer than WORKER_START_S, or as soon as `abandon` is set."""
    while True:
        if abandon.is_set():
            raise ServerStartupError(f"the start of endpoint worker {worker.index} was abandoned")
        left = deadline - time.monotonic()
        if left <= 0:
            raise ServerStartupError(
                f"endpoint worker {worker.index} did not listen within {WORKER_START_S:g} s; its log "
                f"{worker.log_path}:\n{log_tail(worker.log_path, LOG_TAIL_LINES)}"
            )
        readable, _, _ = select.select([read_end], [], [], min(left, 1.0))
        if readable:
            said = os.read(read_end, len(READY))
            if said == READY:
                return
            problem = worker.exit_problem() if said == b"" else None
            if problem is None:
                worker.process.wait(timeout=WORKER_STOP_S)  # the pipe closed: it is exiting
                problem = worker.exit_problem()
            raise ServerStartupError(problem or f"endpoint worker {worker.index} closed its ready pipe")
        problem = worker.exit_problem()
        if problem is not None:
            raise ServerStartupError(problem)


def _stop_all(workers: list[Worker]) -> None:
    """SIGTERM to every worker, then each waited for (WORKER_STOP_S), then SIGKILL."""
    for worker in workers:
        if worker.process.poll() is None:
            worker.process.send_signal(signal.SIGTERM)
    for worker in workers:
        try:
            worker.process.wait(timeout=WORKER_STOP_S)
        except subprocess.TimeoutExpired:
            log.warning("endpoint worker %d ignored SIGTERM for %.0f s; killed", worker.index, WORKER_STOP_S)
            worker.process.kill()
            worker.process.wait(timeout=WORKER_STOP_S)


# -- a worker -----------------------------------------------------------------------------


def listening(config: ServiceConfig, port: int) -> socket.socket:
    """A worker's own socket on the endpoint's port, beside the parent's (SO_REUSEPORT)."""
    return socket.create_server((config.service_host, port), reuse_port=True)


async def _serve_worker(spec: dict[str, Any], ready_fd: int) -> None:
    from dualvllm.coordinator.core import DualVLLMCoordinator
    from dualvllm.service.app import serve

    coordinator_config = CoordinatorConfig(**spec["coordinator"])
    service_config = ServiceConfig(**spec["service"])
    sock = listening(service_config, service_config.service_port)
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)

    def ready(url: str, model: str) -> None:
        log.info("endpoint worker %d/%d serving %s/v1 (model %r)", spec["index"], spec["count"], url, model)
        os.write(ready_fd, READY)

    async with DualVLLMCoordinator(coordinator_config) as coordinator:
        place = WorkerPlace(spec["index"], spec["count"], Path(spec["metrics_dir"]))
        await serve(coordinator, service_config, ready=ready, sock=sock, worker=place)


def main(argv: list[str]) -> int:
    from dualvllm.common import loop
    from dualvllm.common.process import die_with_parent

    spec = json.loads(sys.stdin.buffer.read())
    die_with_parent(spec["parent"])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        loop.run(_serve_worker(spec, int(argv[0])))
    except asyncio.CancelledError:  # SIGTERM: the parent stops it
        return 0
    except DualVLLMError as err:  # one line in its log, which the parent shows
        print(f"dualvllm endpoint worker {spec['index']}: error: {err}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
