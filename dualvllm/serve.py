"""`dualvllm serve`: run the base and teacher servers until interrupted."""

from __future__ import annotations

import asyncio

from common.errors import ServerStartupError
from engines.launcher import ServerConfig, launch_pair

# How often to check that both servers are still alive while serving.
LIVENESS_POLL_S = 2.0


async def serve_pair(base: ServerConfig, teacher: ServerConfig) -> None:
    async with launch_pair(base, teacher) as (theta, t):
        print(f"base    (theta): {theta.url}   log: {theta.log_path}")
        print(f"teacher (t):     {t.url}   log: {t.log_path}")
        print(f"export DUALVLLM_THETA_URL={theta.url} DUALVLLM_T_URL={t.url}")
        print("Ctrl-C stops both.", flush=True)
        while theta.running and t.running:
            await asyncio.sleep(LIVENESS_POLL_S)
        dead = theta if not theta.running else t
        raise ServerStartupError(f"{dead.name} server exited while serving; the other one was stopped. "
                                 f"Log {dead.log_path}:\n{dead.log_tail()}")
