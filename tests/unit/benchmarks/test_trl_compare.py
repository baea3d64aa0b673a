"""benchmarks/trl_compare.py's bookkeeping: paired accuracy differences and reward windows."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
from benchmarks.trl_compare import ARMS, paired_differences, windows  # noqa: E402


def test_paired_differences_pair_each_seed_and_update_both_arms_have():
    results = {
        ARMS["dualvllm"]: {"0": {"held_out_accuracy": {0: 0.25, 25: 0.30, 50: 0.40}},
                           "1": {"held_out_accuracy": {0: 0.20, 25: 0.22}},
                           "7": {"held_out_accuracy": {0: 0.5}}},  # no TRL run for seed 7: left out
        ARMS["trl"]: {"0": {"held_out_accuracy": {0: 0.25, 25: 0.34, 50: 0.35}},
                      "1": {"held_out_accuracy": {0: 0.20, 25: 0.21, 50: 0.30}}},  # no update 50 for seed 1's pair
    }
    diffs = paired_differences(results)
    assert list(diffs) == [0, 25, 50]
    assert diffs[0] == [0.0, 0.0]
    assert diffs[25] == pytest.approx([4.0, -1.0])  # seed 0: 34 - 30 points, seed 1: 21 - 22
    assert diffs[50] == pytest.approx([-5.0])  # 35 - 40: seed 0 only


def test_windows_average_consecutive_updates_and_keep_a_short_tail():
    assert windows([1.0, 0.0, 0.5, 0.5, 0.25], 2) == [0.5, 0.5, 0.25]
