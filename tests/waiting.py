"""Waiting on events in tests: poll a condition until it holds, and fail loudly if it never does.

A fixed sleep is either too short on a loaded machine (a flaky test) or too long on an idle
one (a slow test); a wait on the condition itself is neither. The timeout is generous because
it only matters when the condition never comes.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import Awaitable, Callable

WAIT_S = 30.0
POLL_S = 0.005


async def eventually(condition: Callable[[], object | Awaitable[object]], what: str,
                     timeout_s: float = WAIT_S, poll_s: float = POLL_S) -> None:
    """Return once `condition()` (a plain or an async callable) is true; AssertionError naming
    `what` after `timeout_s` seconds. An exception `condition` raises (e.g. an assertion that
    a process is still alive) ends the wait at once. Give a longer `poll_s` to a condition that
    costs the system under test (an HTTP scrape of a real server, a file read). A synchronous
    test waits with `asyncio.run(eventually(...))`."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = condition()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened within {timeout_s:g} s: {what}")
        await asyncio.sleep(poll_s)
