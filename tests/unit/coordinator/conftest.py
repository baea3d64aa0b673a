"""The lockstep tests' `rig` fixture (tests/unit/coordinator/lockstep_rig.py)."""

import pytest_asyncio

from tests.unit.coordinator.lockstep_rig import Rig


@pytest_asyncio.fixture
async def rig():
    r = Rig()
    yield r
    await r.aclose()
