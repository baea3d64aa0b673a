"""Per-token latency of the coordinator against two live vLLM servers, phase by phase.

    python benchmarks/per_token_latency.py                       # starts the bundled tiny models
    python benchmarks/per_token_latency.py --theta-url URL --t-url URL --batch-sizes 1 8 64 256 --ks 20 96

One coordinator step = one batched top-k request to each server (concurrently), then
merge, alpha* and sampling for every active sequence, then bookkeeping (records, stop
rules, statistics). At batch size B every step yields B tokens, so the step latency is
the per-token latency each sequence sees. The coordinator records every step's phases
(dualvllm.coordinator.stats.StepTiming); this script reports their median and p95 over all
measured steps: both server calls together (`servers`), each call alone (`theta`, `t`),
merge, alpha*, sampling and bookkeeping.

For each k and batch size: a warm-up run, then `--repeats` runs of `--tokens` tokens per
sequence (ignore_eos, so the batch stays full). Between the runs, in the same time
window, single-prompt round trips are timed the same way the coordinator calls the
servers (VLLMClient.next_token_topk on one context): the base alone, the teacher alone,
and both concurrently; the batch-1 step is compared with them.

The bundled models have a 98-token vocabulary: a request for more logprobs than that
(k = 100) kills vLLM 0.32's engine, so the large-k runs use k = 96.
Writes benchmarks/results/per_token_latency.json (units in the keys) and a plot.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `benchmarks` is not an installed package

from dualvllm.common import loop  # noqa: E402
from benchmarks import harness  # noqa: E402
from dualvllm.coordinator import CoordinatorConfig, DualVLLMCoordinator  # noqa: E402
from dualvllm.coordinator.stats import StepTiming  # noqa: E402
from dualvllm.engines.vllm_client import VLLMClient  # noqa: E402

PHASES = ("servers", "theta", "t", "merge", "alpha", "sample", "bookkeeping", "total")
ROUND_TRIPS = ("theta_alone", "t_alone", "both_concurrently")


async def coordinator_run(coordinator: DualVLLMCoordinator, batch: int, tokens: int, seed: int) -> list[StepTiming]:
    """One run of `batch` sequences of exactly `tokens` tokens; its steps' timings."""
    outputs = await coordinator.generate_batch(harness.prompts_for(batch, seed), max_tokens=tokens, seed=seed,
                                               ignore_eos=True)
    failed = [o.error for o in outputs if not o.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} sequences failed during the benchmark; first: {failed[0]}")
    timings = coordinator.recent_step_timings()[-tokens:]
    assert len(timings) == tokens and all(t.batch == batch for t in timings), "steps were not all full"
    return timings


async def round_trips(theta: VLLMClient, t: VLLMClient, context: list[int], k: int, n: int) -> dict[str, list[float]]:
    """Seconds of `n` single-prompt top-k requests of each kind, interleaved."""
    out: dict[str, list[float]] = {kind: [] for kind in ROUND_TRIPS}
    calls = {"theta_alone": lambda: theta.next_token_topk([context], k),
             "t_alone": lambda: t.next_token_topk([context], k),
             "both_concurrently": lambda: asyncio.gather(theta.next_token_topk([context], k),
                                                         t.next_token_topk([context], k))}
    for _ in range(n):
        for kind, call in calls.items():
            started = time.perf_counter()
            await call()
            out[kind].append(time.perf_counter() - started)
    return out


def ms(values: list[float]) -> dict[str, float]:
    return {"median_ms": float(np.median(values)) * 1e3, "p95_ms": float(np.percentile(values, 95)) * 1e3}


async def measure(theta_url: str, t_url: str, k: int, args: argparse.Namespace) -> list[dict]:
    config = CoordinatorConfig(theta_url=theta_url, t_url=t_url, top_k=k, max_batch_size=max(args.batch_sizes),
                               local_tokenizers=args.skip_tokenizer_init)
    rows = []
    local = args.skip_tokenizer_init
    async with DualVLLMCoordinator(config) as coordinator, \
            VLLMClient(theta_url, name="theta", local_tokenizer=local) as theta, \
            VLLMClient(t_url, name="t", local_tokenizer=local) as t:
        context = await theta.tokenize(harness.prompts_for(1, seed=0)[0])
        for batch in args.batch_sizes:
            await coordinator_run(coordinator, batch, min(args.tokens, 4), seed=0)  # warm-up
            await round_trips(theta, t, context, k, 3)
            steps: list[StepTiming] = []
            trips: dict[str, list[float]] = {kind: [] for kind in ROUND_TRIPS}
            run_medians, tokens_per_s = [], []
            for repeat in range(args.repeats):
                started = time.perf_counter()
                timings = await coordinator_run(coordinator, batch, args.tokens, seed=repeat + 1)
                tokens_per_s.append(batch * args.tokens / (time.perf_counter() - started))
                steps += timings
                run_medians.append(float(np.median([s.total_s for s in timings])) * 1e3)
                for kind, seconds in (await round_trips(theta, t, context, k, args.round_trips)).items():
                    trips[kind] += seconds
            row: dict = {"top_k": k, "batch_size": batch, "tokens_per_sequence": args.tokens,
                         "repeats": args.repeats, "steps": len(steps),
                         "tokens_per_s": statistics.median(tokens_per_s),
                         "step_median_ms_per_run": [round(m, 2) for m in run_medians]}
            for phase in PHASES:
                for stat, value in ms([getattr(s, f"{phase}_s") for s in steps]).items():
                    row[f"{phase}_{stat}"] = value
            for kind, seconds in trips.items():
                for stat, value in ms(seconds).items():
                    row[f"round_trip_{kind}_{stat}"] = value
            row["step_over_theta_round_trip_ratio"] = row["total_median_ms"] / row["round_trip_theta_alone_median_ms"]
            row["step_over_concurrent_round_trips_ratio"] = (row["total_median_ms"]
                                                             / row["round_trip_both_concurrently_median_ms"])
            rows.append(row)
            print_row(row)
    return rows


def print_row(row: dict) -> None:
    print(f"k {row['top_k']:>3}  batch {row['batch_size']:>4}  step {row['total_median_ms']:7.2f} ms "
          f"(p95 {row['total_p95_ms']:7.2f})  servers {row['servers_median_ms']:7.2f} [theta "
          f"{row['theta_median_ms']:6.2f}, t {row['t_median_ms']:6.2f}]  merge {row['merge_median_ms']:5.2f}  "
          f"alpha {row['alpha_median_ms']:5.2f}  sample {row['sample_median_ms']:5.2f}  bookkeeping "
          f"{row['bookkeeping_median_ms']:5.2f}  |  {row['tokens_per_s']:7.1f} tok/s  |  round trip: theta "
          f"{row['round_trip_theta_alone_median_ms']:5.2f}, t {row['round_trip_t_alone_median_ms']:5.2f}, both "
          f"{row['round_trip_both_concurrently_median_ms']:5.2f} ms; step/theta round trip "
          f"{row['step_over_theta_round_trip_ratio']:.2f}", flush=True)


def plot(report: dict, path: Path) -> None:
    """Top: the step against the server calls and a single round trip; bottom: the coordinator's own phases."""
    plt = harness.pyplot()
    ks = sorted({r["top_k"] for r in report["rows"]})
    fig, axes = plt.subplots(2, len(ks), figsize=(6 * len(ks), 8), squeeze=False)
    for column, k in enumerate(ks):
        rows = [r for r in report["rows"] if r["top_k"] == k]
        labels = [str(r["batch_size"]) for r in rows]
        top, bottom_ax = axes[0][column], axes[1][column]
        for key, label in (("total", "step (per-token latency)"), ("servers", "both server calls"),
                           ("round_trip_both_concurrently", "2 single-prompt round trips, concurrent"),
                           ("round_trip_theta_alone", "1 single-prompt round trip (base)")):
            top.plot(labels, [r[f"{key}_median_ms"] for r in rows], "o-", label=label)
        top.set(yscale="log", xlabel="batch size", ylabel="median ms", title=f"top_k {k}")
        top.legend(fontsize=8)
        stacked = np.zeros(len(rows))
        for phase in ("merge", "alpha", "sample", "bookkeeping"):
            values = np.array([r[f"{phase}_median_ms"] for r in rows])
            bottom_ax.bar(labels, values, bottom=stacked, label=phase)
            stacked += values
        bottom_ax.set(xlabel="batch size", ylabel="median ms per step", title=f"coordinator's own phases, top_k {k}")
        bottom_ax.legend(fontsize=8)
    harness.save_figure(fig, path)


async def run(args: argparse.Namespace) -> dict:
    async with harness.servers(args.theta_url, args.t_url, max_logprobs=max(max(args.ks), 20),
                              skip_tokenizer_init=args.skip_tokenizer_init) as (theta_url, t_url):
        rows = [row for k in args.ks for row in await measure(theta_url, t_url, k, args)]
    return {"machine": harness.machine(), "command": " ".join(["python", *sys.argv]), "rows": rows}


def main() -> None:
    parser = harness.argument_parser(__doc__, live_servers=True)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--ks", type=int, nargs="+", default=[20, 96], help="top_k values (96: see above)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per sequence per run")
    parser.add_argument("--repeats", type=int, default=3, help="measured runs per batch size")
    parser.add_argument("--round-trips", type=int, default=20, help="single-prompt round trips of each kind per run")
    parser.add_argument("--skip-tokenizer-init", action="store_true",
                        help="servers without tokenizers (the coordinator tokenizes: local_tokenizers)")
    parser.add_argument("--output", type=Path, default=harness.RESULTS_DIR / "per_token_latency.json")
    args = parser.parse_args()
    harness.finish(loop.run(run(args)), args.output, plot)


if __name__ == "__main__":
    main()
