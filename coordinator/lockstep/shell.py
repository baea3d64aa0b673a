"""What the lockstep scheduler lends its parts (admission, recovery): its lock, its
background tasks, and the step that follows any change of state."""

from __future__ import annotations

import asyncio
from typing import Any, Protocol
from collections.abc import Coroutine


class Shell(Protocol):
    # Every change of state runs under it; it is never held across a server call or a sleep.
    lock: asyncio.Lock

    def spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        """Run `coroutine` as a task that close() stops."""

    def settle(self) -> None:
        """After a change (under the lock): break a deadlock, start what can start, answer
        what is decided."""

    def send_ready(self) -> None:
        """Hand finished sequences to their callers and answer every decided report (under the lock)."""
