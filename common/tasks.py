"""Stopping work within a bound: nothing on a shutdown path waits forever.

`task.cancel(); await task` is not enough. A cancel can be dropped: on Python 3.11,
`asyncio.wait_for` returns its inner future's result, and drops the cancel, when the cancel
arrives in the loop iteration in which that future completes (CPython issue gh-86296,
fixed in 3.12). The cancelled task then runs on, and whoever awaits it waits forever.
That is what hung `dualvllm train` after its last update (issue 23): the sampler's reward
scoring finished as the loop cancelled it, the sampler went on to put its batch into a
full queue that nobody read again, and `await sampler` never returned.

So `stop` cancels again until the task ends, and gives up after a bound with an error that
names what it waited for; `bounded` puts a bound on any other await of a shutdown path.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TypeVar
from collections.abc import Awaitable

from dualvllm.common.errors import ShutdownTimeoutError

log = logging.getLogger("dualvllm")

T = TypeVar("T")
# A dropped cancel is retried this often; a task that honours its cancel ends well within it.
CANCEL_RETRY_S = 0.5


async def stop(*tasks: asyncio.Task | None, what: str, timeout_s: float) -> None:
    """Cancel `tasks` (None ones are skipped) and wait until all have ended, cancelling
    again every CANCEL_RETRY_S.

    Raises ShutdownTimeoutError naming `what` if any still runs after `timeout_s`. An error
    a task ended with is logged, not raised: the caller is stopping it. The caller's own
    cancellation is never swallowed (unlike `suppress(CancelledError)` around `await task`).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    running = {task for task in tasks if task is not None}
    while running := {task for task in running if not task.done()}:
        for task in running:
            task.cancel()
        left = deadline - loop.time()
        if left <= 0:
            names = ", ".join(sorted(task.get_name() for task in running))
            raise ShutdownTimeoutError(
                f"{what} did not stop within {timeout_s:g} s of being cancelled (still running: {names})"
            )
        await asyncio.wait(running, timeout=min(CANCEL_RETRY_S, left))
    for stopped in tasks:
        if stopped is not None and not stopped.cancelled() and stopped.exception() is not None:
            log.warning(
                "%s: %s ended with an error while being stopped: %r", what, stopped.get_name(), stopped.exception()
            )


async def bounded(awaitable: Awaitable[T], *, what: str, timeout_s: float) -> T:
    """`await awaitable`, or ShutdownTimeoutError naming `what` after `timeout_s`."""
    bound = asyncio.timeout(timeout_s)
    try:
        async with bound:
            return await awaitable
    except TimeoutError as exc:
        if not bound.expired():  # the awaitable's own timeout, not ours
            raise
        raise ShutdownTimeoutError(f"{what} did not finish within {timeout_s:g} s") from exc
