"""`dualvllm serve`: the q* endpoint over two servers, or (--servers-only) the servers alone,
until interrupted."""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import Sequence

from dualvllm.common.errors import ServerStartupError
from dualvllm.coordinator.core import DualVLLMCoordinator
from dualvllm.engines.launcher import ServerConfig, VLLMServer, launch_replicas
from dualvllm.service.app import serve
from dualvllm.service.config import ServiceConfig
from dualvllm.service.worker_metrics import WorkerPlace
from dualvllm.service.workers import Worker

# How often to check that both servers are still alive while serving.
LIVENESS_POLL_S = 2.0


async def serve_servers(pairs: list[tuple[ServerConfig, ServerConfig]]) -> None:
    """Start the (base, teacher) pairs, print their URLs, and keep them up until interrupted.

    With one pair, a server that exits stops the other. Replicas are meant to outlive each
    other: a dead one is reported, the others serve on, and it may be restarted by hand on
    its port (a coordinator's pool takes it back once it passes its probe)."""
    async with launch_replicas(pairs) as launched:
        servers = [server for pair in launched for server in pair]
        _print_servers(*servers)
        print("Ctrl-C stops them all.", flush=True)
        reported: set[str] = set()
        while True:
            dead = [server for server in servers if not server.running and server.name not in reported]
            if dead and len(servers) == 2:
                raise ServerStartupError(
                    f"{dead[0].name} server exited while serving; the other one was stopped. "
                    f"Log {dead[0].log_path}:\n{dead[0].log_tail()}"
                )
            for server in dead:
                print(
                    f"{server.name} server ({server.url}) exited; the others serve on. Log {server.log_path}",
                    file=sys.stderr,
                    flush=True,
                )
                reported.add(server.name)
            if len(reported) == len(servers):
                raise ServerStartupError("every server exited; see their logs above")
            await asyncio.sleep(LIVENESS_POLL_S)


async def serve_endpoint(
    coordinator: DualVLLMCoordinator,
    config: ServiceConfig,
    servers: Sequence[VLLMServer],
    sock: socket.socket | None = None,
    workers: Sequence[Worker] = (),
    place: WorkerPlace | None = None,
) -> None:
    """Serve the q* endpoint until interrupted, or until a server started for it exits: with
    replica pools, until every replica of a role has (the pool fails over until then), or until
    one of its other `workers` (dualvllm.service.workers) exits; `place`: this process's among them.
    `sock`: the endpoint's socket, bound before the servers started (dualvllm.service.app.listening_socket)."""

    def ready(url: str, model: str) -> None:
        if servers:
            _print_servers(*servers)
        print(f"q* endpoint: {url}/v1  (model {model!r}, mode {coordinator.mode})")
        if workers:
            print(
                f"  {config.workers} worker processes, each with its own coordinator; logs: "
                + ", ".join(str(w.log_path) for w in workers)
            )
        print(
            f"  curl {url}/v1/completions -H 'Content-Type: application/json' "
            f'-d \'{{"model": "{model}", "prompt": "12+34=", '
            f'"max_tokens": 8}}\''
        )
        print("Ctrl-C stops it" + (" and the servers." if servers else "."), flush=True)

    endpoint = asyncio.create_task(serve(coordinator, config, ready=ready, sock=sock, worker=place))
    try:
        while not endpoint.done():
            dead = _role_lost(servers)
            if dead is not None:
                raise ServerStartupError(
                    f"{dead.name} server exited while serving; the endpoint was stopped. "
                    f"Log {dead.log_path}:\n{dead.log_tail()}"
                )
            gone = next(filter(None, (w.exit_problem() for w in workers)), None)
            if gone is not None:
                raise ServerStartupError(f"{gone}\nThe endpoint was stopped.")
            await asyncio.wait([endpoint], timeout=LIVENESS_POLL_S)
        endpoint.result()
    finally:
        endpoint.cancel()
        await asyncio.gather(endpoint, return_exceptions=True)


def _print_servers(*servers: VLLMServer) -> None:
    """Each server's URL and log, then the variables that point a coordinator at them."""
    thetas, ts = servers[0::2], servers[1::2]  # (base, teacher) pairs, in order
    for server in servers:
        role = "base    (theta)" if server in thetas else "teacher (t)    "
        print(f"{role} {server.name:>8}: {server.url}   log: {server.log_path}")
    if len(thetas) == 1:
        print(f"export DUALVLLM_THETA_URL={thetas[0].url} DUALVLLM_T_URL={ts[0].url}")
    else:
        print(
            f"export DUALVLLM_THETA_URLS={','.join(s.url for s in thetas)} "
            f"DUALVLLM_T_URLS={','.join(s.url for s in ts)}"
        )


def _role_lost(servers: Sequence[VLLMServer]) -> VLLMServer | None:
    """A server of a role none of whose servers (the pairs' base, or teacher) still runs."""
    for role in (servers[0::2], servers[1::2]):
        if role and not any(server.running for server in role):
            return role[0]
    return None
