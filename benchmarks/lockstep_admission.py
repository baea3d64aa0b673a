"""Lockstep with and without aligned admission, on the same servers, in one run.

    python benchmarks/lockstep_admission.py                 # starts the bundled tiny models with the plugin
    python benchmarks/lockstep_admission.py --theta-url URL --t-url URL --batch-sizes 8 64 --repeats 4

Two arms alternate in every repeat: `aligned` (CoordinatorConfig(lockstep_aligned_admission=True),
the default: new sequences start while both servers are blocked and wait until both took
them in, coordinator/admission.py) and `unaligned` (sent as soon as there is room). Each arm
gets a fresh coordinator per repeat, a warm-up batch, then the measured batch (ignore_eos,
temperature 1). Per batch size: median tokens/s of each arm, the median of per-repeat
ratios, and from the last repeat the share of steps run ahead (server reports completed over
two or more of the other server's steps) and the servers' mean wait per step. Writes
benchmarks/results/lockstep_admission.json and .png.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `benchmarks` is not an installed package

from dualvllm.common import loop  # noqa: E402
from benchmarks import harness  # noqa: E402
from dualvllm.coordinator import CoordinatorConfig, DualVLLMCoordinator  # noqa: E402

ARMS = {"aligned": True, "unaligned": False}


async def measure(theta: str, t: str, prompts: list[str], tokens: int, top_k: int, aligned: bool,
                  repeat: int) -> dict[str, float]:
    config = CoordinatorConfig(theta_url=theta, t_url=t, top_k=top_k, max_batch_size=len(prompts), mode="lockstep",
                               lockstep_aligned_admission=aligned)
    async with DualVLLMCoordinator(config) as c:
        await c.generate_batch(prompts, max_tokens=tokens, seed=1000 + repeat, ignore_eos=True)  # warm-up
        started = time.perf_counter()
        await c.generate_batch(prompts, max_tokens=tokens, seed=repeat, ignore_eos=True)
        tokens_per_s = len(prompts) * tokens / (time.perf_counter() - started)
        stats = c.get_statistics()
    return {"tokens_per_s": tokens_per_s, "split_report_share": stats["lockstep_split_report_share"],
            "server_wait_ms": stats["lockstep_server_wait_ms_mean"]}


async def run(args) -> dict:
    rows = []
    async with harness.servers(args.theta_url, args.t_url, max_logprobs=args.top_k, lockstep=True) as (theta, t):
        for batch in args.batch_sizes:
            prompts = harness.prompts_for(batch, seed=0)
            runs: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
            for repeat in range(args.repeats):
                for arm, aligned in ARMS.items():
                    runs[arm].append(await measure(theta, t, prompts, args.tokens, args.top_k, aligned, repeat))
            row: dict = {"batch_size": batch, "tokens_per_sequence": args.tokens}
            for arm, measured in runs.items():
                row[f"{arm}_tokens_per_s"] = statistics.median(m["tokens_per_s"] for m in measured)
                row[f"{arm}_tokens_per_s_all"] = [m["tokens_per_s"] for m in measured]
                row[f"{arm}_split_report_share"] = measured[-1]["split_report_share"]
                row[f"{arm}_server_wait_ms"] = measured[-1]["server_wait_ms"]
            row["aligned_over_unaligned_ratio"] = statistics.median(
                a["tokens_per_s"] / u["tokens_per_s"] for a, u in zip(runs["aligned"], runs["unaligned"]))
            rows.append(row)
            print(f"batch {batch:4d}: aligned {row['aligned_tokens_per_s']:7.1f} tokens/s, unaligned "
                  f"{row['unaligned_tokens_per_s']:7.1f}, ratio {row['aligned_over_unaligned_ratio']:.2f}; steps run "
                  f"ahead {100 * row['aligned_split_report_share']:.0f}% / "
                  f"{100 * row['unaligned_split_report_share']:.0f}%; servers' wait per step "
                  f"{row['aligned_server_wait_ms']:.1f} / {row['unaligned_server_wait_ms']:.1f} ms", flush=True)
    return {"machine": harness.machine(), "command": " ".join(["python", *sys.argv]), "top_k": args.top_k,
            "repeats": args.repeats, "rows": rows}


def plot(report: dict, path: Path) -> None:
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    harness.plot_tokens_per_s(ax, report["rows"], {arm: f"{arm}_tokens_per_s" for arm in ARMS},
                              f"lockstep admission, top_k {report['top_k']}")
    harness.save_figure(fig, path)


def main() -> None:
    parser = harness.argument_parser(__doc__, live_servers=True)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--output", type=Path, default=harness.RESULTS_DIR / "lockstep_admission.json")
    args = parser.parse_args()
    harness.finish(loop.run(run(args)), args.output, plot)


if __name__ == "__main__":
    main()
