"""benchmarks/trl_settings.py's pure parts: the arms and their options, the cells' bookkeeping, the summary."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
from benchmarks import train_compare
from benchmarks.trl_settings import (CAPS, RESULT, TASKS, TRL_DEFAULT_CAP, Arm, arms, curves, diagnostics,
                                     print_table, run_cell, run_in_parallel, settings, timings)
from benchmarks.trl_compare import train_config
from dualvllm import tinymodels


def namespace(output: Path, **values) -> argparse.Namespace:
    return argparse.Namespace(**{"output": output, "steps": 3, "eval_every": 3, "eval_prompts": 20,
                                 "learning_rate": 2e-4, "no_train": False, **values})


def test_every_trl_mode_runs_at_every_cap_beside_trl_off_and_this_projects_corrections():
    every = arms()
    assert list(every)[:5] == ["ours-sequence", "ours-token", "ours-vespo", "ours-none", "trl-off"]
    assert TRL_DEFAULT_CAP in CAPS
    assert [f for f in every if f.startswith("trl-token_truncate")] == [
        "trl-token_truncate-cap2", "trl-token_truncate-cap3", "trl-token_truncate-cap10"]  # caps in order
    assert len(every) == 4 + 1 + 4 * 3
    assert list(arms((1.5, 3.0)))[-2:] == ["trl-sequence_mask-cap1.5", "trl-sequence_mask-cap3"]


def test_an_arm_maps_to_the_grpoconfig_options_that_choose_its_weighting():
    assert Arm(correction="token").trl_options() == {"correction": "token"}
    assert Arm().trl_options() == {"vllm_importance_sampling_correction": False}
    assert Arm(is_mode="sequence_mask", cap=3.0).trl_options() == {
        "vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "sequence_mask",
        "vllm_importance_sampling_clip_max": 3.0}


@pytest.mark.parametrize("fields", [{"cap": 2.0}, {"is_mode": "token_clip", "cap": 2.0}, {"is_mode": "token_mask"},
                                    {"correction": "token", "is_mode": "token_mask", "cap": 2.0},
                                    {"correction": "importance"}])
def test_an_arm_that_would_not_run_as_named_is_refused(fields):
    with pytest.raises(ValueError):
        Arm(**fields)


def test_each_task_trains_with_its_teacher_and_length_and_trl_arms_record_no_correction(tmp_path):
    args = namespace(tmp_path)
    hard = train_config(tmp_path, 0, args, correction=Arm(is_mode="token_mask", cap=2.0).correction or "none",
                        **TASKS["hard"])
    assert (hard.teacher, hard.max_tokens, hard.correction) == (str(tinymodels.TEACHER_HARD_DIR), 5, "none")
    arithmetic = train_config(tmp_path, 0, args, correction="sequence", **TASKS["arithmetic"])
    assert (arithmetic.teacher, arithmetic.max_tokens, arithmetic.prompts_per_step, arithmetic.group_size) == (
        None, 6, 8, 8)


def test_a_finished_cell_is_read_back_and_one_with_other_settings_refused(tmp_path):
    arm = Arm(is_mode="token_truncate", cap=2.0)
    args = namespace(tmp_path)
    cell = tmp_path / "hard" / "seed-0" / arm.folder
    cell.mkdir(parents=True)
    wanted = settings("hard", arm, 0, args)
    assert wanted["task_fields"]["dataset"] == "tinymodels/data/hard_train.jsonl"  # wherever the repository is
    (cell / RESULT).write_text(json.dumps({"settings": wanted, "held_out_accuracy": {"0": 0.0}}))
    assert run_cell("hard", arm, 0, args)["held_out_accuracy"] == {"0": 0.0}
    with pytest.raises(SystemExit, match="other settings"):
        run_cell("hard", arm, 0, namespace(tmp_path, learning_rate=1e-3))


def test_no_train_skips_a_missing_cell_and_creates_nothing(tmp_path):
    assert run_cell("arithmetic", Arm(), 0, namespace(tmp_path, no_train=True)) is None
    assert not any(tmp_path.iterdir())


def test_parallel_jobs_are_the_unfinished_cells_each_named_in_full(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(train_compare, "run_pinned", lambda script, jobs, cores: ran.extend(jobs))
    monkeypatch.setattr("sys.argv", ["trl_settings.py", "--seeds", "0", "1", "--jobs", "2", "--steps", "3"])
    done = tmp_path / "arithmetic" / "seed-0" / "trl-off"
    done.mkdir(parents=True)
    (done / RESULT).write_text("{}")
    chosen = {f: a for f, a in arms().items() if f in ("trl-off", "ours-none")}
    run_in_parallel(namespace(tmp_path, tasks=["arithmetic"], seeds=[0, 1], arms=None, jobs=2), chosen)
    assert [(argv, log.relative_to(tmp_path)) for argv, log in ran] == [
        (["--steps", "3", "--tasks", "arithmetic", "--seeds", "0", "--arms", "ours-none", "--no-summary"],
         Path("arithmetic/seed-0/ours-none.log")),
        (["--steps", "3", "--tasks", "arithmetic", "--seeds", "1", "--arms", "ours-none", "--no-summary"],
         Path("arithmetic/seed-1/ours-none.log")),
        (["--steps", "3", "--tasks", "arithmetic", "--seeds", "1", "--arms", "trl-off", "--no-summary"],
         Path("arithmetic/seed-1/trl-off.log")),
    ]


def test_argv_without_drops_each_option_and_its_values():
    argv = ["--seeds", "0", "1", "--steps", "3", "--arms", "a", "--jobs", "2"]
    assert train_compare.argv_without(argv, {"--seeds": 2, "--arms": 1, "--jobs": 1}) == ["--steps", "3"]
    assert train_compare.argv_without(argv, {"--tasks": 1}) == argv  # an option not given


def test_the_summary_reads_a_cells_evaluations_by_update(capsys):
    cell = {"held_out_accuracy": {"25": 0.3, "0": 0.25}, "answer_logprob_nats": {"0": -26.8}, "eval_s": {"0": 2.0}}
    assert curves(cell) == {"held_out_accuracy": [(0, 0.25), (25, 0.3)], "answer_logprob_nats": [(0, -26.8)]}
    assert curves({"held_out_accuracy": {}}) == {"held_out_accuracy": []}

    table = train_compare.summary({"trl-off": {0: {"curves": curves(cell)}, 1: {"curves": curves(
        {"held_out_accuracy": {"0": 0.25, "25": 0.4}})}}}, "held_out_accuracy")
    print_table(table, "accuracy", 100, "%")
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].split() == ["trl-off", "25.0", "[25.0,", "25.0]", "35.0", "[32.5,", "37.5]"]


def test_timings_leave_each_runs_first_update_to_the_rest_of_the_run():
    cell = {"update_s": [9.0, 1.0, 3.0], "eval_s": {"0": 2.0, "25": 4.0}, "wall_s": 20.0}
    runs = {"trl-off": {0: cell, 1: {**cell, "update_s": [9.0, 5.0], "wall_s": 30.0}}}
    # updates 1, 3 and 5 s; evaluations 2, 4, 2, 4 s; the rest 20 - 4 - 6 = 10 and 30 - 5 - 6 = 19 s
    assert timings(runs) == {"trl-off": {"update_s": 3.0, "eval_s": 3.0, "rest_s": 14.5}}


def test_diagnostics_average_what_trl_logged_over_every_update_of_every_seed():
    first = {"log_history": [{"reward": 0.5, "sampling/importance_sampling_ratio/mean": 0.2, "loss": 1.0},
                             {"reward": 0.7, "sampling/importance_sampling_ratio/mean": 0.4},
                             {"train_runtime": 3.0}]}  # TRL's closing entry: no update
    second = {"log_history": [{"reward": 0.9, "sampling/importance_sampling_ratio/mean": 0.9}]}
    out = diagnostics({"trl-token_mask-cap2": {0: first, 1: second}, "ours-none": {0: {"log_history": []}}})
    assert out["trl-token_mask-cap2"] == pytest.approx({"reward": 0.7, "sampling/importance_sampling_ratio/mean": 0.5})
    assert out["ours-none"] == {}
