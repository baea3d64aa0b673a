"""Real vLLM servers on the bundled tiny models, shared by the integration tests.

Two pairs, each started once per test session (~40-70 s on 2 CPU cores) at its first use and
stopped at the session's end: `vllm_pair`, which never takes a weight push, and `dev_pair`,
whose base takes them (dev mode), given back the bundled base's weights after every test.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from dualvllm import tinymodels
from dualvllm.engines.launcher import pair_configs
from dualvllm.engines.vllm_client import VLLMClient
from tests.integration import pairs
from tests.integration.pairs import running_pair

pytestmark = pytest.mark.integration


def pytest_collection_modifyitems(items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def vllm_pair(tmp_path_factory):
    """(theta_server, t_server): base and teacher tiny models, each on its own core.

    They carry the lockstep plugin, so every test that does not choose a mode runs in
    lockstep (the default wherever the plugin is); the plugin gives up on a silent
    coordinator after 15 s instead of 60.
    """
    configs = pair_configs(log_dir=tmp_path_factory.mktemp("vllm-logs"), max_logprobs=100, lockstep=True,
                           lockstep_timeout_s=15)
    with running_pair(configs) as pair:
        yield pair


@pytest.fixture(scope="session")
def dev_servers(tmp_path_factory):
    """`dev_pair`'s servers, started once per session (pairs.dev_pair)."""
    with pairs.dev_pair(tmp_path_factory.mktemp("dev-pair-logs")) as pair:
        yield pair


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
