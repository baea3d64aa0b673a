from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import pytest_asyncio

from tests import processes
from tests.fake_vllm import FakeModel, FakeVLLM


# Fixture scopes wider than a test, widest first: the group of a test that shares one.
SHARED_SCOPES = ("session", "package", "module")
# Where the first xdist worker writes each grouped test's group for the scheduler in the main
# process, which collects nothing itself (set there, inherited by the workers).
GROUPS_FILE_ENV = "DUALVLLM_TEST_GROUPS_FILE"


def shared_group(item: pytest.Item) -> str | None:
    """The group a test runs in under xdist (scripts/test.sh): its widest shared fixture defined
    in tests/ (the session's vLLM pair, a package's servers, or its module when it shares a
    module's), so each such fixture starts once, on one worker. None: a test that shares none
    runs wherever a worker is free."""
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


def pytest_configure(config):
    if config.getoption("numprocesses", None) and "PYTEST_XDIST_WORKER" not in os.environ:
        os.environ[GROUPS_FILE_ENV] = str(Path(tempfile.mkdtemp(prefix="dualvllm-test-groups-")) / "groups.json")


def pytest_unconfigure(config):
    if "PYTEST_XDIST_WORKER" not in os.environ and (groups := os.environ.pop(GROUPS_FILE_ENV, None)):
        shutil.rmtree(Path(groups).parent, ignore_errors=True)


def pytest_xdist_make_scheduler(config, log):
    """xdist's scope scheduling over `shared_group`'s groups: a group goes to one worker whole.
    (xdist's own `--dist loadgroup` renames node ids, which pytest 9 no longer lets it do.)"""
    from xdist.scheduler import LoadScopeScheduling

    class SharedFixtureScheduling(LoadScopeScheduling):
        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # written before the workers reported their collections
                self.groups = json.loads(Path(os.environ[GROUPS_FILE_ENV]).read_text())
            return self.groups.get(nodeid, nodeid)

    return SharedFixtureScheduling(config, log)


def pytest_addoption(parser):
    parser.addoption(
        "--run-slow",
        action="store_true",
        help="also run the tests marked slow: a minute or more each, on paths faster tests also cover "
        "(run them when changing those paths)",
    )


def pytest_collection_modifyitems(config, items):
    """Under xdist, the first worker writes the tests' groups (`shared_group`) for the scheduler.
    `slow` tests are skipped unless --run-slow. Every `gpu`-marked test is skipped, with the reason, where torch sees no CUDA device (torch is
    imported only when such a test is collected)."""
    if (groups := os.environ.get(GROUPS_FILE_ENV)) and os.environ.get("PYTEST_XDIST_WORKER") == "gw0":
        grouped = {item.nodeid: group for item in items if (group := shared_group(item)) is not None}
        Path(groups + ".part").write_text(json.dumps(grouped))
        os.replace(groups + ".part", groups)
    if not config.getoption("--run-slow"):
        slow = pytest.mark.skip(reason="slow: run with --run-slow (bash scripts/test.sh --run-slow)")
        for item in items:
            if item.get_closest_marker("slow") is not None:
                item.add_marker(slow)
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
