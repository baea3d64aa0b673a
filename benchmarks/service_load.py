"""Load test of the q* service: concurrent HTTP clients against the same workload through the Python API.

    python benchmarks/service_load.py                          # starts the bundled tiny models with the plugin
    python benchmarks/service_load.py --clients 32 --seconds 60 --tokens 16 --repeats 2
    python benchmarks/service_load.py --theta-url URL --t-url URL --mode per_token

Two arms on the same two servers, alternating `--repeats` times:
- `python_api`: one DualVLLMCoordinator in this process; `--clients` asyncio tasks each call
  `generate_batch([prompt], ...)` back to back.
- `service`: `dualvllm serve --theta-url ... --t-url ...` in its own process (the way it is
  deployed); `--clients` aiohttp clients here each POST /v1/completions back to back.
Every request is one held-out prompt, `--tokens` tokens (ignore_eos), temperature 1, its
own seed. After a warm-up, each arm runs `--seconds`; requests finished inside the window
count, those still running at its end are dropped (same rule for both arms). Reported per
arm: requests, tokens/s, request latency p50/p95, and CPU seconds per 1,000 tokens of the
servers, of the coordinator's process (the service's, or this one for the Python API) and
of this process's HTTP clients. Writes benchmarks/results/service_load.json and .png.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import aiohttp
import numpy as np
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `benchmarks` is not an installed package

from dualvllm.common import loop  # noqa: E402
from benchmarks import harness  # noqa: E402
from dualvllm.coordinator import CoordinatorConfig, DualVLLMCoordinator  # noqa: E402

WARMUP_S = 5.0
# How long `dualvllm serve` may take to open its coordinator on running servers.
SERVICE_START_TIMEOUT_S = 120.0
# How long it may take to stop (it closes its coordinator and the open sequences).
SERVICE_STOP_TIMEOUT_S = 30.0
ARMS = ("python_api", "service")


async def drive(request: Callable[[int], Awaitable[int]], clients: int, seconds: float) -> dict[str, Any]:
    """`clients` loops of `request(seed) -> tokens` for `seconds` (after a warm-up): what finished in time."""
    latencies: list[float] = []
    tokens = 0
    deadline = 0.0

    async def client(number: int) -> None:
        nonlocal tokens
        seed = number * 1_000_000
        while True:
            started = time.perf_counter()
            got = await request(seed)
            seed += 1
            finished = time.perf_counter()
            if deadline and started >= deadline - seconds and finished <= deadline:
                latencies.append(finished - started)
                tokens += got

    tasks = [asyncio.create_task(client(i)) for i in range(clients)]
    try:
        await asyncio.sleep(WARMUP_S)
        deadline = time.perf_counter() + seconds
        await asyncio.sleep(seconds)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    failed = next((t.exception() for t in tasks if not t.cancelled() and t.exception()), None)
    if failed is not None:
        raise failed
    ms = np.asarray(latencies) * 1e3
    return {"requests": len(latencies), "tokens": tokens, "tokens_per_s": tokens / seconds,
            "latency_p50_ms": float(np.percentile(ms, 50)) if ms.size else float("nan"),
            "latency_p95_ms": float(np.percentile(ms, 95)) if ms.size else float("nan")}


async def python_api(args: Any, theta: str, t: str, prompts: list[str]) -> dict[str, Any]:
    config = CoordinatorConfig(theta_url=theta, t_url=t, top_k=args.top_k, mode=args.mode)
    async with DualVLLMCoordinator(config) as c:
        async def request(seed: int) -> int:
            [output] = await c.generate_batch([prompts[seed % len(prompts)]], max_tokens=args.tokens, seed=seed,
                                              ignore_eos=True)
            return len(output.generated_tokens)

        return await measured(args, theta, t, request, coordinator_pid=os.getpid())


async def service(args: Any, theta: str, t: str, prompts: list[str]) -> dict[str, Any]:
    async with running_service(args, theta, t) as (url, model, pid):
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=args.clients)) as session:
            async def request(seed: int) -> int:
                body = {"model": model, "prompt": prompts[seed % len(prompts)], "max_tokens": args.tokens,
                        "seed": seed, "dualvllm": {"ignore_eos": True}}
                async with session.post(url + "/completions", json=body) as response:
                    answer = await response.json()
                    if response.status != 200:
                        raise RuntimeError(f"the service answered {response.status}: {answer}")
                    return answer["usage"]["completion_tokens"]

            return await measured(args, theta, t, request, coordinator_pid=pid)


async def measured(args: Any, theta: str, t: str, request: Callable[[int], Awaitable[int]], *,
                   coordinator_pid: int) -> dict[str, Any]:
    servers = [harness.ServerCPU(theta), harness.ServerCPU(t)]
    coordinator, here = psutil.Process(coordinator_pid), psutil.Process()
    cpu_before = [s.seconds() for s in servers], _cpu(coordinator), _cpu(here)
    result = await drive(request, args.clients, args.seconds)
    cpu_after = [s.seconds() for s in servers], _cpu(coordinator), _cpu(here)
    per_1k = 1000 / max(result["tokens"], 1)
    result["servers_cpu_s_per_1k_tokens"] = sum(cpu_after[0]) - sum(cpu_before[0])
    result["servers_cpu_s_per_1k_tokens"] *= per_1k
    result["coordinator_cpu_s_per_1k_tokens"] = (cpu_after[1] - cpu_before[1]) * per_1k
    if coordinator_pid != os.getpid():
        result["clients_cpu_s_per_1k_tokens"] = (cpu_after[2] - cpu_before[2]) * per_1k
    return result


@contextlib.asynccontextmanager
async def running_service(args: Any, theta: str, t: str, *flags: str) -> AsyncIterator[tuple[str, str, int]]:
    """(API base URL, model name, pid) of `dualvllm serve` on the two servers, in its own process
    (`flags`: more of its flags)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dualvllm", "serve", "--theta-url", theta, "--t-url", t, "--service-port", "0",
        "--top-k", str(args.top_k), "--mode", args.mode, "--max-batch-size", "64", *flags,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, cwd=REPO)
    try:
        assert process.stdout is not None
        seen = []
        async with asyncio.timeout(SERVICE_START_TIMEOUT_S):
            while True:
                line = (await process.stdout.readline()).decode()
                if not line:
                    raise RuntimeError("dualvllm serve exited:\n" + "".join(seen))
                seen.append(line)
                found = re.match(r"q\* endpoint: (\S+)\s+\(model '([^']+)'", line)
                if found:
                    break
        drain = asyncio.create_task(process.stdout.read())  # keep its pipe from filling
        yield found.group(1), found.group(2), process.pid
        drain.cancel()
    finally:
        if process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), SERVICE_STOP_TIMEOUT_S)
            except TimeoutError:
                print(f"dualvllm serve (pid {process.pid}) ignored SIGTERM for {SERVICE_STOP_TIMEOUT_S:g} s; "
                      "killing it", flush=True)
                process.kill()
                await process.wait()


def _cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


async def run(args: Any) -> dict[str, Any]:
    prompts = harness.prompts_for(400, seed=0)
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    lockstep = args.mode != "per_token"
    async with harness.servers(args.theta_url, args.t_url, max_logprobs=args.top_k, lockstep=lockstep) as (theta, t):
        for repeat in range(args.repeats):
            for arm in ARMS:
                result = await (python_api if arm == "python_api" else service)(args, theta, t, prompts)
                runs[arm].append(result)
                print(f"repeat {repeat} {arm:>10}: {result['requests']} requests, {result['tokens_per_s']:.1f} "
                      f"tokens/s, latency p50 {result['latency_p50_ms']:.0f} ms, p95 "
                      f"{result['latency_p95_ms']:.0f} ms", flush=True)
    summary = {arm: {key: statistics.median(r[key] for r in results) for key in results[0]}
               for arm, results in runs.items()}
    api, http = summary["python_api"], summary["service"]
    ratios = {
        "tokens_per_s_service_over_api": statistics.median(
            s["tokens_per_s"] / a["tokens_per_s"] for s, a in zip(runs["service"], runs["python_api"])),
        "latency_p50_service_over_api": http["latency_p50_ms"] / api["latency_p50_ms"],
        "latency_p95_service_over_api": http["latency_p95_ms"] / api["latency_p95_ms"],
    }
    print(f"service / Python API: tokens/s x{ratios['tokens_per_s_service_over_api']:.3f}, latency p50 "
          f"x{ratios['latency_p50_service_over_api']:.3f}, p95 x{ratios['latency_p95_service_over_api']:.3f}")
    return {"machine": harness.machine(), "command": " ".join(["python", *sys.argv]), "mode": args.mode,
            "clients": args.clients, "seconds": args.seconds, "tokens_per_request": args.tokens,
            "top_k": args.top_k, "repeats": args.repeats, "runs": runs, "median": summary, "ratios": ratios}


def plot(report: dict, path: Path) -> None:
    plt = harness.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    arms = list(report["median"])
    axes[0].bar(arms, [report["median"][a]["tokens_per_s"] for a in arms])
    axes[0].set(ylabel="tokens/s", title=f"{report['clients']} clients, {report['seconds']:g} s")
    for i, key in enumerate(("latency_p50_ms", "latency_p95_ms")):
        axes[1].bar([x + 0.4 * i for x in range(len(arms))], [report["median"][a][key] for a in arms], width=0.4,
                    label=key.split("_")[1])
    axes[1].set(xticks=[x + 0.2 for x in range(len(arms))], xticklabels=arms, ylabel="request latency (ms)")
    axes[1].legend()
    harness.save_figure(fig, path)


def main() -> None:
    parser = harness.argument_parser(__doc__, live_servers=True)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--tokens", type=int, default=16, help="tokens per request (ignore_eos)")
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--mode", choices=("auto", "lockstep", "per_token"), default="auto")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--output", type=Path, default=harness.RESULTS_DIR / "service_load.json")
    args = parser.parse_args()
    harness.finish(loop.run(run(args)), args.output, plot)


if __name__ == "__main__":
    main()
