"""benchmarks/train_compare.py's bookkeeping: warm-up arms' joined curves, which finished runs are reused."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
import argparse  # noqa: E402

from dualvllm import tinymodels  # noqa: E402
from benchmarks.train_compare import (ARMS, against_the_best, LONG_ARMS, RECIPE, TASKS, NotRun, finished_with, joined, run_arm,  # noqa: E402
                                      training_subset)
from dualvllm.training.config import TrainConfig  # noqa: E402


def train_config(**values) -> TrainConfig:
    return TrainConfig.parse(config_file=RECIPE, **values)


def test_a_warm_up_and_its_arm_join_end_to_end():
    first = {"held_out_accuracy": [(0, 0.0), (50, 0.1), (100, 0.2)], "teacher_tokens": [(0, 0.0), (50, 300.0), (100, 600.0)]}
    then = {"held_out_accuracy": [(0, 0.2), (50, 0.4), (100, 0.7)], "teacher_tokens": [(0, 0.0), (50, 0.0), (100, 0.0)]}

    out = joined(first, then, offset=100)

    # The second run's step-0 evaluation is the first's last, so it appears once.
    assert out["held_out_accuracy"] == [(0, 0.0), (50, 0.1), (100, 0.2), (150, 0.4), (200, 0.7)]
    # On-policy after the warm-up: the teacher tokens stay at the warm-up's total.
    assert out["teacher_tokens"] == [(0, 0.0), (50, 300.0), (100, 600.0), (150, 600.0), (200, 600.0)]


def _finished_run(arm_dir, config: TrainConfig) -> None:
    arm_dir.mkdir(parents=True)
    (arm_dir / "config.json").write_text(config.model_dump_json())
    (arm_dir / "metrics.jsonl").write_text(json.dumps({"step": config.steps, "event": "eval"}) + "\n")


def test_a_run_without_a_stop_rule_is_reused_for_one_with_it_but_not_the_reverse(tmp_path):
    plain = train_config(output_dir=tmp_path / "a", steps=100)
    stopping = train_config(output_dir=tmp_path / "b", steps=100, stop_without_signal=20, stop_at_accuracy=0.9)
    _finished_run(tmp_path / "a", plain)
    _finished_run(tmp_path / "b", stopping)

    assert finished_with(tmp_path / "a", stopping)  # it ran on past any stop: its curves hold the stopped run's
    assert not finished_with(tmp_path / "b", plain)  # it may have stopped early
    assert not finished_with(tmp_path / "a", train_config(output_dir=tmp_path / "c", steps=100, learning_rate=1e-3))


def test_no_train_skips_a_missing_run_and_creates_nothing(tmp_path):
    args = argparse.Namespace(output=tmp_path, learning_rate=1e-3, steps=10, eval_every=5, eval_prompts=4,
                              engine="transformers", stop_at_accuracy=None, stop_without_signal=None, no_train=True,
                              eval_samples=8, train_rows=None)
    folder, fields = ARMS["long-methods"]["SFT (64x1) for half the updates, then on-policy GRPO at lr 2e-4 (8x8)"]
    with pytest.raises(NotRun, match="sft-warmup"):  # a warm-up arm stops at its missing warm-up
        run_arm("long-methods", folder, fields, args, seed=0)
    assert not any(tmp_path.iterdir())


def test_the_long_task_runs_its_core_arms_with_the_long_teacher():
    assert sorted(folder for folder, _ in ARMS["long-methods"].values()) == sorted(LONG_ARMS)
    task = train_config(output_dir="x", **TASKS["long-methods"])
    assert task.teacher == str(tinymodels.TEACHER_LONG_DIR)
    assert task.max_tokens == 21  # 20 answer digits and <eos>


def test_a_seed_that_stopped_early_counts_with_its_last_value_in_later_medians():
    from benchmarks.train_compare import summary

    curve = lambda *points: {"curves": {"held_out_accuracy": list(points)}}  # noqa: E731
    runs = {"arm": {0: curve((0, 0.1), (50, 0.9)),  # stopped at 50: reached the threshold
                    1: curve((0, 0.0), (50, 0.2), (100, 0.3)),
                    2: curve((0, 0.0), (50, 0.1), (100, 0.5))}}
    table = summary(runs, "held_out_accuracy")["arm"]
    assert table[50] == pytest.approx((0.2, 0.15, 0.55))
    # at 100 the first seed still counts, with 0.9: the median is over three seeds, not two
    assert table[100] == pytest.approx((0.5, 0.4, 0.7))


def test_teacher_tokens_count_the_batches_dropped_as_stale(tmp_path):
    from benchmarks.train_compare import curves

    records = [{"step": 0, "event": "eval", "held_out_accuracy": 0.0, "held_out_pass@8": 0.0},
               {"step": 1, "rollout_tokens": 100},
               {"step": 1, "event": "dropped_stale", "staleness": 2, "rollout_tokens": 40, "dropped_stale_batches": 1},
               {"step": 2, "rollout_tokens": 100, "held_out_accuracy": 0.5, "held_out_pass@8": 0.5}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert dict(curves(path)["teacher_tokens"]) == {0: 0.0, 2: 240.0}
    assert dict(curves(path, teacher=False)["teacher_tokens"]) == {0: 0.0, 2: 0.0}


def test_a_training_subset_is_the_datasets_first_rows_and_mixes_the_difficulties(tmp_path):
    from dualvllm.tinymodels.task import MIXED_DATA

    path = training_subset(MIXED_DATA["train"], 30, tmp_path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    full = [json.loads(line) for line in MIXED_DATA["train"].read_text().splitlines()[:30]]
    assert rows == full
    assert {row["difficulty"] for row in rows} == {"two-digit", "three-digit", "long"}
    assert training_subset(MIXED_DATA["train"], 30, tmp_path) == path  # written once, reused
    with pytest.raises(SystemExit, match="has only"):
        training_subset(MIXED_DATA["train"], 10**6, tmp_path)


def test_the_rank_test_is_against_the_arm_with_the_best_median_and_skips_arms_with_few_seeds():
    def arm(*overall):
        return {seed: {"test": {"overall": value}} for seed, value in enumerate(overall)}

    runs = {"low": arm(0.1, 0.12, 0.11, 0.13), "high": arm(0.3, 0.31, 0.29, 0.32), "alike": arm(0.3, 0.28, 0.32, 0.29),
            "two seeds": arm(0.0, 0.01)}
    best, p_values = against_the_best(runs)

    assert best == "high" and set(p_values) == {"low", "alike"}
    assert p_values["low"] < 0.05 < p_values["alike"]  # 4 against 4 entirely below: p = 2/70
