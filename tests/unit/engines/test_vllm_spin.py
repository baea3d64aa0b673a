"""The engine-spin hook (engines/vllm_plugin/spin.py) on vLLM's real shm_broadcast module."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm")

import vllm  # noqa: E402
from vllm.distributed.device_communicators import shm_broadcast  # noqa: E402

from dualvllm.engines.vllm_plugin import spin  # noqa: E402


@pytest.fixture
def pristine(monkeypatch):
    """vLLM's module as it was, whatever a test patches; SpinCondition's own __init__ replaced by
    one that records the busy-wait it is given (a real one opens zmq sockets)."""
    given: list[float] = []

    def recording_init(self, is_reader, context, notify_address, busy_loop_s: float = 1) -> None:
        given.append(busy_loop_s)

    monkeypatch.setattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS", shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS)
    monkeypatch.setattr(shm_broadcast.SpinCondition, "__init__", recording_init)
    monkeypatch.delattr(shm_broadcast.SpinCondition, "_dualvllm_spin_s", raising=False)
    monkeypatch.delenv(spin.SPIN_ENV, raising=False)
    monkeypatch.delenv(spin.RECHECK_ENV, raising=False)
    return given


def reader_spin_s(given: list[float]) -> float:
    """The busy-wait a reader's SpinCondition gets when built as vLLM's MessageQueue builds it."""
    shm_broadcast.SpinCondition(True, None, "inproc://unused")
    return given[-1]


def test_without_its_variable_the_hook_changes_nothing(pristine):
    spin.register()
    assert reader_spin_s(pristine) == 1 and shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == 5000


def test_the_launchers_variables_lower_the_spin_and_the_recheck_together(pristine, monkeypatch):
    monkeypatch.setenv(spin.SPIN_ENV, "0.001")
    spin.register()
    spin.register()  # vLLM may load plugins more than once per process
    assert reader_spin_s(pristine) == 0.001 and shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == spin.DEFAULT_RECHECK_MS


def test_another_vllm_version_is_left_alone_with_a_warning(pristine, monkeypatch, caplog):
    monkeypatch.setenv(spin.SPIN_ENV, "0.001")
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    with caplog.at_level(logging.WARNING, logger="vllm.dualvllm_spin"):
        spin.register()
    assert reader_spin_s(pristine) == 1 and shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == 5000
    assert "0.99.0" in caplog.text and "keeps its own spin" in caplog.text
