"""Lockstep with the engine core's spin lowered (engines/vllm_plugin/spin.py) against vLLM's own.

    python benchmarks/lockstep_spin.py                     # vLLM's 1 s spin vs 0.001 s; batch 1 8 64; 32 tokens
    python benchmarks/lockstep_spin.py --spins vllm 0.001 0 --batch-sizes 1 8 64 --tokens 32 --repeats 3

For each spin setting, a pair of the bundled tiny models is started with the lockstep plugin
and that setting (`ServerConfig.lockstep_engine_spin_s`; `vllm` = None, vLLM's own 1 s and
5 s recheck). Per batch size, back to back after a warm-up: lockstep `generate_batch`
(ignore_eos, temperature 1) and native generation of as many tokens by the base alone; tokens/s
and the CPU-seconds per 1,000 tokens of each server's process tree and of this process. While
one more lockstep batch runs, plain 4-token completions go to the base server one after
another: their latency shows whether the lowered spin costs ordinary requests (a wake-up the
engine missed would cost a recheck interval: 5 s with vLLM's, 20 ms with the plugin's).
Settings run one after the other on a fresh pair each, so compare them within one run.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import sys
import time
from pathlib import Path

import harness

from coordinator.config import CoordinatorConfig
from coordinator.core import DualVLLMCoordinator
from engines.vllm_client import VLLMClient

PLAIN_TOKENS = 4


async def measure_setting(spin: float | None, args) -> list[dict]:
    rows = []
    async with contextlib.AsyncExitStack() as stack:
        theta_url, t_url = await stack.enter_async_context(harness.servers(
            None, None, max_logprobs=args.top_k, lockstep=True, lockstep_engine_spin_s=spin))
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
            runs: dict[str, list[dict]] = {name: [] for name in arms}
            for repeat in range(args.repeats):
                for name, arm in arms.items():
                    runs[name].append(await harness.timed(lambda: arm(repeat + 1), cpus))
            latencies = await plain_latencies(native, model, lockstep_arm(args.repeats + 1))
            row = {"spin": "vllm" if spin is None else spin, "batch_size": batch, "tokens_per_sequence": args.tokens}
            for name, measured in runs.items():
                for key in measured[0]:
                    row[f"{name}_{key}"] = statistics.median(m[key] for m in measured)
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
    print(f"spin {row['spin']!s:>6}  batch {row['batch_size']:>3}: lockstep {row['lockstep_tokens_per_s']:7.1f} tok/s "
          f"({row['lockstep_over_native']:.2f}x native {row['native_tokens_per_s']:7.1f}); CPU s per 1k tokens "
          f"coordinator/theta/t {row['lockstep_coordinator_cpu_s_per_1k_tokens']:.3f} / "
          f"{row['lockstep_theta_server_cpu_s_per_1k_tokens']:.2f} / {row['lockstep_t_server_cpu_s_per_1k_tokens']:.2f}; "
          f"{row['plain_requests']} plain requests meanwhile: median {row['plain_latency_ms_median']:.0f} ms, "
          f"max {row['plain_latency_ms_max']:.0f} ms", flush=True)


def plot(report: dict, path: Path) -> None:
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(5, 4.2))
    for spin in dict.fromkeys(r["spin"] for r in report["rows"]):
        rows = [r for r in report["rows"] if r["spin"] == spin]
        ax.plot([r["batch_size"] for r in rows], [r["lockstep_over_native"] for r in rows], marker="o",
                label=f"engine spin {spin}")
    ax.set_xscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("lockstep tokens/s / native")
    ax.legend()
    harness.save_figure(fig, path)


def main() -> None:
    parser = harness.argument_parser(__doc__, live_servers=False)
    parser.add_argument("--spins", nargs="+", default=["vllm", "0.001"],
                        help="engine spin settings in seconds; 'vllm' = vLLM's own (1 s, 5 s recheck)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, default=harness.RESULTS_DIR / "lockstep_spin.json")
    args = parser.parse_args()
    rows = []
    for spin in args.spins:
        rows += asyncio.run(measure_setting(None if spin == "vllm" else float(spin), args))
    harness.finish({"machine": harness.machine(), "command": " ".join(["python", *sys.argv]), "rows": rows},
                   args.output, plot)


if __name__ == "__main__":
    main()
