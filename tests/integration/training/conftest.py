"""One dev-mode pair for the training tests of this package (pushes go into its base).

Package scope: it starts before the package's first test and stops after its last, so
the training modules share it (one start instead of one per module, about a minute of CI
each) without it staying up beside the replica pools' servers. The session's shared pair
is not in dev mode, so it takes no pushes.
"""

from __future__ import annotations

import pytest

from tests.integration import pairs


@pytest.fixture(scope="package")
def dev_pair(tmp_path_factory):
    """(base in dev mode, teacher), with the lockstep plugin (pairs.dev_pair)."""
    with pairs.dev_pair(tmp_path_factory.mktemp("training-dev-pair-logs")) as pair:
        yield pair
