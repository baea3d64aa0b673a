"""Soak test of the q* service: many clients for a long time, bad and abandoned requests among them.

    python benchmarks/service_soak.py                     # 20 minutes, starts the bundled tiny models
    python benchmarks/service_soak.py --minutes 3         # a short run
    python benchmarks/service_soak.py --theta-url URL --t-url URL

`dualvllm serve` runs in its own process on the two servers (benchmarks/service_load.py's
`running_service`); `--clients` aiohttp clients here send requests back to back, each
drawn at random (its own seed per client):
- about `--bad-fraction` bad requests (invalid values, unknown fields, bool or out-of-vocabulary
  token ids, malformed JSON, an unknown model, a context too long, what q* cannot do);
- about `--cancel-fraction` streamed requests that the client abandons after the first chunk;
- the rest good: completions and chats, streamed about `--stream-fraction` of the time.
Every `--sample-s` seconds: the service's RSS and open fds (psutil) and its live asyncio
tasks (its /metrics gauge `dualvllm_asyncio_tasks`). At rest before the clients start and
after they stop (once the service holds no sequence), the same three.

Reported: responses by kind and status; request latency p50/p99 of good requests in the
first and the last `--window-minutes` (at most a third of the run each); RSS growth (the
peak after `--warmup-s` over the first sample after it); fds and tasks at rest before and
after (at rest: no sequence held, idle connections past their keep-alive).
Targets (issue 27): RSS growth <= 5%, fds and tasks flat, every bad request a 4xx, no 5xx
for a good one, p99 of the last window <= 1.2x the first's. Writes
benchmarks/results/service_soak.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `benchmarks` is not an installed package

from dualvllm.common import loop  # noqa: E402
from benchmarks import harness  # noqa: E402
from benchmarks.service_load import running_service  # noqa: E402
from dualvllm.engines.http import KEEPALIVE_TIMEOUT_S  # noqa: E402

# How long the service may take to let go of every sequence once the clients stop.
SETTLE_TIMEOUT_S = 60.0
# Before a sample at rest: time for the service to close the connections the clients closed,
# and for the coordinator's idle connections to the servers to pass their keep-alive (aiohttp
# closes them at its next cleanup, up to about twice the timeout after their last use).
CLOSE_GRACE_S = 1.0
REST_S = 3 * KEEPALIVE_TIMEOUT_S
# A request that takes longer than this is counted as a client timeout (the service hung).
REQUEST_TIMEOUT_S = 300.0
NOTES_PER_KIND = 3
TARGET_RSS_GROWTH = 0.05
TARGET_P99_RATIO = 1.2

# Bad requests: (what, body changes or raw bytes, the expected status).
BAD_REQUESTS: list[tuple[str, Any, int]] = [
    ("negative max_tokens", {"max_tokens": -1}, 400),
    ("n 0", {"n": 0}, 400),
    ("string temperature", {"temperature": "hot"}, 400),
    ("unknown field", {"temprature": 0.5}, 400),
    ("bool token ids", {"prompt": [True, False]}, 400),
    ("id outside the vocabulary", {"prompt": [5, 999_999]}, 400),
    ("top_p", {"top_p": 0.5}, 400),
    ("fixed_alpha 2", {"dualvllm": {"fixed_alpha": 2}}, 400),
    ("context too long", {"max_tokens": 1_000_000}, 400),
    ("streamed echo", {"echo": True, "stream": True}, 400),
    ("unknown model", {"model": "gpt-4"}, 404),
    ("malformed JSON", b"{not json", 400),
]


class Soak:
    """The clients, their outcomes and the service's resource samples."""

    def __init__(self, args: argparse.Namespace, url: str, model: str, pid: int, prompts: list[str]) -> None:
        self.args, self.url, self.model, self.prompts = args, url, model, prompts
        self.process = psutil.Process(pid)
        self.outcomes: Counter[tuple[str, str]] = Counter()  # (kind, status) -> requests
        self.latencies: list[tuple[float, float]] = []  # (start s since the clients began, seconds): good ones
        self.samples: list[dict[str, float]] = []
        self.wrong: dict[str, list[str]] = {}  # by kind, the first few answers that missed a target
        self.began = 0.0

    async def client(self, session: aiohttp.ClientSession, number: int, stop_at: float) -> None:
        rng = random.Random(number)
        seed = number * 1_000_000
        while time.monotonic() < stop_at:
            seed += 1
            draw = rng.random()
            try:
                if draw < self.args.bad_fraction:
                    await self.bad(session, rng.choice(BAD_REQUESTS))
                elif draw < self.args.bad_fraction + self.args.cancel_fraction:
                    await self.abandoned(session, seed)
                else:
                    await self.good(session, seed, chat=rng.random() < self.args.chat_fraction,
                                    stream=rng.random() < self.args.stream_fraction)
            except (aiohttp.ClientError, TimeoutError) as exc:  # the connection broke or hung: counted, go on
                self.outcomes["transport", type(exc).__name__] += 1
                self.note(f"transport: {exc!r}")

    def body(self, seed: int, chat: bool = False, **fields: Any) -> dict[str, Any]:
        prompt = self.prompts[seed % len(self.prompts)]
        text = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
        return {"model": self.model, **text, "max_tokens": self.args.tokens, "seed": seed,
                "dualvllm": {"ignore_eos": True}, **fields}

    async def bad(self, session: aiohttp.ClientSession, bad: tuple[str, Any, int]) -> None:
        what, change, expected = bad
        data = change if isinstance(change, bytes) else json.dumps({**self.body(0), **change})
        async with session.post(self.url + "/completions", data=data,
                                headers={"Content-Type": "application/json"}) as response:
            answer = await response.read()
        self.outcomes["bad", str(response.status)] += 1
        if response.status != expected:
            self.note(f"bad request '{what}': {response.status} (want {expected}): {answer[:200]!r}")

    async def abandoned(self, session: aiohttp.ClientSession, seed: int) -> None:
        """A streamed completion the client leaves after its first chunk."""
        async with session.post(self.url + "/completions", json=self.body(seed, stream=True)) as response:
            if response.status != 200:
                self.outcomes["cancelled", str(response.status)] += 1
                self.note(f"a stream to abandon got {response.status}: {(await response.read())[:200]!r}")
                return
            async for line in response.content:
                if line.startswith(b"data: "):
                    break
            response.close()  # the connection goes: the service cancels the request's sequences
        self.outcomes["cancelled", "left after the first chunk"] += 1

    async def good(self, session: aiohttp.ClientSession, seed: int, *, chat: bool, stream: bool) -> None:
        kind = ("chat" if chat else "completion") + (" streamed" if stream else "")
        route = "/chat/completions" if chat else "/completions"
        started = time.monotonic()
        async with session.post(self.url + route, json=self.body(seed, chat, stream=stream)) as response:
            answer = await response.read()
        self.outcomes[kind, str(response.status)] += 1
        failed = response.status != 200 or (stream and (b'"error"' in answer or not answer.endswith(b"[DONE]\n\n")))
        if failed:
            self.note(f"good {kind}: {response.status}: {answer[-300:]!r}")
            return
        self.latencies.append((started - self.began, time.monotonic() - started))

    def note(self, what: str) -> None:
        kind = what.split(":")[0]
        if len(self.wrong.setdefault(kind, [])) < NOTES_PER_KIND:
            self.wrong[kind].append(what)

    async def sample(self, scraper: aiohttp.ClientSession, at: str) -> dict[str, float]:
        """The service's RSS (MB), open fds and live asyncio tasks, and the sequences it holds.
        The fds are counted before the scrape, whose connection (one fd, one handler task) is open
        during it; `scraper` closes every connection after its request, so none stays behind."""
        memory, fds = self.process.memory_info().rss / 2**20, self.process.num_fds()
        gauges = await metrics(scraper, self.url)
        return {"at": at, "s": time.monotonic() - self.began if self.began else 0.0, "rss_mb": memory,
                "fds": fds, "asyncio_tasks": gauges["dualvllm_asyncio_tasks"],
                "sequences": gauges["dualvllm_active_sequences"] + gauges["dualvllm_queued_sequences"]}

    async def sampler(self, session: aiohttp.ClientSession, stop_at: float) -> None:
        while time.monotonic() < stop_at:
            await asyncio.sleep(self.args.sample_s)  # a sampling period, not a wait on an event
            self.samples.append(await self.sample(session, "run"))

    async def at_rest(self, scraper: aiohttp.ClientSession, at: str) -> dict[str, float]:
        """A sample once the service holds no sequence (abandoned ones are let go at their next
        step) and its idle connections have had REST_S to go."""
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while (found := await self.sample(scraper, at))["sequences"] > 0:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the service still holds {found['sequences']:g} sequences "
                                   f"{SETTLE_TIMEOUT_S:g} s after the clients stopped")
            await asyncio.sleep(CLOSE_GRACE_S)
        await asyncio.sleep(REST_S)
        return await self.sample(scraper, at)


async def metrics(session: aiohttp.ClientSession, api_url: str) -> dict[str, float]:
    """The service's unlabelled gauges and counters, by name; requests by route and status under 'requests'."""
    async with session.get(api_url.removesuffix("/v1") + "/metrics") as response:
        text = await response.text()
    values: dict[str, Any] = {"requests": {}}
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        name, value = line.rsplit(" ", 1)
        if name.startswith("dualvllm_requests_total{"):
            values["requests"][name.removeprefix("dualvllm_requests_total")] = float(value)
        elif "{" not in name:
            values[name] = float(value)
    return values


def window_stats(latencies: list[tuple[float, float]], start_s: float, end_s: float) -> dict[str, float]:
    ms = np.array([seconds for at, seconds in latencies if start_s <= at < end_s]) * 1e3
    if not ms.size:
        return {"requests": 0, "p50_ms": float("nan"), "p99_ms": float("nan")}
    return {"requests": int(ms.size), "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99))}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    prompts = harness.prompts_for(400, seed=0)
    lockstep = args.mode != "per_token"
    async with harness.servers(args.theta_url, args.t_url, max_logprobs=args.top_k, lockstep=lockstep) as (theta, t):
        async with running_service(args, theta, t) as (url, model, pid):
            soak = Soak(args, url, model, pid, prompts)
            timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                             timeout=timeout) as scraper:
                async with aiohttp.ClientSession(timeout=timeout) as warming:  # the first request's one-time costs
                    await soak.good(warming, 0, chat=True, stream=True)
                    await soak.good(warming, 0, chat=False, stream=False)
                soak.outcomes.clear()
                soak.latencies.clear()
                before = await soak.at_rest(scraper, "before")
                soak.began = time.monotonic()
                stop_at = soak.began + args.minutes * 60
                async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=args.clients),
                                                 timeout=timeout) as session:
                    clients = [asyncio.create_task(soak.client(session, i, stop_at)) for i in range(args.clients)]
                    sampler = asyncio.create_task(soak.sampler(scraper, stop_at))
                    results = await asyncio.gather(*clients, sampler, return_exceptions=True)
                crashed = [repr(r) for r in results if isinstance(r, BaseException)]
                ran_s = time.monotonic() - soak.began
                after = await soak.at_rest(scraper, "after")
                served = (await metrics(scraper, url))["requests"]
    return report(args, soak, before, after, ran_s, crashed, served)


def report(args: argparse.Namespace, soak: Soak, before: dict, after: dict, ran_s: float, crashed: list[str],
           served: dict[str, float]) -> dict[str, Any]:
    window_s = min(args.window_minutes * 60, ran_s / 3)
    first = window_stats(soak.latencies, 0, window_s)
    last = window_stats(soak.latencies, ran_s - window_s, ran_s)
    # Growth is the peak after warm-up over the first sample after it: a leak raises the peak,
    # while the last sample can fall as the load ends (the allocator returns memory).
    warm = [s for s in soak.samples if s["s"] >= args.warmup_s] or soak.samples
    rss_growth = max(s["rss_mb"] for s in warm) / warm[0]["rss_mb"] - 1 if warm else float("nan")
    outcomes = {f"{kind}: {status}": count for (kind, status), count in sorted(soak.outcomes.items())}
    bad_not_4xx = sum(n for (kind, status), n in soak.outcomes.items()
                      if kind == "bad" and not status.startswith("4"))
    good_5xx = sum(n for (kind, status), n in soak.outcomes.items()
                   if kind not in ("bad", "cancelled") and status.startswith("5"))
    checks = {
        "rss_growth_after_warmup": {"value": rss_growth, "target": f"<= {TARGET_RSS_GROWTH}",
                                    "met": rss_growth <= TARGET_RSS_GROWTH},
        "fds_at_rest_after_minus_before": {"value": after["fds"] - before["fds"], "target": "0",
                                           "met": after["fds"] == before["fds"]},
        "asyncio_tasks_at_rest_after_minus_before": {
            "value": after["asyncio_tasks"] - before["asyncio_tasks"], "target": "0",
            "met": after["asyncio_tasks"] == before["asyncio_tasks"]},
        "bad_requests_not_4xx": {"value": bad_not_4xx, "target": "0", "met": bad_not_4xx == 0},
        "good_requests_5xx": {"value": good_5xx, "target": "0", "met": good_5xx == 0},
        "p99_last_over_first": {"value": last["p99_ms"] / first["p99_ms"], "target": f"<= {TARGET_P99_RATIO}",
                                "met": last["p99_ms"] / first["p99_ms"] <= TARGET_P99_RATIO},
    }
    print(f"{sum(soak.outcomes.values())} requests in {ran_s:.0f} s by {args.clients} clients")
    for key, count in outcomes.items():
        print(f"  {key}: {count}")
    print(f"latency of good requests, first {window_s / 60:.1f} min: p50 {first['p50_ms']:.0f} ms, p99 "
          f"{first['p99_ms']:.0f} ms ({first['requests']}); last {window_s / 60:.1f} min: p50 {last['p50_ms']:.0f} "
          f"ms, p99 {last['p99_ms']:.0f} ms ({last['requests']})")
    print(f"at rest before / after: RSS {before['rss_mb']:.1f} / {after['rss_mb']:.1f} MB, fds {before['fds']} / "
          f"{after['fds']}, asyncio tasks {before['asyncio_tasks']:g} / {after['asyncio_tasks']:g}")
    for name, check in checks.items():
        print(f"  {'met ' if check['met'] else 'MISSED'} {name}: {check['value']:.4g} (target {check['target']})")
    for what in [w for notes in soak.wrong.values() for w in notes] + crashed:
        print(f"  wrong: {what}")
    return {"machine": harness.machine(), "command": " ".join(["python", *sys.argv]), "mode": args.mode,
            "clients": args.clients, "minutes": args.minutes, "ran_s": ran_s, "tokens_per_request": args.tokens,
            "window_s": window_s, "outcomes": outcomes, "service_requests_by_route_status": served,
            "latency_first_window": first, "latency_last_window": last, "at_rest_before": before,
            "at_rest_after": after, "samples": soak.samples, "checks": checks, "wrong": soak.wrong,
            "clients_crashed": crashed}


def plot(report: dict, path: Path) -> None:
    plt = harness.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    minutes = [s["s"] / 60 for s in report["samples"]]
    for ax, key, label in zip(axes, ("rss_mb", "fds", "asyncio_tasks"), ("RSS (MB)", "open fds", "asyncio tasks")):
        ax.plot(minutes, [s[key] for s in report["samples"]], "o-", markersize=3)
        ax.axhline(report["at_rest_before"][key], color="gray", linestyle=":", label="at rest, before")
        ax.axhline(report["at_rest_after"][key], color="black", linestyle="--", label="at rest, after")
        ax.set(xlabel="minutes", ylabel=label)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"dualvllm serve, {report['clients']} clients, {report['ran_s'] / 60:.1f} min")
    harness.save_figure(fig, path)


def main() -> None:
    parser = harness.argument_parser(__doc__, live_servers=True)
    parser.add_argument("--minutes", type=float, default=20.0, help="how long the clients run")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=16, help="tokens per good request (ignore_eos)")
    parser.add_argument("--bad-fraction", type=float, default=0.1, help="share of bad requests")
    parser.add_argument("--cancel-fraction", type=float, default=0.1, help="share of streams left mid-way")
    parser.add_argument("--stream-fraction", type=float, default=0.3, help="share of good requests streamed")
    parser.add_argument("--chat-fraction", type=float, default=0.2, help="share of good requests that are chats")
    parser.add_argument("--sample-s", type=float, default=10.0, help="seconds between resource samples")
    parser.add_argument("--warmup-s", type=float, default=60.0, help="RSS growth is counted from this on")
    parser.add_argument("--window-minutes", type=float, default=5.0,
                        help="latency windows at the start and the end (at most a third of the run each)")
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--mode", choices=("auto", "lockstep", "per_token"), default="auto")
    parser.add_argument("--output", type=Path, default=harness.RESULTS_DIR / "service_soak.json")
    args = parser.parse_args()
    harness.finish(loop.run(run(args)), args.output, plot)


if __name__ == "__main__":
    main()
