"""Same budget, different rollout sources: on-policy GRPO (alpha = 0), q*-GRPO, teacher-only (alpha = 1).

    python benchmarks/train_compare.py --steps 150 --eval-every 50

Each arm is a full `dualvllm train` run (its own servers, same seed, same prompts per
step, same group size and learning rate) in OUTPUT/<arm>/. q* rollouts are trained with
both off-policy corrections (`--correction sequence`, the default, and `token`).
Reports held-out greedy accuracy of the base against step for each arm: a table, JSON
and a plot.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from training.config import TrainConfig
from training.grpo import train_grpo

# (name, output folder, fixed_alpha, correction)
ARMS = (("on-policy (alpha=0)", "on-policy", 0.0, "sequence"),
        ("q* (alpha*), sequence IS", "qstar-sequence", None, "sequence"),
        ("q* (alpha*), token TIS", "qstar-token", None, "token"),
        ("teacher-only (alpha=1)", "teacher-only", 1.0, "sequence"))


def accuracy_curve(metrics_path: Path) -> list[tuple[int, float]]:
    curve = {}
    for line in metrics_path.read_text().splitlines():
        record = json.loads(line)
        if "held_out_accuracy" in record:
            curve[record["step"]] = record["held_out_accuracy"]
    return sorted(curve.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--arms", nargs="+", default=[folder for _, folder, _, _ in ARMS],
                        help="Which arms to run, by output folder name.")
    parser.add_argument("--learning-rate", type=float, default=TrainConfig.model_fields["learning_rate"].default)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/train_compare"))
    args = parser.parse_args()

    results = {}
    for name, folder, alpha, correction in ARMS:
        if folder not in args.arms:
            continue
        arm_dir = args.output / folder
        if arm_dir.exists():
            raise SystemExit(f"{arm_dir} exists; remove it or pass another --output")
        config = TrainConfig(output_dir=arm_dir, steps=args.steps, eval_every=args.eval_every,
                             learning_rate=args.learning_rate, fixed_alpha=alpha, correction=correction,
                             seed=args.seed)
        report = asyncio.run(train_grpo(config, show_progress=True))
        results[name] = {"fixed_alpha": alpha, "correction": correction, "curve": accuracy_curve(report.metrics_path),
                         "dropped_stale_batches": report.dropped_stale_batches}
    steps = sorted({s for r in results.values() for s, _ in r["curve"]})
    print(f"\nheld-out greedy accuracy of the base (seed {args.seed}, lr {args.learning_rate:g})")
    print(f"{'step':>6}" + "".join(f"{name:>26}" for name in results))
    for step in steps:
        row = [dict(r["curve"]).get(step) for r in results.values()]
        print(f"{step:>6}" + "".join(f"{'-' if v is None else f'{v:.1%}':>26}" for v in row))
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "train_compare.json").write_text(json.dumps({"args": vars(args) | {"output": str(args.output)},
                                                                "arms": results}, indent=2) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, result in results.items():
        ax.plot(*zip(*result["curve"]), marker="o", label=name)
    ax.set(xlabel="learner step", ylabel="held-out greedy accuracy", title="GRPO with different rollout sources")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.output / "train_compare.png", dpi=120)
    print(f"wrote {args.output / 'train_compare.json'} and train_compare.png")


if __name__ == "__main__":
    main()
