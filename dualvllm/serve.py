"""`dualvllm serve`: the q* endpoint over two servers, or (--servers-only) the servers alone,
until interrupted."""

from __future__ import annotations

import asyncio
from typing import Sequence

from common.errors import ServerStartupError
from coordinator.core import DualVLLMCoordinator
from engines.launcher import ServerConfig, VLLMServer, launch_pair
from service.app import serve
from service.config import ServiceConfig

# How often to check that both servers are still alive while serving.
LIVENESS_POLL_S = 2.0


async def serve_pair(base: ServerConfig, teacher: ServerConfig) -> None:
    async with launch_pair(base, teacher) as (theta, t):
        _print_servers(theta, t)
        print("Ctrl-C stops both.", flush=True)
        while theta.running and t.running:
            await asyncio.sleep(LIVENESS_POLL_S)
        dead = theta if not theta.running else t
        raise ServerStartupError(f"{dead.name} server exited while serving; the other one was stopped. "
                                 f"Log {dead.log_path}:\n{dead.log_tail()}")


async def serve_endpoint(coordinator: DualVLLMCoordinator, config: ServiceConfig,
                         servers: Sequence[VLLMServer]) -> None:
    """Serve the q* endpoint until interrupted, or until one of the `servers` started for it exits."""

    def ready(url: str, model: str) -> None:
        if servers:
            _print_servers(*servers)
        print(f"q* endpoint: {url}/v1  (model {model!r}, mode {coordinator.mode})")
        print(f"  curl {url}/v1/completions -H 'Content-Type: application/json' "
              f"-d '{{\"model\": \"{model}\", \"prompt\": \"12+34=\", "
              f"\"max_tokens\": 8}}'")
        print("Ctrl-C stops it" + (" and the servers." if servers else "."), flush=True)

    endpoint = asyncio.create_task(serve(coordinator, config, ready=ready))
    try:
        while not endpoint.done():
            dead = next((s for s in servers if not s.running), None)
            if dead is not None:
                raise ServerStartupError(f"{dead.name} server exited while serving; the endpoint was stopped. "
                                         f"Log {dead.log_path}:\n{dead.log_tail()}")
            await asyncio.wait([endpoint], timeout=LIVENESS_POLL_S)
        endpoint.result()
    finally:
        endpoint.cancel()
        await asyncio.gather(endpoint, return_exceptions=True)


def _print_servers(theta: VLLMServer, t: VLLMServer) -> None:
    print(f"base    (theta): {theta.url}   log: {theta.log_path}")
    print(f"teacher (t):     {t.url}   log: {t.log_path}")
    print(f"export DUALVLLM_THETA_URL={theta.url} DUALVLLM_T_URL={t.url}")
