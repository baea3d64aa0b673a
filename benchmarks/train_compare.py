"""Same budget, different rollout sources: GRPO arms compared on a bundled task, over seeds.

    python benchmarks/train_compare.py --steps 150 --eval-every 50                  # the arithmetic task
    python benchmarks/train_compare.py --task hard --seeds 0 1 2 --steps 100 --eval-every 25

Each arm is a full `dualvllm train` run (its own servers; same seed, prompts per step,
group size, learning rate and held-out prompts) in OUTPUT/<task>/seed-<s>/<arm>/.

- `--task arithmetic` (two-digit sums, which the bundled base gets ~27% right):
  on-policy (alpha = 0), q* with each off-policy correction, teacher-only (alpha = 1).
- `--task hard` (three-digit sums, tinymodels/data/hard_*.jsonl: the base never saw one,
  the hard teacher was trained on them): on-policy; q* with the hard teacher; q* with a
  privileged-information teacher (the base itself shown the answer: `--teacher self
  --teacher-template "{answer} {prompt}"`, no teacher model); on-policy with `--curriculum`.

At each evaluation: held-out greedy accuracy and pass@8 of the base, and over the
updates since the last evaluation the fraction of groups with zero advantage (all
rollouts scored alike: no signal), the ESS ratio of the sequence weights and the mean
reward of the rollouts (how often the sampler, q* or the base, was right). Prints the
mean ± spread (half the range) over seeds per arm and step, writes JSON and a plot.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import numpy as np

import tinymodels
from tinymodels.task import HARD_TEST, HARD_TRAIN
from training.config import TrainConfig
from training.grpo import train_grpo

# name -> (output folder, TrainConfig fields of the arm)
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
TASKS = {  # TrainConfig fields of each task
    "arithmetic": {},
    "hard": {"dataset": HARD_TRAIN, "eval_dataset": HARD_TEST, "max_tokens": 5},
}
CURVES = ("held_out_accuracy", "held_out_pass@8", "zero_advantage_groups", "ess_ratio", "reward_mean")
TRAINING_CURVES = ("zero_advantage_groups", "ess_ratio", "reward_mean")  # averaged over the updates between evals


def curves(metrics_path: Path) -> dict[str, list[tuple[int, float]]]:
    """Per metric, (step, value): evaluations as they are; training metrics averaged since the last evaluation."""
    records = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    out: dict[str, dict[int, float]] = {name: {} for name in CURVES}
    pending: dict[str, list[float]] = {name: [] for name in TRAINING_CURVES}
    for record in records:
        for name in pending:
            if name in record:
                pending[name].append(record[name])
        if "held_out_accuracy" in record:
            step = record["step"]
            for name in ("held_out_accuracy", "held_out_pass@8"):
                if name in record:
                    out[name][step] = record[name]
            for name, values in pending.items():
                if values:
                    out[name][step] = float(np.mean(values))
                    values.clear()
    return {name: sorted(points.items()) for name, points in out.items()}


def run_arm(task: str, folder: str, fields: dict, args: argparse.Namespace, seed: int) -> dict:
    """One arm's curves: trained now, or read back from a finished run with the same settings."""
    arm_dir = args.output / task / f"seed-{seed}" / folder
    config = TrainConfig(output_dir=arm_dir, steps=args.steps, eval_every=args.eval_every,
                         learning_rate=args.learning_rate, seed=seed, eval_prompts=args.eval_prompts,
                         eval_samples=8, pass_k=(1, 8), **TASKS[task], **fields)
    if arm_dir.exists():
        # Runs take minutes each: seeds and arms added later reuse the finished ones.
        if finished_with(arm_dir, config):
            print(f"reusing {arm_dir} (finished, same settings)")
            return {"fields": {k: str(v) for k, v in fields.items()}, "curves": curves(arm_dir / "metrics.jsonl"),
                    "reused": True}
        raise SystemExit(f"{arm_dir} exists but is unfinished or was run with other settings; "
                         "remove it or pass another --output")
    report = asyncio.run(train_grpo(config, show_progress=True))
    return {"fields": {k: str(v) for k, v in fields.items()}, "curves": curves(report.metrics_path),
            "dropped_stale_batches": report.dropped_stale_batches}


def answer_logprob(arm_dir: Path, steps: int) -> float:
    """Mean log p(right answer + EOS | prompt) of the run's last checkpoint on the 500 hard test
    problems, in nats: moves long before greedy accuracy does (the bundled base: -26.8)."""
    import torch
    from transformers import Qwen2ForCausalLM, Qwen2Tokenizer

    from tinymodels.build import HARD_MAX_LEN, answer_logprob as mean_answer_logprob
    from tinymodels.task import HARD_ROWS, hard_problems

    checkpoint = arm_dir / "checkpoints" / f"step-{steps:06d}"
    model = Qwen2ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    tokenizer = Qwen2Tokenizer.from_pretrained(checkpoint)
    return mean_answer_logprob(model, tokenizer, hard_problems("test", HARD_ROWS["test"]), HARD_MAX_LEN)


def wanted_default(key: str) -> object:
    """A TrainConfig field's default as config.json stores it."""
    return json.loads(json.dumps(TrainConfig.model_fields[key].default, default=str))


def finished_with(arm_dir: Path, config: TrainConfig) -> bool:
    """Whether `arm_dir` holds a run of `config` that reached its last step's evaluation."""
    try:
        saved = json.loads((arm_dir / "config.json").read_text())
        records = [json.loads(line) for line in (arm_dir / "metrics.jsonl").read_text().splitlines()]
    except (OSError, ValueError):
        return False
    wanted = json.loads(config.model_dump_json())
    # A field added since the run was made holds its default there.
    same = all(saved.get(key, wanted_default(key)) == value for key, value in wanted.items() if key != "output_dir")
    return same and any(r.get("step") == config.steps and "held_out_accuracy" in r for r in records)


def summary(runs: dict[str, dict[int, dict]], metric: str) -> dict[str, dict[int, tuple[float, float]]]:
    """arm -> step -> (mean, half the range) of `metric` over seeds."""
    table: dict[str, dict[int, tuple[float, float]]] = {}
    for arm, by_seed in runs.items():
        steps: dict[int, list[float]] = {}
        for run in by_seed.values():
            for step, value in run["curves"][metric]:
                steps.setdefault(step, []).append(value)
        table[arm] = {s: (float(np.mean(v)), float(np.ptp(v) / 2)) for s, v in sorted(steps.items())}
    return table


def print_table(table: dict[str, dict[int, tuple[float, float]]], title: str) -> None:
    print(f"\n{title} (mean ± half-range over seeds)")
    steps = sorted({s for arm in table.values() for s in arm})
    width = max(28, *(len(name) + 2 for name in table))
    print(f"{'step':>6}" + "".join(f"{name:>{width}}" for name in table))
    for step in steps:
        cells = [table[arm].get(step) for arm in table]
        print(f"{step:>6}" + "".join(f"{'-' if c is None else f'{c[0]:.3f} ± {c[1]:.3f}':>{width}}" for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=tuple(ARMS), default="arithmetic")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-prompts", type=int, default=200)
    parser.add_argument("--arms", nargs="+", help="Which arms to run, by output folder name (default: all).")
    parser.add_argument("--learning-rate", type=float, default=TrainConfig.model_fields["learning_rate"].default)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/train_compare"))
    args = parser.parse_args()

    runs: dict[str, dict[int, dict]] = {}
    for seed in args.seeds:
        for name, (folder, fields) in ARMS[args.task].items():
            if args.arms is None or folder in args.arms:
                run = runs.setdefault(name, {})[seed] = run_arm(args.task, folder, fields, args, seed)
                if args.task == "hard":
                    run["answer_logprob_nats"] = answer_logprob(args.output / args.task / f"seed-{seed}" / folder,
                                                                args.steps)
    tables = {metric: summary(runs, metric) for metric in CURVES}
    for metric, table in tables.items():
        print_table(table, f"{metric}, task {args.task}, seeds {args.seeds}, lr {args.learning_rate:g}")
    if args.task == "hard":
        print(f"\nlog p(right answer) of the base at step {args.steps}, nats (bundled base: -26.8)")
        for arm, by_seed in runs.items():
            values = [run["answer_logprob_nats"] for run in by_seed.values()]
            print(f"{arm:>36}: " + ", ".join(f"{v:.2f}" for v in values))
    out = args.output / args.task
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_compare.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs,
         "summary": {m: {a: {str(s): v for s, v in t.items()} for a, t in table.items()}
                     for m, table in tables.items()}}, indent=2) + "\n")
    plot(tables, out / "train_compare.png", args.task)


def plot(tables: dict, path: Path, task: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CURVES), figsize=(4.2 * len(CURVES), 3.8))
    for ax, (metric, table) in zip(axes, tables.items()):
        for arm, points in table.items():
            if points:
                steps = list(points)
                mean = np.array([points[s][0] for s in steps])
                spread = np.array([points[s][1] for s in steps])
                ax.errorbar(steps, mean, yerr=spread, marker="o", capsize=3, label=arm)
        ax.set(xlabel="learner step", title=metric)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"GRPO rollout sources, task {task}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path.with_name('train_compare.json')} and {path.name}")


if __name__ == "__main__":
    main()
