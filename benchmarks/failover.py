"""Replica pools: a base replica SIGKILLed mid-run and restarted, and 1 pair against 2.

    python benchmarks/failover.py                                   # all parts, ~30 min on 2 cores
    python benchmarks/failover.py --parts generate throughput --prompts 512 --batch-sizes 64
    python benchmarks/failover.py --mode lockstep --output benchmarks/results/failover_lockstep.json

Starts 2 + 2 servers of the bundled tiny models (the bases in dev mode, for pushes), then:
--mode lockstep starts the servers with the lockstep plugin and runs every part in lockstep
mode (training picks it by itself: its default mode is auto).
- `throughput`: the Python API in --mode, pair A/C alone against both pairs, at
  each --batch-sizes; tokens/s and the CPU seconds per 1,000 tokens of the four servers
  together and of this process. On 2 cores the servers share the cores whatever the pool,
  so 2 pairs cannot be faster; the point is whether the pool adds a serial cost.
- `generate`: `dualvllm generate --theta-urls A B --t-urls C D` over --prompts prompts,
  once uninterrupted and once with base replica B SIGKILLed once --kill-at of the records
  are written, and started again on its port --restart-after seconds later. Reports the
  records written, lost (input ids missing from the output), duplicated and failed; the
  records whose tokens differ from the uninterrupted run's (same --seed), and how far log q*
  of the same tokens is from it; the wall seconds
  the kill cost; when the pool marked B down and when B rejoined (from the run's log).
- `train`: `dualvllm train --theta-urls A B --t-urls C D` for --train-steps updates, B
  killed after update 2 and restarted as above. Reports the base replicas every update's
  weights were pushed into (each verified) and when B rejoined.

The parts share the servers and run in that order (a restarted B serves the later parts;
training leaves A and B on different weights, so it runs last).
Writes benchmarks/results/failover.json (units in keys) and failover.png.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `benchmarks` is not an installed package

from dualvllm.common import loop  # noqa: E402
from benchmarks import harness  # noqa: E402
from dualvllm.coordinator import CoordinatorConfig, DualVLLMCoordinator  # noqa: E402
from dualvllm.engines.launcher import VLLMServer, launch_replicas, replica_configs  # noqa: E402

# In this order: training leaves the two base replicas with different weights (the
# restarted one rejoins a later run only after a push), so it runs last.
PARTS = ("throughput", "generate", "train")
DOWN, REJOIN = re.compile(r"theta replica (\S+) is down"), re.compile(r"theta replica (\S+) passed /health")


@dataclass
class Run:
    """A `dualvllm` subprocess whose stderr lines are kept with the second they arrived."""

    args: list[str]
    started: float = field(default_factory=time.monotonic)
    lines: list[tuple[float, str]] = field(default_factory=list)
    ended: float | None = None  # seconds into the run when its stderr closed (it exited)

    def __post_init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "dualvllm", *self.args],
            cwd=REPO,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append((time.monotonic() - self.started, line.rstrip()))
        self.ended = time.monotonic() - self.started

    async def finish(self) -> tuple[float, str]:
        """(wall seconds, stdout) once it exits; raises with its log's tail if it failed."""
        stdout, _ = await asyncio.to_thread(self.process.communicate)
        self._reader.join()
        assert self.ended is not None
        seconds = self.ended  # not now: the caller may have waited on something else first
        if self.process.returncode != 0:
            raise RuntimeError(
                f"dualvllm {self.args[0]} exited {self.process.returncode}:\n"
                + "\n".join(line for _, line in self.lines[-30:])
            )
        return seconds, stdout

    def first(self, pattern: re.Pattern[str]) -> float | None:
        """Seconds into the run of the first log line matching `pattern`."""
        return next((t for t, line in self.lines if pattern.search(line)), None)


class Servers:
    """The 2 + 2 servers, in pair order [theta-0, t-0, theta-1, t-1]; kill and restart theta-1."""

    def __init__(self, servers: list[VLLMServer], log_dir: Path) -> None:
        self.all, self.log_dir, self.restarts = servers, log_dir, 0

    def urls(self, role: int, pairs: int = 2) -> list[str]:
        return [s.url for s in self.all[role::2][:pairs]]

    def pool_flags(self) -> list[str]:
        return ["--theta-urls", *self.urls(0), "--t-urls", *self.urls(1)]

    async def kill_and_restart(self, delay_s: float) -> dict[str, float]:
        """SIGKILL theta-1, start it again on its port `delay_s` later -> the seconds each took."""
        victim = self.all[2]
        assert victim.pid is not None
        killed = time.monotonic()
        os.killpg(victim.pid, signal.SIGKILL)
        victim.stop()  # reaps it
        await asyncio.sleep(delay_s)
        self.restarts += 1
        restarted = VLLMServer(
            victim.config.model_copy(
                update={"port": victim.port, "log_path": self.log_dir / f"theta-1-restart-{self.restarts}.log"}
            ),
            name=victim.name,
        )
        await restarted.start()
        self.all[2] = restarted
        return {
            "killed_at": killed,
            "healthy_again_s": time.monotonic() - killed,
            "restart_cpu_s": harness.ServerCPU(restarted.url).seconds(),
        }


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


async def part_generate(args: Any, servers: Servers, work: Path) -> dict[str, Any]:
    inputs = work / "prompts.jsonl"
    inputs.write_text(
        "".join(
            json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(harness.prompts_for(args.prompts, seed=21))
        )
    )
    command = [
        "generate",
        "--input",
        str(inputs),
        "--max-tokens",
        str(args.max_tokens),
        "--seed",
        str(args.seed),
        "--max-batch-size",
        str(args.batch),
        "--mode",
        args.mode,
        "--replica-probe-interval",
        "1",
        "--quiet",
        *servers.pool_flags(),
    ]
    reference_seconds, _ = await Run([*command, "--output", str(work / "uninterrupted.jsonl")]).finish()
    print(f"generate: uninterrupted run {reference_seconds:.1f} s", flush=True)

    output = work / "killed.jsonl"
    run = Run([*command, "--output", str(output)])
    while len(jsonl(output)) < args.prompts * args.kill_at:
        assert run.process.poll() is None, "the run ended before the kill"
        await asyncio.sleep(0.1)
    restart = await servers.kill_and_restart(args.restart_after)
    seconds, stdout = await run.finish()
    kill_s = restart["killed_at"] - run.started
    written = jsonl(output)
    reference = {r["id"]: r for r in jsonl(work / "uninterrupted.jsonl")}
    ids = [r["id"] for r in written]
    differ = sum(1 for r in written if r["generated_tokens"] != reference[r["id"]]["generated_tokens"])
    # log q* of the same tokens: equal, or off in the last bits. The step math's float64
    # rounding depends on which rows are decided together (its arrays are as wide as the
    # batch's widest merged row), and in lockstep mode that depends on the servers' timing.
    gaps = [
        max((abs(a - b) for a, b in zip(r["logprobs_q"], reference[r["id"]]["logprobs_q"])), default=0.0)
        for r in written
        if r["generated_tokens"] == reference[r["id"]]["generated_tokens"]
    ]
    failed = int(re.search(r"(\d+) failed of", stdout).group(1))  # type: ignore[union-attr]
    down, rejoin = run.first(DOWN), run.first(REJOIN)
    result = {
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "records_written": len(written),
        "records_lost": len(set(map(str, range(args.prompts))) - set(ids)),
        "records_duplicated": len(ids) - len(set(ids)),
        "records_failed": failed,
        "records_with_other_tokens": differ,
        "records_with_other_logprobs_q": sum(1 for gap in gaps if gap > 0),
        "max_logprob_q_gap": max(gaps, default=0.0),
        "uninterrupted_s": reference_seconds,
        "with_kill_s": seconds,
        "kill_cost_s": seconds - reference_seconds,
        "killed_at_s": kill_s,
        "marked_down_after_kill_s": down - kill_s if down is not None else None,
        "restarted_healthy_after_kill_s": restart["healthy_again_s"],
        "restart_cpu_s": restart["restart_cpu_s"],
        "rejoined_after_kill_s": rejoin - kill_s if rejoin is not None else None,
    }
    print("generate:", json.dumps(result), flush=True)
    return result


async def part_train(args: Any, servers: Servers, work: Path) -> dict[str, Any]:
    out = work / "train"
    run = Run(
        [
            "train",
            "--config",
            str(REPO / "recipes" / "tiny-arith.yaml"),
            "--output-dir",
            str(out),
            *servers.pool_flags(),
            "--steps",
            str(args.train_steps),
            "--prompts-per-step",
            "4",
            "--group-size",
            "4",
            "--max-tokens",
            "6",
            "--eval-prompts",
            "16",
            "--eval-every",
            str(args.train_steps),
            "--seed",
            str(args.seed),
        ]
    )
    while not any(r.get("step") == 2 and "event" not in r for r in jsonl(out / "metrics.jsonl")):
        assert run.process.poll() is None, "the run ended before the kill:\n" + "\n".join(l for _, l in run.lines[-20:])
        await asyncio.sleep(0.2)
    restart = await servers.kill_and_restart(args.restart_after)
    seconds, _ = await run.finish()
    kill_s = restart["killed_at"] - run.started
    steps = [r for r in jsonl(out / "metrics.jsonl") if "event" not in r]
    rejoin = run.first(REJOIN)
    result = {
        "steps": len(steps),
        "wall_s": seconds,
        "killed_after_step": 2,
        "push_replicas_per_step": [r["push_replicas"] for r in steps],
        "push_max_abs_diff_max": max(
            (r["push_max_abs_diff"] for r in steps if r["push_max_abs_diff"] is not None), default=None
        ),
        "marked_down_after_kill_s": (run.first(DOWN) or kill_s) - kill_s,
        "restarted_healthy_after_kill_s": restart["healthy_again_s"],
        "rejoined_after_kill_s": rejoin - kill_s if rejoin is not None else None,
    }
    print("train:", json.dumps(result), flush=True)
    return result


async def part_throughput(args: Any, servers: Servers) -> list[dict[str, Any]]:
    rows = []
    for batch in args.batch_sizes:
        prompts = harness.prompts_for(batch, seed=5)
        runs: dict[int, list[dict[str, float]]] = {1: [], 2: []}
        for _ in range(args.repeats):
            for pairs in (1, 2):
                runs[pairs].append(await _timed(servers, pairs, prompts, args))
        row: dict[str, Any] = {"batch_size": batch}
        for pairs, results in runs.items():
            for key in results[0]:
                row[f"{pairs}_pair_{key}"] = statistics.median(r[key] for r in results)
        row["tokens_per_s_2_over_1"] = statistics.median(
            b["tokens_per_s"] / a["tokens_per_s"] for a, b in zip(runs[1], runs[2])
        )
        print("throughput:", json.dumps(row), flush=True)
        rows.append(row)
    return rows


async def _timed(servers: Servers, pairs: int, prompts: list[str], args: Any) -> dict[str, float]:
    config = CoordinatorConfig(
        theta_urls=servers.urls(0, pairs),
        t_urls=servers.urls(1, pairs),
        mode=args.mode,
        max_batch_size=len(prompts),
        top_k=args.top_k,
    )
    cpus = [harness.ServerCPU(s.url) for s in servers.all]
    async with DualVLLMCoordinator(config) as c:
        before = (time.process_time(), sum(cpu.seconds() for cpu in cpus))
        started = time.perf_counter()
        outputs = await c.generate_batch(prompts, max_tokens=args.max_tokens, seed=1, ignore_eos=True)
        seconds = time.perf_counter() - started
        after = (time.process_time(), sum(cpu.seconds() for cpu in cpus))
    tokens = sum(len(o.generated_tokens) for o in outputs)
    return {
        "tokens_per_s": tokens / seconds,
        "coordinator_cpu_s_per_1k_tokens": (after[0] - before[0]) / tokens * 1e3,
        "servers_cpu_s_per_1k_tokens": (after[1] - before[1]) / tokens * 1e3,
    }


async def run(args: Any) -> dict[str, Any]:
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="dualvllm-failover-"))
    if work.exists() and any(work.iterdir()):
        raise SystemExit(f"--work-dir {work} is not empty: generate would resume from its outputs; give a new one")
    work.mkdir(parents=True, exist_ok=True)
    print(f"inputs, outputs and server logs: {work}", flush=True)
    report: dict[str, Any] = {
        "machine": harness.machine(),
        "command": " ".join(["python", *sys.argv]),
        "restart_after_s": args.restart_after,
        "mode": args.mode,
    }
    pairs = replica_configs(
        replicas=2, log_dir=work / "logs", dev_mode=True, max_logprobs=args.top_k, lockstep=args.mode == "lockstep"
    )
    async with launch_replicas(pairs) as launched:
        servers = Servers([s for pair in launched for s in pair], work / "logs")
        try:
            if "throughput" in args.parts:
                report["throughput"] = await part_throughput(args, servers)
            if "generate" in args.parts:
                report["generate"] = await part_generate(args, servers, work)
            if "train" in args.parts:
                report["train"] = await part_train(args, servers, work)
        finally:
            for server in servers.all[2:3]:  # a restarted replica is not among those launched
                server.stop()
    return report


def plot(report: dict, path: Path) -> None:
    rows = report.get("throughput", [])
    if not rows:
        return
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    harness.plot_tokens_per_s(
        ax,
        rows,
        {"1 pair": "1_pair_tokens_per_s", "2 pairs": "2_pair_tokens_per_s"},
        f"{report.get('mode', 'per_token')} mode, 1 pair vs 2 (2 cores)",
    )
    harness.save_figure(fig, path)


def main() -> None:
    parser = harness.argument_parser(__doc__, live_servers=False)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument(
        "--mode",
        choices=("per_token", "lockstep"),
        default="per_token",
        help="how the coordinator decodes; lockstep starts the servers with the plugin",
    )
    parser.add_argument(
        "--prompts",
        type=int,
        default=12288,
        help="generate: prompts in the input file (enough that the restarted replica rejoins mid-run)",
    )
    parser.add_argument(
        "--kill-at", type=float, default=0.1, help="generate: kill once this share of records is written"
    )
    parser.add_argument("--max-tokens", type=int, default=32, help="generate and throughput: tokens per prompt")
    parser.add_argument("--batch", type=int, default=64, help="generate: the coordinator's --max-batch-size")
    parser.add_argument("--restart-after", type=float, default=20.0, help="seconds between the kill and the restart")
    parser.add_argument("--train-steps", type=int, default=200, help="train: enough that the restarted replica rejoins")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--work-dir", help="an empty directory for inputs, outputs and server logs; default: a new temp dir"
    )
    parser.add_argument("--output", type=Path, default=harness.RESULTS_DIR / "failover.json")
    args = parser.parse_args()
    harness.finish(loop.run(run(args)), args.output, plot)


if __name__ == "__main__":
    main()
