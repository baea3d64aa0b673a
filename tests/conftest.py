from __future__ import annotations

import pytest_asyncio

from tests.fake_vllm import FakeModel, FakeVLLM


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
