"""Draw a training run's metrics.jsonl: rewards, held-out accuracy, loss, importance ratios, alpha.

    python benchmarks/plot_training.py runs/grpo1/metrics.jsonl [more runs ...] --output runs/grpo1.png

Several runs are drawn on the same axes, labelled by their directory names.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PANELS = (
    ("reward_mean", "training reward (mean)"),
    ("held_out_accuracy", "held-out greedy accuracy (base)"),
    ("loss", "loss"),
    ("ratio_mean", "importance ratio pi/q* (mean)"),
    ("clip_fraction", "fraction of ratios above the cap"),
    ("mean_alpha", "mean alpha*"),
)


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics", type=Path, nargs="+", help="metrics.jsonl files")
    parser.add_argument("--output", type=Path, required=True, help="PNG to write")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 7))
    for path in args.metrics:
        records = read(path)
        label = path.parent.name
        for ax, (key, title) in zip(axes.flat, PANELS):
            points = [(r["step"], r[key]) for r in records if key in r]
            if points:
                ax.plot(*zip(*points), marker="." if key == "held_out_accuracy" else None, label=label)
            ax.set(title=title, xlabel="step")
    axes.flat[0].legend()
    fig.tight_layout()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.output, dpi=110)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
