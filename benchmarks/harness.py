"""What the benchmark scripts share: the machine line, live servers, CPU accounting, output."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import time
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable
from urllib.parse import urlparse

import psutil

from dualvllm.common import loop
from dualvllm import tinymodels
from dualvllm.engines.launcher import launch_pair, pair_configs
from dualvllm.tinymodels.task import problems

RESULTS_DIR = Path("benchmarks/results")


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo): timings compare only within one model (an AVX2-only
    AMD EPYC ran native generation at 59 tokens/s where an earlier machine of these kinds ran 512)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def machine() -> str:
    """One line naming the machine a result was taken on."""
    memory_gb = psutil.virtual_memory().total / 2**30
    return (f"{cpu_model()}, {platform.machine()} Linux, {os.cpu_count()} cores, {memory_gb:.0f} GB RAM, no GPU; "
            f"load average at start {os.getloadavg()[0]:.1f}; event loop {loop.chosen()}")


@contextlib.asynccontextmanager
async def servers(theta_url: str | None, t_url: str | None, *, max_logprobs: int,
                  **options: object) -> AsyncIterator[tuple[str, str]]:
    """The two server URLs: the given ones, or a freshly launched pair of the bundled models
    (`options`: more ServerConfig fields)."""
    if theta_url and t_url:
        yield theta_url, t_url
        return
    async with launch_pair(*pair_configs(max_logprobs=max_logprobs, **options)) as (theta, t):
        yield theta.url, t.url


def long_context_models(directory: Path, positions: int) -> dict[str, object]:
    """pair_configs options that serve copies of the bundled models, written under `directory`,
    with `positions` positions instead of the 64 they were trained on.

    Only the configs change (`max_position_embeddings`, the tokenizer's `model_max_length`);
    the weights are linked. The models' rotary positions are computed, not learned, so they go
    on past 64: what the models generate there means nothing, but every number stays finite,
    and each token costs what any token costs. RL rollouts run to hundreds of tokens, over
    which each sequence's own work (its requests, tokenization, admission) is spread far
    thinner than over the 48 tokens the bundled context leaves. (vLLM's own override,
    VLLM_ALLOW_LONG_MAX_MODEL_LEN, keeps the models' rotary table at 64 positions: per-token
    answers then carried NaN logprobs, which the server could not even write as JSON.)
    """
    models = {}
    for role, source in (("base_model", tinymodels.BASE_DIR), ("teacher_model", tinymodels.TEACHER_DIR)):
        copy = directory / source.name
        copy.mkdir(parents=True)
        for file in source.iterdir():
            if file.name in ("config.json", "tokenizer_config.json"):
                settings = json.loads(file.read_text())
                key = "max_position_embeddings" if file.name == "config.json" else "model_max_length"
                (copy / file.name).write_text(json.dumps(settings | {key: positions}, indent=2))
            else:
                (copy / file.name).symlink_to(file)
        models[role] = str(copy)
    return models | {"max_model_len": positions, "dtype": tinymodels.SERVER_DTYPE}


SHAPE_NAMES = ("small", "qwen3-0.6b")  # dualvllm.tinymodels.shapes.SHAPES, named here so --help needs no torch


def shape_models(shape: str, max_model_len: int | None = None) -> dict[str, object]:
    """pair_configs options that serve the realistic-shape pair `shape` (dualvllm.tinymodels.shapes: built
    and cached on first use), in the dtype its checkpoints carry (bfloat16), as a user's model is."""
    from dualvllm.tinymodels.shapes import ensure_pair

    base, teacher = ensure_pair(shape)
    options: dict[str, object] = {"base_model": str(base), "teacher_model": str(teacher)}
    return options | ({"max_model_len": max_model_len} if max_model_len is not None else {})


def prompts_for(batch_size: int, seed: int) -> list[str]:
    """`batch_size` held-out addition prompts (repeated if the split is smaller)."""
    prompts = [p.prompt for p in problems("test", n=min(batch_size, 400), seed=seed)]
    return (prompts * (batch_size // len(prompts) + 1))[:batch_size]


class ServerCPU:
    """CPU seconds used by the process tree of the server listening on a URL's port.

    vLLM runs an API process, an engine-core process and a worker; on this machine they
    share the cores with the other server and the coordinator, so their CPU use is what
    bounds any protocol's speed.
    """

    def __init__(self, url: str) -> None:
        port = urlparse(url).port
        pids = [c.pid for c in psutil.net_connections("tcp")
                if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid]
        root = psutil.Process(pids[0]) if pids else None
        self._procs = [root, *root.children(recursive=True)] if root else []

    def seconds(self) -> float:
        total = 0.0
        for proc in self._procs:
            with contextlib.suppress(psutil.Error):
                times = proc.cpu_times()
                total += times.user + times.system
        return total


def argument_parser(doc: str, *, live_servers: bool) -> argparse.ArgumentParser:
    """A script's parser, described by its docstring's first line; with the server URL options."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    if live_servers:
        parser.add_argument("--theta-url", help="running base server; default: start the bundled tiny models")
        parser.add_argument("--t-url", help="running teacher server")
    return parser


def finish(report: dict, output: Path, plot: Callable[[dict, Path], None]) -> None:
    """Write the report as JSON and its plot beside it (same name, .png)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {output}")
    plot(report, output.with_suffix(".png"))


def pyplot():
    """matplotlib's pyplot on a non-interactive backend (benchmarks run headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_tokens_per_s(ax: Any, rows: list[dict], series: dict[str, str], title: str) -> None:
    """One line per series (label -> row key of its tokens/s) against batch size, log-log."""
    for label, key in series.items():
        points = [(r["batch_size"], r[key]) for r in rows if key in r]
        if points:
            ax.plot(*zip(*points), "o-", label=label)
    ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="tokens/s", title=title)
    ax.legend(fontsize=8)


def save_figure(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


async def timed(arm: Callable[[], Awaitable[int]], cpus: tuple[ServerCPU, ServerCPU]) -> dict[str, float]:
    """Run one arm; its tokens/s and the CPU seconds per 1,000 tokens each party used."""
    before = (time.process_time(), *(c.seconds() for c in cpus))
    started = time.perf_counter()
    tokens = await arm()
    seconds = time.perf_counter() - started
    after = (time.process_time(), *(c.seconds() for c in cpus))
    used = [(a - b) / tokens * 1e3 for a, b in zip(after, before)]
    return {"tokens_per_s": tokens / seconds, "seconds": seconds,
            "coordinator_cpu_s_per_1k_tokens": used[0], "theta_server_cpu_s_per_1k_tokens": used[1],
            "t_server_cpu_s_per_1k_tokens": used[2]}
