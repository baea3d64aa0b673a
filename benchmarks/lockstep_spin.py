"""Lockstep on server pairs that do not spin: the engine-spin hook, core binding, the uni executor.

    python benchmarks/lockstep_spin.py                     # vllm-spin spin-hook nobind uni; batch 1 8 64; 32 tokens
    python benchmarks/lockstep_spin.py --variants spin-hook uni vllm-spin nobind uni-nobind --rounds 2 \
        --batch-sizes 1 8 64 --tokens 32 --repeats 2 --output benchmarks/figures/lockstep_spin.json

vLLM's engine core busy-waits 1 s on its worker after every read, so a lockstep server spins
through every wait on the coordinator. Each variant (VARIANTS) is one remedy or its absence,
as ServerConfig fields set on both servers of a pair of the bundled tiny models:
`lockstep_engine_spin_s` (the hook of engines/vllm_plugin/spin.py, or vLLM's own 1 s spin and
5 s recheck), `cpu_cores` (each server bound to its own core, or nobind) and `cpu_executor`
(vLLM's mp worker process, or uni: the model inside the engine core, no queue to spin on).
Per batch size, back to back after a warm-up: lockstep `generate_batch` (ignore_eos,
temperature 1) and native generation of as many tokens by the base alone; tokens/s and the
CPU-seconds per 1,000 tokens of each server's process tree and of this process. While one
more lockstep batch runs, plain 4-token completions go to the base server one after
another: their latency shows whether a variant costs ordinary requests (a wake-up the
engine missed would cost a recheck interval: 5 s with vLLM's, 20 ms with the hook's).
Variants run one after the other on a fresh pair each, so compare them within one run; a
variant whose pair fails to start or to run lockstep is recorded with its error, and the
run goes on. `--rounds 2` runs the list twice over, so that a change in the machine's load
(the machine is shared) hits every variant. Server logs:
benchmarks/results/lockstep_spin_logs/VARIANT-roundN/.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import sys
import time
from pathlib import Path

import harness

from dualvllm.common import loop
from dualvllm.common.errors import DualVLLMError
from dualvllm.coordinator.config import CoordinatorConfig
from dualvllm.coordinator.core import DualVLLMCoordinator
from dualvllm.engines.vllm_client import VLLMClient

PLAIN_TOKENS = 4
LOG_DIR = harness.RESULTS_DIR / "lockstep_spin_logs"
# name -> the ServerConfig fields it sets on both servers; the rest keep the launcher's defaults
# (mp executor, each server bound to its own core, the spin hook at 1 ms).
VARIANTS: dict[str, dict[str, object]] = {
    "vllm-spin": {"lockstep_engine_spin_s": None},  # vLLM's own 1 s spin, 5 s recheck
    "spin-hook": {"lockstep_engine_spin_s": 0.001},
    "nobind": {"cpu_cores": None, "lockstep_engine_spin_s": 0.001},  # every server's threads on every core
    "nobind-vllm-spin": {"cpu_cores": None, "lockstep_engine_spin_s": None},
    # No shared-memory queue between engine core and model, so nothing for the hook to lower.
    "uni": {"cpu_executor": "uni", "lockstep_engine_spin_s": None},
    "uni-nobind": {"cpu_executor": "uni", "cpu_cores": None, "lockstep_engine_spin_s": None},
}


async def measure_variant(name: str, round_: int, args) -> list[dict]:
    """The variant's rows, one per batch size; or one row with the error that stopped it."""
    try:
        return await measure_pair(name, round_, args)
    except (DualVLLMError, AssertionError) as exc:
        error = f"{type(exc).__name__}: {exc}"
        print(f"{name}: failed: {error}", flush=True)
        return [{"variant": name, "round": round_, "error": error}]


async def measure_pair(name: str, round_: int, args) -> list[dict]:
    rows = []
    async with contextlib.AsyncExitStack() as stack:
        theta_url, t_url = await stack.enter_async_context(harness.servers(
            None, None, max_logprobs=args.top_k, lockstep=True, log_dir=LOG_DIR / f"{name}-round{round_}",
            **VARIANTS[name]))
        cpus = (harness.ServerCPU(theta_url), harness.ServerCPU(t_url))
        native = await stack.enter_async_context(VLLMClient(theta_url, name="theta", request_timeout_s=600))
        model = (await native.model_info()).name
        config = CoordinatorConfig(theta_url=theta_url, t_url=t_url, top_k=args.top_k,
                                   max_batch_size=max(args.batch_sizes), mode="lockstep")
        lockstep = await stack.enter_async_context(DualVLLMCoordinator(config))
        for batch in args.batch_sizes:
            prompts = harness.prompts_for(batch, seed=0)
            prompt_ids = [await native.tokenize(p) for p in prompts]

            async def lockstep_arm(seed: int) -> int:
                outs = await lockstep.generate_batch(prompts, max_tokens=args.tokens, seed=seed, ignore_eos=True)
                assert all(o.ok and len(o.generated_tokens) == args.tokens for o in outs), outs[0].error
                return batch * args.tokens

            async def native_arm(seed: int) -> int:
                body = await native.call("POST", "/v1/completions", {
                    "model": model, "prompt": prompt_ids, "max_tokens": args.tokens, "ignore_eos": True,
                    "temperature": 1.0, "seed": seed})
                assert body["usage"]["completion_tokens"] == batch * args.tokens, body["usage"]
                return batch * args.tokens

            arms = {"lockstep": lockstep_arm, "native": native_arm}
            for arm in arms.values():
                await arm(0)
            runs: dict[str, list[dict]] = {arm_name: [] for arm_name in arms}
            for repeat in range(args.repeats):
                for arm_name, arm in arms.items():
                    runs[arm_name].append(await harness.timed(lambda: arm(repeat + 1), cpus))
            latencies = await plain_latencies(native, model, lockstep_arm(args.repeats + 1))
            row = {"variant": name, "round": round_, "batch_size": batch, "tokens_per_sequence": args.tokens}
            for arm_name, measured in runs.items():
                for key in measured[0]:
                    row[f"{arm_name}_{key}"] = statistics.median(m[key] for m in measured)
            row["lockstep_over_native"] = statistics.median(
                a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs["lockstep"], runs["native"]))
            row |= {"plain_requests": len(latencies), "plain_latency_ms_median": 1e3 * statistics.median(latencies),
                    "plain_latency_ms_max": 1e3 * max(latencies)}
            print_row(row)
            rows.append(row)
    return rows


async def plain_latencies(client: VLLMClient, model: str, running) -> list[float]:
    """Seconds of each plain request sent, one after another, while `running` (a lockstep batch) runs."""
    task = asyncio.ensure_future(running)
    latencies = []
    try:
        while not task.done() or not latencies:
            started = time.perf_counter()
            await client.call("POST", "/v1/completions", {"model": model, "prompt": "1+1=", "max_tokens": PLAIN_TOKENS,
                                                          "temperature": 0.0})
            latencies.append(time.perf_counter() - started)
        await task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return latencies


def print_row(row: dict) -> None:
    print(f"{row['variant']:>16} (round {row['round']})  batch {row['batch_size']:>3}: "
          f"lockstep {row['lockstep_tokens_per_s']:7.1f} tok/s "
          f"({row['lockstep_over_native']:.2f}x native {row['native_tokens_per_s']:7.1f}); CPU s per 1k tokens "
          f"coordinator/theta/t {row['lockstep_coordinator_cpu_s_per_1k_tokens']:.3f} / "
          f"{row['lockstep_theta_server_cpu_s_per_1k_tokens']:.2f} / {row['lockstep_t_server_cpu_s_per_1k_tokens']:.2f}; "
          f"{row['plain_requests']} plain requests meanwhile: median {row['plain_latency_ms_median']:.0f} ms, "
          f"max {row['plain_latency_ms_max']:.0f} ms", flush=True)


def plot(report: dict, path: Path) -> None:
    """Lockstep tokens/s and lockstep / native against batch size, one line per variant (median of rounds)."""
    plt = harness.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 4.2))
    measured = [r for r in report["rows"] if "error" not in r]
    for name in dict.fromkeys(r["variant"] for r in measured):
        batches = sorted({r["batch_size"] for r in measured if r["variant"] == name})
        for ax, key in zip(axes, ("lockstep_tokens_per_s", "lockstep_over_native")):
            values = [statistics.median(r[key] for r in measured if r["variant"] == name and r["batch_size"] == b)
                      for b in batches]
            ax.plot(batches, values, marker="o", label=name)
    axes[0].set(xscale="log", yscale="log", xlabel="batch size", ylabel="lockstep tokens/s")
    axes[1].set(xscale="log", xlabel="batch size", ylabel="lockstep tokens/s / native")
    axes[0].legend(fontsize=8)
    harness.save_figure(fig, path)


def main() -> None:
    parser = harness.argument_parser(__doc__, live_servers=False)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=["vllm-spin", "spin-hook", "nobind", "uni"],
                        help="server pairs to compare, each started fresh in this order (VARIANTS)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the variant list this many times over (a change in load then hits every variant)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, default=harness.RESULTS_DIR / "lockstep_spin.json")
    args = parser.parse_args()
    rows = []
    for round_ in range(1, args.rounds + 1):
        for name in args.variants:
            rows += loop.run(measure_variant(name, round_, args))
    harness.finish({"machine": harness.machine(), "command": " ".join(["python", *sys.argv]),
                    "variants": {name: VARIANTS[name] for name in args.variants}, "rows": rows},
                   args.output, plot)


if __name__ == "__main__":
    main()
