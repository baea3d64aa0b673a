"""Wall seconds by phase: where a piece of work (an update, a push) spent its time."""

from __future__ import annotations

import time


class PhaseClock:
    """`lap(name)` adds the seconds since the last lap (or the start) to phase `name`."""

    def __init__(self) -> None:
        self.started = self._last = time.perf_counter()
        self.laps: dict[str, float] = {}

    def lap(self, phase: str) -> float:
        now = time.perf_counter()
        seconds, self._last = now - self._last, now
        self.laps[phase] = self.laps.get(phase, 0.0) + seconds
        return seconds

    def total(self) -> float:
        """Seconds since the start."""
        return time.perf_counter() - self.started
