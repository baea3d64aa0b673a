"""Real vLLM servers on the bundled tiny models, shared by the integration tests.

One pair, started once per test session (~40-70 s on 2 CPU cores) at its first use and stopped
at the session's end, under two names: `vllm_pair` for the tests that push no weights, and
`dev_pair`, whose base takes them (dev mode) and is given back the bundled base's weights after
every test.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from dualvllm import tinymodels
from dualvllm.engines.vllm_client import VLLMClient
from tests.integration import pairs

pytestmark = pytest.mark.integration


def pytest_collection_modifyitems(items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def dev_servers(tmp_path_factory):
    """`dev_pair`'s servers, started once per session (pairs.dev_pair)."""
    with pairs.dev_pair(tmp_path_factory.mktemp("dev-pair-logs")) as pair:
        yield pair


@pytest.fixture
def vllm_pair(dev_servers):
    """(theta_server, t_server) for the tests that push no weights: the session's one pair (below).

    They carry the lockstep plugin, so every test that does not choose a mode runs in
    lockstep (the default wherever the plugin is); the plugin gives up on a silent
    coordinator after 15 s instead of 60. The base is in dev mode, as `dualvllm train` starts
    it; a test that pushes asks for `dev_pair`, which gives the base its weights back after.
    """
    return dev_servers


@pytest.fixture
def dev_pair(dev_servers):
    """(base in dev mode with dualvllm's weight-transfer engine, teacher), with the lockstep plugin:
    the servers `dualvllm train` starts, for tests that push weights. After each test the base
    serves the bundled base's weights again, whatever the test pushed (a reload from its directory)."""
    yield dev_servers
    theta, _ = dev_servers
    if not theta.running:
        pytest.fail("a test stopped the shared dev pair's base; tests that kill servers start their own")

    async def restore() -> None:
        async with VLLMClient(theta.url, name="theta") as client:
            await client.admin.reload_weights(tinymodels.BASE_DIR)

    asyncio.run(restore())
