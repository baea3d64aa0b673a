"""`dualvllm train --engine transformers`: the whole recipe in this process, on the bundled models."""

from __future__ import annotations

import json
import math

import pytest

torch = pytest.importorskip("torch")
from tests.recipes import TINY_ARITH  # noqa: E402
from dualvllm.training.config import TrainConfig  # noqa: E402
from dualvllm.training.grpo import train_grpo  # noqa: E402
from dualvllm.common.errors import InvalidInputError  # noqa: E402

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
    from dualvllm.tinymodels.task import HARD_TEST, HARD_TRAIN
    from dualvllm.training import grpo

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


async def test_a_run_on_the_mixed_task_reports_each_difficulty_the_retained_skill_and_the_kl_from_start(tmp_path):
    from dualvllm.tinymodels.task import MIXED_DATA, RETAINED_TEST

    config = TrainConfig.parse(config_file=TINY_ARITH, output_dir=tmp_path / "run", engine="transformers", steps=2,
                               prompts_per_step=2, group_size=4, eval_every=2, eval_prompts=12, max_tokens=21, seed=0,
                               learning_rate=1e-2, dataset=MIXED_DATA["train"], eval_dataset=MIXED_DATA["val"],
                               retained_dataset=RETAINED_TEST, eval_group_by="difficulty", kl_from_start_prompts=6)
    report = await train_grpo(config, show_progress=False)

    first, last = [r for r in (json.loads(line) for line in report.metrics_path.read_text().splitlines())
                   if r.get("event") == "eval"]
    for record in (first, last):
        assert {"held_out_accuracy/two-digit", "held_out_accuracy/three-digit", "held_out_accuracy/long",
                "retained_accuracy", "retained_accuracy/hint, two-digit", "retained_accuracy/hint, three-digit",
                "kl_from_start", "kl_from_start_per_token"} <= set(record)
    assert first["kl_from_start"] == pytest.approx(0.0, abs=1e-9)  # the start itself
    assert last["kl_from_start"] > 1e-3  # two updates at a high rate moved it


async def test_the_kl_from_start_is_measured_from_kl_from_when_given(tmp_path):
    """SFT then GRPO starts its second stage from the first's checkpoint: --kl-from names the original
    model, so that the KL counts both stages. Here another model altogether: far from the start at once."""
    from dualvllm import tinymodels
    from dualvllm.tinymodels.task import MIXED_DATA

    config = TrainConfig.parse(config_file=TINY_ARITH, output_dir=tmp_path / "run", engine="transformers", steps=1,
                               prompts_per_step=2, group_size=2, eval_every=1, eval_prompts=2, max_tokens=21, seed=0,
                               dataset=MIXED_DATA["train"], base=str(tinymodels.BASE_MIXED_DIR),
                               kl_from=str(tinymodels.TEACHER_MIXED_DIR), kl_from_start_prompts=4)
    report = await train_grpo(config, show_progress=False)

    first = next(r for r in (json.loads(line) for line in report.metrics_path.read_text().splitlines())
                 if r.get("event") == "eval")
    assert first["step"] == 0 and first["kl_from_start"] > 1.0  # the base against the teacher, before any update


def test_kl_from_needs_the_kl_from_start_measured():
    with pytest.raises(InvalidInputError, match="--kl-from names the model --kl-from-start-prompts measures from"):
        TrainConfig.parse(config_file=TINY_ARITH, output_dir="x", kl_from=".")


def test_the_kl_from_start_is_the_full_vocabulary_kl_at_each_completion_state():
    import transformers

    from dualvllm import tinymodels
    from dualvllm.training.forgetting import state_kl
    from dualvllm.training.learner import pack
    from dualvllm.training.rollouts import Rollout

    base = transformers.AutoModelForCausalLM.from_pretrained(tinymodels.BASE_DIR).eval()
    teacher = transformers.AutoModelForCausalLM.from_pretrained(tinymodels.TEACHER_DIR).eval()
    rollouts = [Rollout((5, 6, 7), (8, 9, 1), (0.0,) * 3, (), "", 0.0), Rollout((5, 6), (12,), (0.0,), (), "", 0.0)]
    packed = pack(rollouts, pad_id=0)
    got = state_kl(base, teacher, packed, chunk=2)
    with torch.no_grad():
        expected = []
        for r in rollouts:
            ids = torch.tensor([list(r.prompt_ids) + list(r.completion_ids)])
            states = slice(len(r.prompt_ids) - 1, ids.shape[1] - 1)  # those that predict a completion token
            logp = base(ids).logits[0, states].double().log_softmax(-1)
            logq = teacher(ids).logits[0, states].double().log_softmax(-1)
            expected.append(float((logp.exp() * (logp - logq)).sum()))
    assert got.tolist() == pytest.approx(expected, rel=1e-5)
    assert state_kl(base, base, packed, chunk=4).tolist() == [0.0, 0.0]


async def test_the_adaptive_recipe_guides_the_prompts_its_base_never_solves(tmp_path):
    """On the hard task the bundled base is never right: every prompt's group is the teacher's
    samples plus two on-policy probes, and the probes keep it never-solved."""
    from dualvllm import tinymodels
    from dualvllm.tinymodels.task import HARD_TEST, HARD_TRAIN
    from dualvllm.training import checkpoint

    config = TrainConfig.parse(config_file=TINY_ARITH, output_dir=tmp_path / "run", engine="transformers",
                               method="adaptive", steps=4, prompts_per_step=2, group_size=4, eval_every=4,
                               eval_prompts=4, max_tokens=5, seed=0, dataset=HARD_TRAIN, eval_dataset=HARD_TEST,
                               teacher=str(tinymodels.TEACHER_HARD_DIR), max_staleness=4)
    report = await train_grpo(config, show_progress=False)

    updates = [r for r in (json.loads(line) for line in report.metrics_path.read_text().splitlines())
               if "event" not in r]
    assert len(updates) == 4 and all(math.isfinite(r["loss"]) for r in updates)
    assert updates[0]["regime/never"] >= 1  # measured by the first batch's on-policy groups
    guided = [r for r in updates if r["mean_alpha"] > 0]  # batches with teacher samples in them
    assert guided and all(r["distill_divergence"] > 0 for r in guided)
    state = json.loads((checkpoint.latest(tmp_path / "run") / "state.json").read_text())
    regimes = state["curriculum"]
    assert sum(r == 0 and e is not None for r, e in zip(regimes["regime"], regimes["ema"])) \
        == updates[-1]["regime/never"]


async def test_checkpoints_are_written_every_n_updates_and_after_the_last(tmp_path):
    from dualvllm.training import checkpoint

    fields = {"output_dir": tmp_path / "run", "engine": "transformers", "steps": 5, "checkpoint_every": 2,
              "keep_checkpoints": 5, "prompts_per_step": 2, "group_size": 2, "eval_every": 5, "eval_prompts": 2,
              "max_tokens": 4, "seed": 0}
    await train_grpo(TrainConfig.parse(config_file=TINY_ARITH, **fields), show_progress=False)
    saved = [p.name for p in checkpoint.all_checkpoints(tmp_path / "run")]
    assert saved == ["step-000002", "step-000004", "step-000005"]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    updates = [r for r in records if "event" not in r]
    # An update without a checkpoint spends (next to) nothing on one.
    assert [r["step_seconds/checkpoint"] < 0.01 for r in updates] == [True, False, True, False, False]


# checkpoint_every 1: the resumed run starts at update 2's checkpoint (and evaluates there);
# 10: killed before any checkpoint it keeps, it starts again from update 0, whose evaluation is logged.
@pytest.mark.parametrize(("checkpoint_every", "evaluated_at"), [(1, [0, 2, 3]), (10, [0, 3])])
async def test_a_run_killed_after_its_last_metrics_resumes_without_duplicates(tmp_path, checkpoint_every,
                                                                              evaluated_at):
    import shutil

    from dualvllm.training import checkpoint

    fields = {"output_dir": tmp_path / "run", "engine": "transformers", "method": "adaptive", "steps": 3,
              "checkpoint_every": checkpoint_every,
              "prompts_per_step": 2, "group_size": 3, "probe_rollouts": 1, "eval_every": 3, "eval_prompts": 4,
              "max_tokens": 4, "seed": 0}
    await train_grpo(TrainConfig.parse(config_file=TINY_ARITH, **fields), show_progress=False)
    newest = checkpoint.latest(tmp_path / "run")
    assert newest is not None and newest.name == "step-000003"
    shutil.rmtree(newest)  # killed after logging update 3 and its evaluation, before its checkpoint was complete
    with open(tmp_path / "run" / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write('{"step": 3, "loss"')  # and mid-line
    report = await train_grpo(TrainConfig.parse(config_file=TINY_ARITH, **fields), resume=True, show_progress=False)

    records = [json.loads(line) for line in report.metrics_path.read_text().splitlines()]
    assert [r["step"] for r in records if "event" not in r] == [1, 2, 3]
    assert [r["step"] for r in records if r.get("event") == "eval"] == evaluated_at  # + the resumed run's start
    assert report.steps_done == 3
