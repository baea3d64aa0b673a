"""What denormal gradients cost a CPU backward, and what flushing them to zero gives back.

    python benchmarks/denormals.py

A stack of 8 linear layers [1024 x 1024] (float32, torch's threads), its output summed and
scaled by `scale` before backward: at 1e-39 every gradient is a denormal float32. Timed
without and with `torch.set_flush_denormal(True)` (dualvllm.training.learner.denormals_flushed, which the
learner sets in the thread that runs backward). Why it matters: a GRPO rollout whose
self-normalized sequence weight is tiny backpropagates such gradients (issue 41's 64 x 1,024
update at Qwen3-0.6B's shape). Prints one line per case and writes benchmarks/results/denormals.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks` is not an installed package

SCALES = (1.0, 1e-30, 1e-39)  # normal; tiny but normal gradients; denormal gradients


def backward_seconds(layers: torch.nn.Module, x: torch.Tensor, scale: float, repeats: int) -> float:
    """Median wall time of one forward and backward with the loss scaled by `scale`."""
    times = []
    for _ in range(repeats):
        layers.zero_grad()
        started = time.perf_counter()
        (layers(x).sum() * scale).backward()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/denormals.json"))
    args = parser.parse_args()
    from benchmarks import harness

    torch.manual_seed(0)
    layers = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])
    x = torch.randn(1024, 1024)
    rows = []
    for flush in (False, True):
        torch.set_flush_denormal(flush)
        for scale in SCALES:
            seconds = backward_seconds(layers, x, scale, args.repeats)
            rows.append({"flush_denormal": flush, "loss_scale": scale, "seconds": seconds})
            print(f"flush denormals {'on ' if flush else 'off'}  loss x {scale:<6g}  {seconds:7.3f} s", flush=True)
    torch.set_flush_denormal(False)
    report = {"machine": harness.machine(), "command": " ".join(["python", *sys.argv]), "torch_threads":
              torch.get_num_threads(), "rows": rows}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
