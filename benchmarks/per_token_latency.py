"""Per-token latency of the coordinator against two live vLLM servers.

One coordinator step = one batched top-k request to each server (concurrently), then
merge, alpha* and sampling for every active sequence. At batch size B every step
yields B tokens, so the step latency is the per-token latency each sequence sees.

    python benchmarks/per_token_latency.py                       # starts the bundled tiny models
    python benchmarks/per_token_latency.py --theta-url URL --t-url URL --batch-sizes 1 8 64

For each batch size: a warm-up run, then `--repeats` runs of `--tokens` tokens per
sequence (ignore_eos, so the batch stays full); reports the median over runs of each
run's median and p95 step latency, and tokens/s. Writes JSON (units in the keys).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

import tinymodels
from coordinator import CoordinatorConfig, DualVLLMCoordinator
from engines.launcher import launch_pair, pair_configs
from tinymodels.task import problems


async def measure(coordinator: DualVLLMCoordinator, batch_size: int, tokens: int, seed: int) -> dict[str, float]:
    """One run: `batch_size` sequences of exactly `tokens` tokens; step latencies from the stats."""
    prompts = [p.prompt for p in problems("test", n=batch_size, seed=seed)]
    prompts = (prompts * (batch_size // len(prompts) + 1))[:batch_size]
    steps_before = coordinator.get_statistics()["steps"]
    started = time.perf_counter()
    outputs = await coordinator.generate_batch(prompts, max_tokens=tokens, seed=seed, ignore_eos=True)
    seconds = time.perf_counter() - started
    failed = [o.error for o in outputs if not o.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} sequences failed during the benchmark; first: {failed[0]}")
    # The coordinator keeps recent step latencies; this run's are the last `tokens` steps.
    run_steps = coordinator.get_statistics()["steps"] - steps_before
    assert run_steps == tokens, f"expected {tokens} full steps, the coordinator took {run_steps}"
    latencies_ms = np.asarray(coordinator.recent_step_latencies_s()[-tokens:]) * 1e3
    return {
        "step_median_ms": float(np.median(latencies_ms)),
        "step_p95_ms": float(np.percentile(latencies_ms, 95)),
        "tokens_per_s": batch_size * tokens / seconds,
    }


async def run(args: argparse.Namespace) -> dict:
    async with contextlib.AsyncExitStack() as stack:
        theta_url, t_url = args.theta_url, args.t_url
        if theta_url is None or t_url is None:
            base, teacher = pair_configs(str(tinymodels.BASE_DIR), str(tinymodels.TEACHER_DIR),
                                         max_logprobs=max(args.top_k, 20), dtype=tinymodels.SERVER_DTYPE)
            theta, t = await stack.enter_async_context(launch_pair(base, teacher))
            theta_url, t_url = theta.url, t.url
        config = CoordinatorConfig(theta_url=theta_url, t_url=t_url, top_k=args.top_k,
                                   max_batch_size=max(args.batch_sizes))
        coordinator = await stack.enter_async_context(DualVLLMCoordinator(config))
        results = []
        for batch_size in args.batch_sizes:
            await measure(coordinator, batch_size, min(args.tokens, 4), seed=0)  # warm-up
            runs = [await measure(coordinator, batch_size, args.tokens, seed=r + 1) for r in range(args.repeats)]
            row = {"batch_size": batch_size, "top_k": args.top_k, "tokens_per_sequence": args.tokens,
                   "repeats": args.repeats}
            for key in runs[0]:
                row[key] = statistics.median(r[key] for r in runs)
            row["step_median_ms_per_run"] = [round(r["step_median_ms"], 2) for r in runs]
            results.append(row)
            print(f"batch {batch_size:>4}  per-token latency median {row['step_median_ms']:7.1f} ms  "
                  f"p95 {row['step_p95_ms']:7.1f} ms  {row['tokens_per_s']:8.1f} tokens/s  "
                  f"(run medians {row['step_median_ms_per_run']})", flush=True)
    return {"machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, "
                       f"{__import__('os').cpu_count()} cores", "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--theta-url", help="running base server; default: start the bundled tiny models")
    parser.add_argument("--t-url", help="running teacher server")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--tokens", type=int, default=32, help="tokens per sequence per run")
    parser.add_argument("--repeats", type=int, default=3, help="measured runs per batch size")
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/per_token_latency.json"))
    args = parser.parse_args()
    report = asyncio.run(run(args))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
