"""The rules that decide how an in-memory push is proved (dualvllm.training.push_check), without I/O."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from dualvllm.training.push_check import SharedResult, digest_failure, digest_verdict, probe_scheduled, verified_by


@pytest.mark.parametrize("sent, served, previous, verdict", [
    ("a", "a", None, "equal"),
    ("a", "a", "a", "equal"),  # a push of unchanged weights
    ("b", "a", "a", "stale"),
    ("b", "c", "a", "differs"),
    ("b", "a", None, "differs"),  # the first push: nothing to be stale against
    ("b", None, "a", "unknown"),  # the server gives no digest
    (None, "a", "a", "unknown"),  # the push was not digested (NCCL)
])
def test_digest_verdict(sent, served, previous, verdict):
    assert digest_verdict(sent, served, previous) == verdict


@pytest.mark.parametrize("every, probed", [
    (0, [0]),
    (1, list(range(10))),
    (3, [0, 3, 6, 9]),
    (50, [0]),
])
def test_probes_run_at_the_first_push_and_every_nth(every, probed):
    assert [i for i in range(10) if probe_scheduled(i, every)] == probed


def test_verified_by_names_what_proved_a_push_and_refuses_a_failed_one():
    assert verified_by("equal", False) == "digest"
    assert verified_by("equal", True) == "digest+probe"
    assert verified_by("unknown", True) == "probe"
    with pytest.raises(AssertionError):
        verified_by("stale", True)
    with pytest.raises(AssertionError):
        verified_by("unknown", False)


def test_a_failure_says_digest_mismatch_and_whether_the_old_step_is_still_served():
    stale = digest_failure("stale", "b" * 32, "a" * 32, "logprobs within tolerance")
    assert "digest mismatch" in stale and "still holds the old step" in stale
    assert "aaaaaaaaaaaa" in stale and "bbbbbbbbbbbb" in stale and stale.endswith("found: logprobs within tolerance")
    differs = digest_failure("differs", "b" * 32, "c" * 32, "off by 3 nats")
    assert "digest mismatch" in differs and "neither this step nor the one before" in differs


async def test_a_shared_result_is_computed_once_on_first_need_for_every_replica():
    calls = []

    def compute() -> np.ndarray:
        calls.append(1)
        return np.ones(3)

    shared = SharedResult(compute)
    assert not shared.computed and shared.peek() is None and calls == []
    values = await asyncio.gather(*(shared.get() for _ in range(4)))
    assert calls == [1] and all(v is values[0] for v in values) and shared.computed
    assert SharedResult(np.zeros(2)).computed
