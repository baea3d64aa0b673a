"""Same budget, different rollout sources: GRPO arms compared on a bundled task, over seeds.

    python benchmarks/train_compare.py --steps 150 --eval-every 50                  # the arithmetic task
    python benchmarks/train_compare.py --task hard --seeds 0 1 2 --steps 100 --eval-every 25
    python benchmarks/train_compare.py --task hard-methods --engine transformers --steps 1000 --eval-every 100 \
        --learning-rate 1e-3 --stop-at-accuracy 0.9 --arms distill-teacher distill-qstar grpo-on-policy ...

Each arm is a full `dualvllm train` run (its own servers; same seed, prompts per step,
group size, learning rate and held-out prompts) in OUTPUT/<task>/lr-<lr>/seed-<s>/<arm>/; the
summary (train_compare.json, train_compare.png) goes to OUTPUT/<task>/lr-<lr>/. Finished runs
are read back, not rerun, so a call naming every arm and seed only summarises.

- `--task arithmetic` (two-digit sums, which the bundled base gets ~27% right):
  on-policy (alpha = 0), q* with each off-policy correction, teacher-only (alpha = 1).
- `--task hard` (three-digit sums, tinymodels/data/hard_*.jsonl: the base never saw one,
  the hard teacher was trained on them): on-policy; q* with the hard teacher; q* with a
  privileged-information teacher (the base itself shown the answer: `--teacher self
  --teacher-template "{answer} {prompt}"`, no teacher model); on-policy with `--curriculum`.

- `--task hard-methods` (issue 24's comparison, 64 rollouts per update as 8 prompts x 8 or
  64 x 1): with the hard teacher, on-policy GRPO, SFT on teacher samples (alone, and for half
  the updates before on-policy GRPO), on-policy distillation, q*-GRPO (no correction, + forward
  KL, + the OPD term, vespo, sequence IS, pooled with LUFFY's shaping, an alpha schedule),
  forward KL on teacher / q* / base states, rejection fine-tuning on q*; and the hint-reading
  base (tinymodels/base-hint) as its own privileged-information teacher.
- `--task long-methods` (the long task: 20-digit answers, tinymodels/teacher-long): the core
  arms of hard-methods and its two forward-KL arms (LONG_ARMS).

- `--task mixed-methods` (issue 43: two-digit, three-digit and long problems in one dataset,
  tinymodels/base-mixed and teacher-mixed): the adaptive recipe against every single method at
  one shape (16 prompts x 4), GRPO arms at 2e-4 and dense ones at --learning-rate; validation
  accuracy per difficulty, the retained skill (hint copying) and the KL from the start at every
  evaluation, the test split scored once at the end. The sweep behind its table:

      python benchmarks/train_compare.py --task mixed-methods --engine transformers --jobs 2 \
          --learning-rate 1e-3 --steps 1000 --eval-every 250 --eval-samples 0 --eval-prompts 300 \
          --train-rows 3000 --seeds 0 1 2

  (`--train-rows 3000`: the first 3,000 training rows, visited over 5 epochs, so that each
  prompt's own pass-rate history matters; `--eval-samples 0`: greedy accuracy only.)

`--engine transformers` runs the arms in process (minutes per 1,000 updates);
`--stop-at-accuracy 0.9` ends an arm at two evaluations in a row above 90%.

At each evaluation: held-out greedy accuracy and pass@8 of the base, and over the
updates since the last evaluation the fraction of groups with zero advantage (all
rollouts scored alike: no signal), the ESS ratio of the sequence weights and the mean
reward of the rollouts (how often the sampler, q* or the base, was right). Prints the
mean ± spread (half the range) over seeds per arm and step, writes JSON and a plot.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import TypeAdapter

from dualvllm import tinymodels
from dualvllm.tinymodels.task import (HARD_TEST, HARD_TRAIN, HINT_TEMPLATE, LONG_DIGITS, LONG_TEST, LONG_TRAIN, MIXED_DATA,
                             RETAINED_TEST)
from dualvllm.common import loop
from dualvllm.training.config import TRAIN_OPTIONS, TrainConfig
from dualvllm.training.config_sources import read_recipe
from dualvllm.training.grpo import train_grpo

# Every arm starts from the bundled models' recipe (the values `dualvllm train` took by default
# before its defaults became a real LLM's); a task's and an arm's fields override it.
RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny-arith.yaml"

# name -> (output folder, training options of the arm)
ARMS = {
    "arithmetic": {
        "on-policy (alpha=0)": ("on-policy", {"fixed_alpha": 0.0}),
        "q* (alpha*), sequence IS": ("qstar-sequence", {}),
        "q* (alpha*), token TIS": ("qstar-token", {"correction": "token"}),
        "teacher-only (alpha=1)": ("teacher-only", {"fixed_alpha": 1.0}),
    },
    "hard": {
        "on-policy (alpha=0)": ("on-policy", {"fixed_alpha": 0.0}),
        "q* (hard teacher)": ("qstar-teacher", {"teacher": str(tinymodels.TEACHER_HARD_DIR)}),
        "q* (hard teacher), token TIS": ("qstar-teacher-token", {"teacher": str(tinymodels.TEACHER_HARD_DIR),
                                                                  "correction": "token"}),
        "q* (hard teacher), no correction": ("qstar-teacher-none", {"teacher": str(tinymodels.TEACHER_HARD_DIR),
                                                                    "correction": "none"}),
        "q* (self + answer)": ("qstar-self", {"teacher": "self", "teacher_template": "{answer} {prompt}"}),
        "on-policy + curriculum": ("on-policy-curriculum", {"fixed_alpha": 0.0, "curriculum": True}),
    },
}
# Issue 24's comparison on the hard task: every arm takes 64 rollouts per update, as 8 prompts
# x 8 (grpo needs groups) or 64 x 1 (the methods that train on each rollout alone).
WIDE = {"prompts_per_step": 64, "group_size": 1}
GROUPS = {"prompts_per_step": 8, "group_size": 8}  # grpo's default shape; the dense methods' is WIDE since issue 55
# An arm's fields may start with a warm-up run: (its folder, its fields, its share of --steps); see run_arm.
WARMUP = "warmup"
ARMS["hard-methods"] = {
    "on-policy GRPO (8x8)": ("grpo-on-policy", {"fixed_alpha": 0.0}),
    "SFT on teacher samples (64x1)": ("sft-teacher", {"method": "sft", **WIDE}),
    "SFT on teacher samples (64x1) for half the updates, then on-policy GRPO (8x8)": (
        "sft-then-grpo", {"fixed_alpha": 0.0, WARMUP: ("sft-warmup", {"method": "sft", **WIDE}, 0.5)}),
    # GRPO collapsed at the SFT arm's learning rate (1e-3 and 2e-3); as SFT-then-RL recipes do,
    # the RL phase here runs at a tenth of it, whatever --learning-rate says.
    "SFT (64x1) for half the updates, then on-policy GRPO at lr 2e-4 (8x8)": (
        "sft-then-grpo-lr2e-4", {"fixed_alpha": 0.0, "learning_rate": 2e-4,
                                 WARMUP: ("sft-warmup", {"method": "sft", **WIDE}, 0.5)}),
    "on-policy distillation (64x1)": ("opd", {"method": "opd", **WIDE}),
    "q*-GRPO, no correction (8x8)": ("qstar-grpo-none", {"correction": "none"}),
    "q*-GRPO + forward KL (8x8)": ("qstar-grpo-kl", {"correction": "none", "distill_coef": 1.0}),
    "q*-GRPO + OPD term (8x8)": ("qstar-grpo-opd", {"correction": "none", "opd_coef": 1.0}),
    "forward KL, teacher states (64x1)": ("distill-teacher", {"method": "distill", "fixed_alpha": 1.0, **WIDE}),
    "forward KL, q* states (64x1)": ("distill-qstar", {"method": "distill", **WIDE}),
    "forward KL, base states (64x1)": ("distill-base", {"method": "distill", "fixed_alpha": 0.0, **WIDE}),
    "forward KL, teacher states (8x8)": ("distill-teacher-8x8", {"method": "distill", "fixed_alpha": 1.0, **GROUPS}),
    "forward KL, q* states (8x8)": ("distill-qstar-8x8", {"method": "distill", **GROUPS}),
    "RFT on q* (64x1)": ("rft-qstar", {"method": "rft", **WIDE}),
    "q*-GRPO, vespo (8x8)": ("qstar-grpo-vespo", {"correction": "vespo"}),
    "q*-GRPO, sequence IS (8x8)": ("qstar-grpo-sequence", {}),
    "q* pooled 4+4, LUFFY (8x8)": ("qstar-pooled-luffy", {"correction": "none", "on_policy_rollouts": 4,
                                                          "guided_shaping": 0.1}),
    "q*-GRPO, alpha cap 1 -> 0 over 500 (8x8)": ("qstar-grpo-schedule", {"correction": "none",
                                                                         "alpha_decay_steps": 500}),
}
# The privileged-information self-teacher: the hint-reading base is both the student (asked the
# question) and the teacher (asked with the answer in front), at its starting weights (self-frozen)
# or its current ones (self). Its own start, not the bundled base: these arms compare among themselves.
SELF = {"base": str(tinymodels.BASE_HINT_DIR), "teacher_template": HINT_TEMPLATE}
ARMS["hard-methods"] |= {
    "on-policy GRPO from the hint-reading base (8x8)": (
        "hint-base-grpo-on-policy", {"base": str(tinymodels.BASE_HINT_DIR), "fixed_alpha": 0.0}),
    "self-teacher q*-GRPO, no correction (8x8)": ("self-qstar-grpo", {**SELF, "teacher": "self", "correction": "none"}),
    "self-teacher (frozen) q*-GRPO, no correction (8x8)": (
        "self-frozen-qstar-grpo", {**SELF, "teacher": "self-frozen", "correction": "none"}),
    "forward KL, self-teacher (frozen) q* states (64x1)": (
        "self-frozen-distill-qstar", {**SELF, "teacher": "self-frozen", "method": "distill", **WIDE}),
    "forward KL, self-teacher (frozen) states (64x1)": (
        "self-frozen-distill-teacher", {**SELF, "teacher": "self-frozen", "method": "distill", "fixed_alpha": 1.0,
                                        **WIDE}),
}
# The long task (20-digit answers, tinymodels/teacher-long): the issue's core arms and the two
# forward-KL arms that learned the hard task.
LONG_ARMS = ("grpo-on-policy", "sft-teacher", "sft-then-grpo-lr2e-4", "opd", "qstar-grpo-none", "qstar-grpo-kl",
             "qstar-grpo-opd", "distill-teacher", "distill-qstar")
ARMS["long-methods"] = {name: arm for name, arm in ARMS["hard-methods"].items() if arm[0] in LONG_ARMS}
# The mixed task (issue 43): two-digit, three-digit and long problems in one dataset, its own pair
# (tinymodels/base-mixed keeps a skill the training never asks for: copying a hint), every arm at
# one shape, 16 prompts x 4 rollouts, so that no comparison is a shape's. Runs select (stop early,
# best on the way) on the validation split only; the test split is scored once, at the end.
MATCHED = {"prompts_per_step": 16, "group_size": 4}
# Each family at its own learning rate: the dense methods (SFT, forward KL, and the adaptive recipe,
# whose never-solved prompts are trained by forward KL) at the sweep's --learning-rate (1e-3 learned
# the hard task); GRPO at 2e-4. At 1e-3 GRPO collapsed here (on-policy, seed 0: rewards 0 from
# update ~200, two-digit validation accuracy 0.31 -> 0.02, KL from the start 18.5 nats by update 250)
# as it did on the hard task ("Seeds, learning rates, SFT then GRPO" in benchmarks/README.md).
GRPO_LR = {"learning_rate": 2e-4}
ARMS["mixed-methods"] = {
    "adaptive (per-prompt regimes)": ("adaptive", {"method": "adaptive", **MATCHED}),
    "on-policy GRPO": ("grpo-on-policy", {"fixed_alpha": 0.0, **GRPO_LR, **MATCHED}),
    "q*-GRPO, sequence IS": ("qstar-grpo-sequence", {**GRPO_LR, **MATCHED}),
    "SFT on teacher samples": ("sft-teacher", {"method": "sft", **MATCHED}),
    "SFT for half the updates, then on-policy GRPO": (
        "sft-then-grpo", {"fixed_alpha": 0.0, **GRPO_LR, **MATCHED,
                          WARMUP: ("sft-warmup", {"method": "sft", **MATCHED}, 0.5)}),
    "forward KL, teacher states": ("distill-teacher", {"method": "distill", "fixed_alpha": 1.0, **MATCHED}),
    "forward KL, q* states": ("distill-qstar", {"method": "distill", **MATCHED}),
    # On-policy distillation alone: its per-token advantage is the whole loss, and Adam's step does
    # not scale with a loss's coefficient, so one coefficient. Beside q*-GRPO's group advantages
    # (about +-2) the OPD term's scale matters (8-10 nats per token on the hard task): three
    # coefficients, a decade apart.
    # The same lr as GRPO's: whether the dense arms' forgetting is their objective's or their rate's.
    "adaptive, lr 2e-4": ("adaptive-lr2e-4", {"method": "adaptive", **GRPO_LR, **MATCHED}),
    "forward KL, teacher states, lr 2e-4": (
        "distill-teacher-lr2e-4", {"method": "distill", "fixed_alpha": 1.0, **GRPO_LR, **MATCHED}),
    "on-policy distillation": ("opd", {"method": "opd", **MATCHED}),
    **{f"q*-GRPO + OPD term, coefficient {c:g}": (f"qstar-grpo-opd-{c:g}", {"opd_coef": c, **GRPO_LR, **MATCHED})
       for c in (0.03, 0.1, 0.3)},
}
TASKS = {  # training options of each task
    "arithmetic": {},
    "hard": {"dataset": HARD_TRAIN, "eval_dataset": HARD_TEST, "max_tokens": 5},
    "hard-methods": {"dataset": HARD_TRAIN, "eval_dataset": HARD_TEST, "max_tokens": 5,
                     "teacher": str(tinymodels.TEACHER_HARD_DIR)},
    "long-methods": {"dataset": LONG_TRAIN, "eval_dataset": LONG_TEST, "max_tokens": LONG_DIGITS + 2,
                     "teacher": str(tinymodels.TEACHER_LONG_DIR)},
    "mixed-methods": {"dataset": MIXED_DATA["train"], "eval_dataset": MIXED_DATA["val"],
                      "retained_dataset": RETAINED_TEST, "eval_group_by": "difficulty",
                      "max_tokens": LONG_DIGITS + 2, "base": str(tinymodels.BASE_MIXED_DIR),
                      "teacher": str(tinymodels.TEACHER_MIXED_DIR), "kl_from_start_prompts": 64},
}
MILESTONES = (0.25, 0.5, 0.9)
STOP_RULES = ("stop_at_accuracy", "stop_without_signal")
CURVES = ("held_out_accuracy", "held_out_pass@8", "zero_advantage_groups", "ess_ratio", "reward_mean",
          "teacher_tokens", "kl_from_start", "retained_accuracy")
EVAL_CURVES = ("held_out_accuracy", "held_out_pass@8", "kl_from_start", "retained_accuracy")  # as evaluated
GROUPED_CURVES = ("held_out_accuracy/", "retained_accuracy/")  # per difficulty (--eval-group-by), as evaluated
TRAINING_CURVES = ("zero_advantage_groups", "ess_ratio", "reward_mean")  # averaged over the updates between evals


def uses_teacher(config: TrainConfig) -> bool:
    """Whether the arm needs the teacher's tokens: all but plain on-policy GRPO."""
    return not (config.method == "grpo" and config.sampling_alpha == 0.0 and not config.teacher_advantage_coef
                and not config.distillation_coef)


def curves(metrics_path: Path, teacher: bool = True) -> dict[str, list[tuple[int, float]]]:
    """Per metric, (step, value): evaluations as they are; training metrics averaged since the last
    evaluation; teacher_tokens summed over every batch sampled so far, the batches dropped as stale
    included (the teacher was queried for them), 0 for an arm without a teacher."""
    records = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    grouped = sorted({key for record in records for key in record if key.startswith(GROUPED_CURVES)})
    out: dict[str, dict[int, float]] = {name: {} for name in (*CURVES, *grouped)}
    pending: dict[str, list[float]] = {name: [] for name in TRAINING_CURVES}
    consumed = 0.0
    for record in records:
        if teacher and record.get("event") in (None, "dropped_stale"):
            consumed += record.get("rollout_tokens", 0)
        if "held_out_accuracy" in record:
            out["teacher_tokens"][record["step"]] = consumed
        for name in pending:
            if name in record:
                pending[name].append(record[name])
        if "held_out_accuracy" in record:
            step = record["step"]
            for name in (*EVAL_CURVES, *grouped):
                if name in record:
                    out[name][step] = record[name]
            for name, values in pending.items():
                if values:
                    out[name][step] = float(np.mean(values))
                    values.clear()
    return {name: sorted(points.items()) for name, points in out.items()}


def run_arm(task: str, folder: str, fields: dict, args: argparse.Namespace, seed: int) -> dict:
    """One arm's curves: trained now, or read back from a finished run with the same settings.

    An arm with a warm-up (`WARMUP` in its fields: folder, fields, share of --steps) first runs the
    warm-up arm for that share of the updates, then the arm itself from the warm-up's last
    checkpoint for the rest of --steps (SFT-then-RL as it is done: two runs, the second starting
    from the first's weights, a fresh optimizer); its curves are the two runs end to end."""
    fields = dict(fields)
    warmup = fields.pop(WARMUP, None)
    seed_dir = args.output / task / f"lr-{args.learning_rate:g}" / f"seed-{seed}"
    if warmup is None:
        return train_or_reuse(seed_dir / folder, task, fields, args, seed, args.steps)
    warm_folder, warm_fields, share = warmup
    warm_steps = max(1, round(args.steps * share))
    first = train_or_reuse(seed_dir / warm_folder, task, warm_fields, args, seed, warm_steps)
    from dualvllm.training import checkpoint as checkpoints

    start = checkpoints.latest(seed_dir / warm_folder)
    assert start is not None, f"{seed_dir / warm_folder} has no checkpoint"
    second = {**fields, "base": str(start)}
    if TASKS[task].get("kl_from_start_prompts"):  # the KL from the task's own base, across both stages
        second["kl_from"] = TASKS[task].get("base", str(tinymodels.BASE_DIR))
    then = train_or_reuse(seed_dir / folder, task, second, args, seed, args.steps - first["steps_done"])
    return {"fields": {**then["fields"], "warmup": f"{warm_folder} for {first['steps_done']} updates"},
            "curves": joined(first["curves"], then["curves"], first["steps_done"]),
            "steps_done": first["steps_done"] + then["steps_done"]}


class NotRun(Exception):
    """--no-train and the run is not there to read back."""


def train_or_reuse(arm_dir: Path, task: str, fields: dict, args: argparse.Namespace, seed: int, steps: int) -> dict:
    """Train one run of `steps` updates into `arm_dir`, or read back a finished one with the same settings."""
    options = {"output_dir": arm_dir, "steps": steps, "eval_every": args.eval_every,
               "learning_rate": args.learning_rate, "seed": seed, "eval_prompts": args.eval_prompts,
               "eval_samples": args.eval_samples, "pass_k": (1, 8) if args.eval_samples >= 8 else (),
               "engine": args.engine, **TASKS[task], **fields}
    if args.train_rows is not None:
        options["dataset"] = training_subset(Path(options["dataset"]), args.train_rows, args.output / task)
    if args.stop_at_accuracy is not None:
        options["stop_at_accuracy"] = args.stop_at_accuracy
    if args.stop_without_signal is not None and options.get("method", "grpo") == "grpo":
        options["stop_without_signal"] = args.stop_without_signal
    config = TrainConfig.parse(config_file=RECIPE, **options)
    described = {k: str(v) for k, v in fields.items()}
    if arm_dir.exists():
        # Runs take minutes each: seeds and arms added later reuse the finished ones.
        if finished_with(arm_dir, config):
            print(f"reusing {arm_dir} (finished, same settings)")
            metrics = arm_dir / "metrics.jsonl"
            records = [json.loads(line) for line in metrics.read_text().splitlines()]
            # The first run's wall time is not recorded; its updates' time is (evaluations left out).
            return {"fields": described, "curves": curves(metrics, uses_teacher(config)), "reused": True,
                    "steps_done": records[-1]["step"], "update_s": sum(r.get("step_seconds", 0.0) for r in records)}
        from dualvllm.training import checkpoint as checkpoints

        if not (same_settings(arm_dir, config) and checkpoints.latest(arm_dir) is not None):
            raise SystemExit(f"{arm_dir} exists but was run with other settings, or holds no checkpoint; "
                             "remove it or pass another --output")
    if args.no_train:
        raise NotRun(arm_dir)
    started = time.perf_counter()
    # An interrupted run (same settings, a checkpoint) resumes where it stopped, without duplicates.
    report = loop.run(train_grpo(config, resume=arm_dir.exists(), show_progress=True))
    return {"fields": described, "curves": curves(report.metrics_path, uses_teacher(config)),
            "dropped_stale_batches": report.dropped_stale_batches, "steps_done": report.steps_done,
            "wall_s": time.perf_counter() - started}


def training_subset(dataset: Path, rows: int, folder: Path) -> Path:
    """The first `rows` rows of `dataset`, written once into `folder` (the mixed task's rows interleave
    its difficulties, so any prefix mixes them): a smaller set that a sweep's updates visit over
    several epochs, as an RL run visits its dataset, so that per-prompt history matters."""
    lines = dataset.read_text().splitlines(keepends=True)
    if rows > len(lines):
        raise SystemExit(f"--train-rows {rows}: {dataset} has only {len(lines)} rows")
    path = folder / f"{dataset.stem}-first-{rows}.jsonl"
    if not path.exists():  # parallel jobs may write it together: each whole, by rename
        folder.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        partial.write_text("".join(lines[:rows]))
        partial.replace(path)
    return path


def joined(first: dict[str, list[tuple[int, float]]], then: dict[str, list[tuple[int, float]]],
           offset: int) -> dict[str, list[tuple[int, float]]]:
    """Two runs' curves end to end: the second's steps shifted by `offset` (its step 0 evaluation is
    the first's last, so it is dropped), its teacher tokens added to the first's total."""
    consumed = first["teacher_tokens"][-1][1] if first["teacher_tokens"] else 0.0
    out = {}
    for name, points in first.items():
        shift = consumed if name == "teacher_tokens" else 0.0
        out[name] = points + [(step + offset, value + shift) for step, value in then[name] if step > 0]
    return out


def answer_logprob(arm_dir: Path, task: str) -> float:
    """Mean log p(right answer + EOS | prompt) of the run's last checkpoint on the task's 500 test
    problems, in nats: moves long before greedy accuracy does (the bundled base: -26.8 on the hard task)."""
    import torch
    from transformers import Qwen2ForCausalLM, Qwen2Tokenizer

    from dualvllm.training import checkpoint as checkpoints

    checkpoint = checkpoints.latest(arm_dir)  # an arm that stopped early ends before `steps`
    assert checkpoint is not None, f"{arm_dir} has no checkpoint"
    model = Qwen2ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    return model_answer_logprob(model, Qwen2Tokenizer.from_pretrained(checkpoint), task)


def model_answer_logprob(model: Any, tokenizer: Any, task: str) -> float:
    """Mean log p(right answer + EOS | prompt) of `model` on the task's 500 test problems, in nats (the hard
    task's, or with a task named long* the long task's); `model` is left in the mode it was in."""
    import torch

    from dualvllm.tinymodels.build import HARD_MAX_LEN, LONG_MAX_LEN, answer_logprob as mean_answer_logprob
    from dualvllm.tinymodels.task import HARD_ROWS, LONG_ROWS, hard_problems, long_problems

    training = model.training
    try:
        with torch.no_grad():
            if task.startswith("long"):
                return mean_answer_logprob(model, tokenizer, long_problems("test", LONG_ROWS["test"]), LONG_MAX_LEN)
            return mean_answer_logprob(model, tokenizer, hard_problems("test", HARD_ROWS["test"]), HARD_MAX_LEN)
    finally:
        model.train(training)


def test_scores(arm_dir: Path) -> dict[str, float]:
    """The mixed task's test split, scored once at the run's end (every selection was made on the
    validation split): greedy accuracy of the last checkpoint per difficulty, overall, and on
    the retained skill."""
    import torch
    from transformers import Qwen2ForCausalLM, Qwen2Tokenizer

    from dualvllm.tinymodels.build import difficulty_accuracy
    from dualvllm.training import checkpoint as checkpoints

    checkpoint = checkpoints.latest(arm_dir)
    assert checkpoint is not None, f"{arm_dir} has no checkpoint"
    cached = arm_dir / "test_scores.json"  # scored by the job that trained it: --jobs N scores in parallel too
    if cached.exists() and (saved := json.loads(cached.read_text()))["checkpoint"] == checkpoint.name:
        return saved["scores"]
    model = Qwen2ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    scores = difficulty_accuracy(model, Qwen2Tokenizer.from_pretrained(checkpoint), "test")
    kept = scores.pop("retained (hint copying)")
    scores = {**scores, "overall": float(np.mean(list(scores.values()))), "retained": kept}
    cached.write_text(json.dumps({"checkpoint": checkpoint.name, "scores": scores}) + "\n")
    return scores


def wanted_default(config: TrainConfig, key: str) -> object:
    """The default of one of `config`'s fields as config.json stores it."""
    field = type(config).model_fields[key]
    return TypeAdapter(field.annotation).dump_python(field.get_default(call_default_factory=True), mode="json")


def same_settings(arm_dir: Path, config: TrainConfig) -> bool:
    """Whether `arm_dir` holds a run (finished or not) of `config`."""
    try:
        saved = json.loads((arm_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    wanted = json.loads(config.model_dump_json())
    # A field added since the run was made holds its default there. A run made without a stop
    # rule ran on past where the rule would have stopped it: its curves hold the stopped run's.
    return all(saved.get(key, wanted_default(config, key)) in (value, *((None,) if key in STOP_RULES else ()))
               for key, value in wanted.items() if key != "output_dir")


def finished_with(arm_dir: Path, config: TrainConfig) -> bool:
    """Whether `arm_dir` holds a run of `config` that reached its last step's evaluation."""
    try:
        records = [json.loads(line) for line in (arm_dir / "metrics.jsonl").read_text().splitlines()]
    except (OSError, ValueError):
        return False
    return same_settings(arm_dir, config) and bool(records) and records[-1].get("event") == "eval"


def summary(runs: dict[str, dict[int, dict]], metric: str) -> dict[str, dict[int, tuple[float, float, float]]]:
    """arm -> step -> (median, 25th, 75th percentile) of `metric` over the arm's seeds. A seed
    that stopped early (--stop-at-accuracy, --stop-without-signal) counts at every later step
    with its last value, so the later medians are over every seed, not over the ones still
    running."""
    table: dict[str, dict[int, tuple[float, float, float]]] = {}
    for arm, by_seed in runs.items():
        curves = [dict(run["curves"][metric]) for run in by_seed.values() if metric in run["curves"]]
        steps = sorted({step for curve in curves for step in curve})
        rows: dict[int, tuple[float, float, float]] = {}
        for step in steps:
            values = [curve[max(s for s in curve if s <= step)] for curve in curves
                      if any(s <= step for s in curve)]  # a seed's last value at or before the step
            low, median, high = np.percentile(values, [25, 50, 75])
            rows[step] = (float(median), float(low), float(high))
        table[arm] = rows
    return table


def milestones(run: dict) -> dict[float, tuple[int, float] | None]:
    """For each accuracy in MILESTONES, (updates, teacher tokens) at the first evaluation that
    reached it, or None."""
    accuracy = run["curves"]["held_out_accuracy"]
    tokens = dict(run["curves"]["teacher_tokens"])
    return {level: next(((step, tokens.get(step, 0.0)) for step, value in accuracy if value >= level), None)
            for level in MILESTONES}


def print_milestones(runs: dict[str, dict[int, dict]]) -> None:
    print("\nupdates / teacher tokens to reach held-out greedy accuracy (per seed; - = never)")
    for arm, by_seed in runs.items():
        cells = []
        for seed, run in sorted(by_seed.items()):
            reached = milestones(run)
            cells.append(f"seed {seed}: " + ", ".join(
                f"{level:.0%} " + ("-" if hit is None else f"{hit[0]} / {hit[1] / 1e3:.0f}k") for level, hit in reached.items()))
        print(f"{arm:>42}: " + "; ".join(cells))


def against_the_best(runs: dict[str, dict[int, dict]], key: str = "overall") -> tuple[str, dict[str, float]]:
    """The arm with the highest median test `key`, and each other arm's two-sided Mann-Whitney U
    p-value against it over their seeds (arms with fewer than 3 seeds are left out: with 2
    against 8 no p-value is below 0.05)."""
    import scipy.stats

    scores = {arm: [run["test"][key] for run in by_seed.values()] for arm, by_seed in runs.items()}
    best = max(scores, key=lambda arm: float(np.median(scores[arm])))
    return best, {
        arm: float(scipy.stats.mannwhitneyu(scores[best], values, alternative="two-sided").pvalue)
        for arm, values in scores.items()
        if arm != best and len(values) >= 3 and len(scores[best]) >= 3
    }


def print_test_table(runs: dict[str, dict[int, dict]]) -> None:
    """Per arm, over its seeds: test accuracy overall and per difficulty, the retained skill, the KL
    from the start at the last evaluation (median [IQR]), how many seeds reached 50% and 90%
    validation accuracy, and the rank test of its overall accuracy against the best arm's."""
    print("\ntest split at the end (median [interquartile range] over seeds); seeds reaching 50% / 90% on "
          "validation")
    best, p_values = against_the_best(runs)
    for arm, by_seed in runs.items():
        cells = []
        for key in ("overall", "two-digit", "three-digit", "long", "retained"):
            low, median, high = np.percentile([run["test"][key] for run in by_seed.values()], [25, 50, 75])
            cells.append(f"{key} {median:.3f} [{low:.3f}, {high:.3f}]")
        kl = [run["curves"]["kl_from_start"][-1][1] for run in by_seed.values() if run["curves"]["kl_from_start"]]
        if kl:
            low, median, high = np.percentile(kl, [25, 50, 75])
            cells.append(f"KL from start {median:.2f} [{low:.2f}, {high:.2f}] nats")
        reached = [sum(any(v >= level for _, v in run["curves"]["held_out_accuracy"]) for run in by_seed.values())
                   for level in (0.5, 0.9)]
        cells.append(f"reached {reached[0]} / {reached[1]} of {len(by_seed)} seeds")
        if arm in p_values:
            cells.append(f"overall against {best}: Mann-Whitney p = {p_values[arm]:.2g}")
        print(f"{arm:>48}: " + "; ".join(cells))


def print_table(table: dict[str, dict[int, tuple[float, float, float]]], title: str) -> None:
    print(f"\n{title} (median [interquartile range] over seeds)")
    steps = sorted({s for arm in table.values() for s in arm})
    width = max(28, *(len(name) + 2 for name in table))
    print(f"{'step':>6}" + "".join(f"{name:>{width}}" for name in table))
    for step in steps:
        cells = [table[arm].get(step) for arm in table]
        print(f"{step:>6}" + "".join(f"{'-' if c is None else f'{c[0]:.3f} [{c[1]:.3f}, {c[2]:.3f}]':>{width}}"
                                     for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=tuple(ARMS), default="arithmetic")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-prompts", type=int, default=200)
    parser.add_argument("--eval-samples", type=int, default=8,
                        help="samples per held-out prompt for pass@8 (fewer than 8: greedy accuracy only, cheaper)")
    parser.add_argument("--train-rows", type=int, default=None,
                        help="train on the first N rows of the task's training set (default: all)")
    parser.add_argument("--arms", nargs="+", help="Which arms to run, by output folder name (default: all).")
    parser.add_argument("--learning-rate", type=float, default=read_recipe(RECIPE, TRAIN_OPTIONS)["learning_rate"])
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/train_compare"))
    parser.add_argument("--engine", choices=("vllm", "transformers"), default="vllm",
                        help="transformers: every arm in process from the learner's live weights (fast sweeps)")
    parser.add_argument("--stop-at-accuracy", type=float, default=None,
                        help="stop an arm once held-out greedy accuracy reaches this at two evaluations in a row")
    parser.add_argument("--stop-without-signal", type=int, default=None,
                        help="stop a GRPO arm whose every group had zero advantage for its first N updates")
    parser.add_argument("--no-train", action="store_true",
                        help="train nothing: summarise the finished runs, skipping arms and seeds not run")
    parser.add_argument("--jobs", type=int, default=1,
                        help="train this many arms at once, each in its own process pinned to one core with one torch "
                             "thread (arms sharing a warm-up run in one process, one after the other); then summarise")
    args = parser.parse_args()
    if args.jobs > 1 and not args.no_train:
        run_in_parallel(args)
        args.no_train = True  # everything is trained (or failed, and is reported missing): summarise

    runs: dict[str, dict[int, dict]] = {}
    for seed in args.seeds:
        for name, (folder, fields) in ARMS[args.task].items():
            if args.arms is None or folder in args.arms:
                try:
                    run = run_arm(args.task, folder, fields, args, seed)
                except NotRun as missing:
                    print(f"not run, skipped: {missing}")
                    continue
                runs.setdefault(name, {})[seed] = run
                run_dir = args.output / args.task / f"lr-{args.learning_rate:g}" / f"seed-{seed}" / folder
                if args.task == "mixed-methods":
                    run["test"] = test_scores(run_dir)
                elif args.task != "arithmetic":
                    run["answer_logprob_nats"] = answer_logprob(run_dir, args.task)
    metrics = dict.fromkeys(m for by_seed in runs.values() for run in by_seed.values() for m in run["curves"])
    tables = {metric: summary(runs, metric) for metric in metrics}
    for metric, table in tables.items():
        print_table(table, f"{metric}, task {args.task}, seeds {args.seeds}, lr {args.learning_rate:g}")
    print_milestones(runs)
    if args.task == "mixed-methods":
        print_test_table(runs)
    elif args.task != "arithmetic":
        print(f"\nlog p(right answer) of the base at step {args.steps}, nats")
        for arm, by_seed in runs.items():
            values = [run["answer_logprob_nats"] for run in by_seed.values()]
            print(f"{arm:>36}: " + ", ".join(f"{v:.2f}" for v in values))
    out = args.output / args.task / f"lr-{args.learning_rate:g}"  # beside the runs it summarises
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_compare.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs,
         "summary": {m: {a: {str(s): v for s, v in t.items()} for a, t in table.items()}
                     for m, table in tables.items()}}, indent=2) + "\n")
    plot(tables, out / "train_compare.png", f"task {args.task}, lr {args.learning_rate:g}, seeds {args.seeds}")


def run_in_parallel(args: argparse.Namespace) -> None:
    """Each seed's arms as jobs of this script (arms sharing a warm-up together), `args.jobs` at a
    time, each pinned to its own core with one torch thread. A job's output goes to a .log file
    beside its runs; an interrupted sweep started again resumes every unfinished arm."""
    import sys

    groups: dict[tuple[int, str], list[str]] = {}
    for seed in args.seeds:
        for folder, fields in ARMS[args.task].values():
            if args.arms is None or folder in args.arms:
                warmup = fields.get(WARMUP)
                groups.setdefault((seed, warmup[0] if warmup else folder), []).append(folder)
    # This run's options, less those each job sets itself.
    argv = argv_without(sys.argv[1:], {"--jobs": 1, "--seeds": len(args.seeds), "--arms": len(args.arms or ())})
    jobs = [([*argv, "--seeds", str(seed), "--arms", *folders],
             args.output / args.task / f"lr-{args.learning_rate:g}" / f"seed-{seed}" / f"{folders[0]}.log")
            for (seed, _), folders in groups.items()]
    run_pinned(__file__, jobs, args.jobs)


def argv_without(argv: list[str], skipped: dict[str, int]) -> list[str]:
    """`argv` less each option named in `skipped` and the values that follow it (option -> how many)."""
    kept, i = [], 0
    while i < len(argv):
        if argv[i] in skipped:
            i += 1 + skipped[argv[i]]
            continue
        kept.append(argv[i])
        i += 1
    return kept


def run_pinned(script: str, jobs: list[tuple[list[str], Path]], cores: int) -> None:
    """Run `script` once per job (its arguments, the log file its output is appended to), `cores` jobs at a
    time, each pinned to its own core with one torch thread; print each job's outcome and the total time."""
    import concurrent.futures
    import queue
    import subprocess
    import sys

    free: queue.Queue[int] = queue.Queue()
    for core in sorted(os.sched_getaffinity(0))[:cores]:
        free.put(core)

    def run(argv: list[str], log_path: Path) -> tuple[str, int]:
        core = free.get()
        try:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
            with open(log_path, "a", encoding="utf-8") as log_file:
                done = subprocess.run([sys.executable, script, *argv], stdout=log_file, stderr=subprocess.STDOUT,
                                      env=env, check=False, preexec_fn=lambda: os.sched_setaffinity(0, {core}))
            return str(log_path), done.returncode
        finally:
            free.put(core)

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=cores) as pool:
        futures = [pool.submit(run, argv, log_path) for argv, log_path in jobs]
        for future in concurrent.futures.as_completed(futures):
            log_path, code = future.result()
            print(f"{'done' if code == 0 else f'FAILED (exit {code})'}: {log_path}")
    print(f"{len(jobs)} jobs on {cores} cores in {time.perf_counter() - started:.0f} s")


def plot(tables: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = 3
    fig, axes = plt.subplots(-(-len(tables) // columns), columns, figsize=(5 * columns, 2.5 * -(-len(tables) // columns)),
                             squeeze=False)
    for ax, (metric, table) in zip(axes.flat, tables.items()):
        ax.set_prop_cycle(color=plt.cm.tab20.colors)  # up to 20 arms, each its own colour
        for arm, points in table.items():
            if points:
                steps = list(points)
                median, low, high = (np.array([points[s][i] for s in steps]) for i in range(3))
                ax.errorbar(steps, median, yerr=[median - low, high - median], marker="o", markersize=3, capsize=2,
                            label=arm)
        ax.set(xlabel="update", title=metric)
    # One legend for all panels, under them: the arms' names are long.
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=7, bbox_to_anchor=(0.5, 0.0))
    fig.suptitle(f"{title} (median, bars: interquartile range over seeds)")
    fig.tight_layout(rect=(0, 0.04 + 0.018 * -(-len(labels) // 2), 1, 1))
    fig.savefig(path, dpi=110)
    print(f"wrote {path.with_name('train_compare.json')} and {path.name}")


if __name__ == "__main__":
    main()
