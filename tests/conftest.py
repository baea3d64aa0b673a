from __future__ import annotations

import pytest
import pytest_asyncio

from tests import processes
from tests.fake_vllm import FakeModel, FakeVLLM


def pytest_collection_modifyitems(config, items):
    """Every `gpu`-marked test is skipped, with the reason, where torch sees no CUDA device (torch is
    imported only when such a test is collected)."""
    marked = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not marked:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA device; torch {torch.__version__} sees none")
    for item in marked:
        item.add_marker(skip)


@pytest.fixture(autouse=True)
def end_started_processes():
    """Every process a test started through tests.processes.start ends with the test, on
    every path: a failure or a timeout included."""
    yield
    processes.end_started()


@pytest_asyncio.fixture
async def fake_theta():
    server = FakeVLLM(FakeModel(seed=1), name="fake-base")
    await server.start()
    yield server
    await server.close()


@pytest_asyncio.fixture
async def fake_t():
    server = FakeVLLM(FakeModel(seed=2), name="fake-teacher")
    await server.start()
    yield server
    await server.close()
