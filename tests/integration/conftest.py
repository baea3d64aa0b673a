"""Two real vLLM servers on the bundled tiny models, shared by the integration tests.

They start once per test session (~40-70 s on 2 CPU cores) and stop at its end.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dualvllm.engines.launcher import pair_configs
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
