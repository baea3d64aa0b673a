from __future__ import annotations

import contextlib

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


@contextlib.asynccontextmanager
async def fake_server(seed: int, name: str):
    """A started FakeVLLM over FakeModel(seed), closed on the way out."""
    server = FakeVLLM(FakeModel(seed=seed), name=name)
    await server.start()
    try:
        yield server
    finally:
        await server.close()


@pytest_asyncio.fixture
async def fake_theta():
    async with fake_server(1, "fake-base") as server:
        yield server


@pytest_asyncio.fixture
async def second_theta():
    """A second base replica beside fake_theta: the same weights."""
    async with fake_server(1, "fake-base") as server:
        yield server


@pytest_asyncio.fixture
async def fake_t():
    async with fake_server(2, "fake-teacher") as server:
        yield server
