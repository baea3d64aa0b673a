"""PhaseClock: laps add up by phase and to the total."""

from __future__ import annotations

import time

import pytest

from dualvllm.common.clock import PhaseClock


def test_laps_add_up_by_phase_and_to_the_total(monkeypatch):
    now = iter([10.0, 10.5, 12.0, 12.25, 13.0])
    monkeypatch.setattr(time, "perf_counter", lambda: next(now))
    clock = PhaseClock()  # starts at 10.0
    assert clock.lap("update") == pytest.approx(0.5)
    assert clock.lap("push") == pytest.approx(1.5)
    assert clock.lap("update") == pytest.approx(0.25)  # a phase seen twice sums its laps
    assert clock.laps == pytest.approx({"update": 0.75, "push": 1.5})
    assert clock.total() == pytest.approx(3.0)
