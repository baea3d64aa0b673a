from __future__ import annotations

import contextlib

import pytest
import pytest_asyncio

from tests import processes
from tests.fake_vllm import FakeModel, FakeVLLM


# Fixture scopes wider than a test, widest first: the group of a test that shares one.
SHARED_SCOPES = ("session", "package", "module")


def xdist_group(item: pytest.Item) -> str | None:
    """The group a test runs in under `pytest -n N --dist loadgroup` (scripts/test.sh): its widest
    shared fixture defined in tests/ (the session's vLLM pair, a package's servers, or its module
    when it shares a module's), so each such fixture starts once, on one worker. None: a test that
    shares none runs wherever a worker is free."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    widest: tuple[int, str] | None = None
    for name, definitions in info.name2fixturedefs.items():
        fixture = definitions[-1]
        if fixture.scope not in SHARED_SCOPES or not fixture.func.__module__.startswith("tests."):
            continue
        rank = SHARED_SCOPES.index(fixture.scope)
        key = {"session": name, "package": f"{fixture.func.__module__}.{name}"}.get(fixture.scope, item.module.__name__)
        if widest is None or rank < widest[0]:
            widest = (rank, key)
    return widest[1] if widest else None


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    """Tests that share a fixture wider than a test are grouped for xdist (`xdist_group`). Every
    `gpu`-marked test is skipped, with the reason, where torch sees no CUDA device (torch is
    imported only when such a test is collected)."""
    for item in items:
        if (group := xdist_group(item)) is not None:
            item.add_marker(pytest.mark.xdist_group(group))
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
