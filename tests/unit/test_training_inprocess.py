"""`dualvllm train --engine transformers`: the whole recipe in this process, on the bundled models."""

from __future__ import annotations

import json
import math

import pytest

torch = pytest.importorskip("torch")
from tests.recipes import TINY_ARITH  # noqa: E402
from training.config import TrainConfig  # noqa: E402
from training.grpo import train_grpo  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("fields", [{}, {"method": "sft", "distill_coef": 1.0},
                                    {"method": "distill", "fixed_alpha": 1.0, "group_size": 1, "prompts_per_step": 8},
                                    {"teacher": "self", "teacher_template": "{answer} {prompt}"}],
                         ids=["grpo", "sft-distill", "distill-teacher-states-one-per-prompt", "self-teacher"])
async def test_the_recipe_trains_in_process_from_live_weights(tmp_path, fields):
    config = TrainConfig.parse(config_file=TINY_ARITH, **{"output_dir": tmp_path / "run", "engine": "transformers", "steps": 3,
                            "prompts_per_step": 2, "group_size": 4, "eval_every": 3, "eval_prompts": 8,
                            "max_tokens": 4, "seed": 0, **fields})
    report = await train_grpo(config, show_progress=False)

    records = [json.loads(line) for line in report.metrics_path.read_text().splitlines()]
    updates = [r for r in records if "event" not in r]
    assert [r["step"] for r in updates] == [1, 2, 3]
    assert [r["policy_version"] for r in updates] == [1, 2, 3]  # every update is live at once
    assert all(math.isfinite(r["loss"]) and "push_max_abs_diff" not in r for r in updates)
    assert [r["step"] for r in records if r.get("event") == "eval"] == [0, 3]
    if config.method in ("sft", "distill"):
        assert all(r["mean_alpha"] == 1.0 and r["distill_divergence"] > 0 for r in updates)
    assert (tmp_path / "run" / "checkpoints" / "step-000003").is_dir()


async def test_a_grpo_run_without_signal_stops_at_stop_without_signal(tmp_path, monkeypatch, caplog):
    """On the hard task the bundled base is never right, so on-policy groups all score 0: no signal."""
    from tinymodels.task import HARD_TEST, HARD_TRAIN
    from training import grpo

    monkeypatch.setattr(grpo, "NO_SIGNAL_WARNING_STEPS", 1)

    config = TrainConfig.parse(config_file=TINY_ARITH, output_dir=tmp_path / "run", engine="transformers", steps=10,
                               prompts_per_step=2, group_size=4, eval_every=5, eval_prompts=8, max_tokens=5, seed=0,
                               fixed_alpha=0.0, dataset=HARD_TRAIN, eval_dataset=HARD_TEST, stop_without_signal=2)
    report = await train_grpo(config, show_progress=False)

    records = [json.loads(line) for line in report.metrics_path.read_text().splitlines()]
    assert [r["zero_advantage_groups"] for r in records if "event" not in r] == [1.0, 1.0]
    assert report.steps_done == 2
    assert [r["step"] for r in records if r.get("event") == "eval"] == [0, 2]  # the last update is evaluated
    warnings = [r.getMessage() for r in caplog.records if "zero advantage" in r.getMessage()]
    assert len(warnings) == 1 and "--method distill" in warnings[0]  # told once, with what to do


async def test_a_grpo_run_with_signal_goes_on_past_stop_without_signal(tmp_path):
    config = TrainConfig.parse(config_file=TINY_ARITH, output_dir=tmp_path / "run", engine="transformers", steps=3,
                               prompts_per_step=4, group_size=4, eval_every=3, eval_prompts=8, max_tokens=4, seed=0,
                               fixed_alpha=0.0, stop_without_signal=1)
    report = await train_grpo(config, show_progress=False)

    records = [json.loads(line) for line in report.metrics_path.read_text().splitlines()]
    assert records[1]["zero_advantage_groups"] < 1.0  # the two-digit task: the base is right ~27% of the time
    assert report.steps_done == 3
