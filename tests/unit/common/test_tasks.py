"""common/tasks.py: stopping tasks and bounding awaits on shutdown paths."""

from __future__ import annotations

import asyncio

import pytest

from dualvllm.common.errors import ShutdownTimeoutError
from dualvllm.common.tasks import bounded, stop

pytestmark = pytest.mark.timeout(30)


async def drops_one_cancel(release: asyncio.Event) -> str:
    """What a task does after asyncio.wait_for swallowed its cancel (Python 3.11): it goes on,
    here into a wait that nothing will end."""
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        pass  # dropped
    await release.wait()
    return "released"


async def never_stops(release: asyncio.Event, cancelled: asyncio.Event | None = None) -> None:
    while not release.is_set():
        try:
            await release.wait()
        except asyncio.CancelledError:
            if cancelled is not None:
                cancelled.set()
            continue


async def test_stop_cancels_again_a_task_that_dropped_its_cancel():
    task = asyncio.create_task(drops_one_cancel(asyncio.Event()))
    await asyncio.sleep(0)
    await stop(task, what="the sampler", timeout_s=5)
    assert task.cancelled()


async def test_stop_names_what_it_waited_for_when_the_bound_runs_out():
    release = asyncio.Event()
    task = asyncio.create_task(never_stops(release), name="stubborn")
    await asyncio.sleep(0)
    with pytest.raises(ShutdownTimeoutError, match=r"the sampler did not stop within 0.2 s .*still running: stubborn"):
        await stop(task, None, what="the sampler", timeout_s=0.2)
    release.set()
    await task


async def test_stop_never_swallows_the_callers_own_cancel():
    release, cancelled = asyncio.Event(), asyncio.Event()
    stubborn = asyncio.create_task(never_stops(release, cancelled))
    await asyncio.sleep(0)
    stopper = asyncio.create_task(stop(stubborn, what="a stubborn task", timeout_s=60))
    await asyncio.wait_for(cancelled.wait(), 5)  # the stopper has cancelled once and waits
    assert not stopper.done() and not stubborn.done()
    stopper.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopper
    release.set()
    await stubborn


async def test_stop_logs_what_a_task_failed_with(caplog):
    async def fails():
        raise RuntimeError("boom")
    task = asyncio.create_task(fails(), name="failing")
    await asyncio.sleep(0)
    await stop(task, what="the prober", timeout_s=1)
    assert "the prober: failing ended with an error while being stopped: RuntimeError('boom')" in caplog.text


async def test_bounded_names_what_it_waited_for_and_passes_other_timeouts_through():
    with pytest.raises(ShutdownTimeoutError, match="the final evaluation did not finish within 0.05 s"):
        await bounded(asyncio.sleep(10), what="the final evaluation", timeout_s=0.05)

    async def own_timeout():
        raise TimeoutError("the awaitable's own")
    with pytest.raises(TimeoutError, match="the awaitable's own") as raised:
        await bounded(own_timeout(), what="x", timeout_s=5)
    assert not isinstance(raised.value, ShutdownTimeoutError)
    assert await bounded(asyncio.sleep(0, result=7), what="x", timeout_s=5) == 7
