"""Speculative q* sampling against per-token q* sampling on two live vLLM servers.

    python benchmarks/speculative.py                     # starts the bundled tiny models (one pair)
    python benchmarks/speculative.py --theta-url URL --t-url URL --batch-sizes 1 64 --gammas 2 4 8
    python benchmarks/speculative.py --proposals argmax          # only the batched greedy drafts

Two workloads at temperature 1, top_k 20, each at every batch size:
- `fixed`: `--tokens` tokens per sequence with ignore_eos (the per_token_latency workload);
- `task`: held-out addition prompts generated until EOS (max 8 tokens), the bundled
  models' real use: 3-4 tokens per answer.

Each measured run generates the batch once in every mode (per-token, then speculative
with each proposal, `sample` and `argmax`, and each gamma) back to back, so modes are
compared within one run on this noisy machine; the table shows medians over `--repeats`
runs of tokens/s, the speed-up over per-token mode (the median of the per-run ratios) and
the acceptance rate. Writes JSON
(units in the keys) and a plot to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `benchmarks` is not an installed package

from dualvllm.common import loop  # noqa: E402
from benchmarks import harness  # noqa: E402
from dualvllm.coordinator import CoordinatorConfig, DualVLLMCoordinator  # noqa: E402
from dualvllm.tinymodels.task import problems  # noqa: E402

TASK_MAX_TOKENS = 8  # an answer is at most 3 digits and EOS


async def one_run(coordinator: DualVLLMCoordinator, prompts: list[str], workload: str, tokens: int,
                  seed: int) -> dict[str, float]:
    """Generate once; tokens/s from wall time, acceptance from the statistics' change."""
    before = coordinator.get_statistics()
    started = time.perf_counter()
    fixed = workload == "fixed"
    outputs = await coordinator.generate_batch(prompts, max_tokens=tokens if fixed else TASK_MAX_TOKENS,
                                               seed=seed, ignore_eos=fixed)
    seconds = time.perf_counter() - started
    failed = [o.error for o in outputs if not o.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} sequences failed during the benchmark; first: {failed[0]}")
    after = coordinator.get_statistics()
    generated = sum(len(o.generated_tokens) for o in outputs)
    row = {"tokens_per_s": generated / seconds, "tokens": generated, "seconds": seconds,
           "rounds_or_steps": after["steps"] - before["steps"]}
    if "speculative_rounds" in after:
        rounds = after["speculative_rounds"] - before.get("speculative_rounds", 0)
        row["tokens_per_sequence_round"] = generated / rounds
        # The cumulative rate is enough: each coordinator only ever runs one workload and batch.
        row["acceptance_rate"] = after["speculative_acceptance_rate"]
    return row


Mode = tuple[int, str]  # (gamma, proposal); gamma 0 is per-token mode


def label(mode: Mode) -> str:
    return "per-token" if mode[0] == 0 else f"{mode[1]} γ={mode[0]}"


async def run(args: argparse.Namespace) -> dict:
    modes: list[Mode] = [(0, "sample"), *((g, p) for p in args.proposals for g in args.gammas)]
    results = []
    async with contextlib.AsyncExitStack() as stack:
        theta_url, t_url = await stack.enter_async_context(
            harness.servers(args.theta_url, args.t_url, max_logprobs=max(args.top_k, 20)))
        for workload in args.workloads:
            for batch_size in args.batch_sizes:
                prompts = [p.prompt for p in problems("test", n=min(batch_size, 400), seed=batch_size)]
                prompts = (prompts * (batch_size // len(prompts) + 1))[:batch_size]
                async with contextlib.AsyncExitStack() as coordinators:
                    by_mode = {}
                    for gamma, proposal in modes:
                        config = CoordinatorConfig(theta_url=theta_url, t_url=t_url, top_k=args.top_k,
                                                   max_batch_size=batch_size, speculative_gamma=gamma,
                                                   speculative_proposal=proposal)
                        by_mode[gamma, proposal] = await coordinators.enter_async_context(
                            DualVLLMCoordinator(config))
                    for mode in modes:  # warm-up
                        await one_run(by_mode[mode], prompts, workload, min(args.tokens, 4), seed=0)
                    runs: dict[Mode, list[dict]] = {mode: [] for mode in modes}
                    for repeat in range(args.repeats):
                        for mode in modes:
                            runs[mode].append(await one_run(by_mode[mode], prompts, workload, args.tokens,
                                                            seed=repeat + 1))
                for mode in modes:
                    row = summarize(workload, batch_size, mode, runs[mode], runs[modes[0]], args)
                    results.append(row)
                    print(render(row), flush=True)
    return {"machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "command": "python benchmarks/speculative.py " + " ".join(args.argv), "results": results}


def summarize(workload: str, batch_size: int, mode: Mode, runs: list[dict], baseline: list[dict],
              args: argparse.Namespace) -> dict:
    ratios = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(runs, baseline)]
    gamma = mode[0]
    row = {"workload": workload, "batch_size": batch_size, "mode": label(mode),
           "proposal": mode[1] if gamma else None, "gamma": gamma, "top_k": args.top_k, "repeats": args.repeats,
           "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
           "speedup_over_per_token": statistics.median(ratios),
           "tokens_per_s_per_run": [round(r["tokens_per_s"], 1) for r in runs],
           "tokens_per_run": runs[0]["tokens"]}
    if gamma:
        row["acceptance_rate"] = runs[-1]["acceptance_rate"]
        row["tokens_per_sequence_round"] = statistics.median(r["tokens_per_sequence_round"] for r in runs)
    return row


def render(row: dict) -> str:
    line = (f"{row['workload']:>5}  batch {row['batch_size']:>3}  {row['mode']:>11}  "
            f"{row['tokens_per_s']:8.1f} tokens/s  "
            f"x{row['speedup_over_per_token']:.2f}")
    if row["gamma"]:
        line += f"  acceptance {row['acceptance_rate']:.3f}  {row['tokens_per_sequence_round']:.2f} tokens/round"
    return line + f"  (runs {row['tokens_per_s_per_run']})"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    panels = sorted({(r["workload"], r["batch_size"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 3.8), squeeze=False)
    for ax, (workload, batch_size) in zip(axes[0], panels):
        mine = [r for r in rows if r["workload"] == workload and r["batch_size"] == batch_size]
        colors = {None: "tab:gray", "sample": "tab:blue", "argmax": "tab:orange"}
        bars = ax.bar([r["mode"].replace(" ", "\n") for r in mine], [r["tokens_per_s"] for r in mine],
                      color=[colors[r["proposal"]] for r in mine])
        for bar, r in zip(bars, mine):
            note = f"x{r['speedup_over_per_token']:.2f}"
            if r["gamma"]:
                note += f"\nacc {r['acceptance_rate']:.2f}"
            ax.annotate(note, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                        fontsize=8)
        ax.set_title(f"{workload}, batch {batch_size}")
        ax.set_ylabel("tokens/s")
        ax.margins(y=0.25)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--theta-url", help="running base server; default: start the bundled tiny models")
    parser.add_argument("--t-url", help="running teacher server")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--gammas", type=int, nargs="+", default=[2, 4, 8], help="speculative draft lengths")
    parser.add_argument("--proposals", nargs="+", choices=("sample", "argmax"), default=["sample", "argmax"],
                        help="what the drafter proposes (CoordinatorConfig.speculative_proposal)")
    parser.add_argument("--workloads", nargs="+", choices=("fixed", "task"), default=["fixed", "task"])
    parser.add_argument("--tokens", type=int, default=32, help="tokens per sequence of the fixed workload")
    parser.add_argument("--repeats", type=int, default=3, help="measured runs per batch size and workload")
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/speculative.json"))
    import sys

    args = parser.parse_args()
    args.argv = sys.argv[1:]
    report = loop.run(run(args))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.output.with_suffix(".png"))
    print(f"wrote {args.output} and {args.output.with_suffix('.png')}")


if __name__ == "__main__":
    main()
