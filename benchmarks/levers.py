"""Which serving levers make the coordinator faster on live servers, measured in one run.

    python benchmarks/levers.py                        # starts the bundled tiny models (one pair)
    python benchmarks/levers.py --theta-url URL --t-url URL --batch-sizes 8 64 256 --tokens 32
    python benchmarks/levers.py --server-args=--block-size=32   # servers with 32-token KV blocks (the CPU build refuses 16)

Variants of the coordinator, each generating the same batch (ignore_eos, temperature 1)
back to back in every repeat, so the ratios to the baseline come from one run:
- `batched` (the default): one request per server per step for all sequences;
- `single requests`: one request per sequence per server per step, all at once (the
  request shape the reference used, with token ids instead of text);
- `no server tokenizer`: a second pair started with --skip-tokenizer-init (the servers
  detokenize nothing), the coordinator tokenizing with the models' own tokenizers
  (`local_tokenizers`); only when the script starts the servers itself. Its servers sit
  idle while the other variants run, and the reverse.
Pipelining the active set in 2 or 4 lanes was measured and dropped; see benchmarks/README.md.

For each variant: tokens/s, its ratio to the baseline (median of per-repeat ratios), the
servers' CPU seconds per 1,000 tokens and the servers' prefix-cache hit rate over the
run (from vLLM's /metrics). Writes benchmarks/results/levers.json and levers.png.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Sequence

import aiohttp
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `benchmarks` is not an installed package

from dualvllm.common import loop  # noqa: E402
from benchmarks import harness  # noqa: E402
from dualvllm.coordinator import CoordinatorConfig, DualVLLMCoordinator  # noqa: E402
from dualvllm.engines.protocol import TopKBatch  # noqa: E402
from dualvllm.engines.vllm_client import VLLMClient  # noqa: E402

PREFIX_METRIC = re.compile(r"^vllm:prefix_cache_(queries|hits)_total\{[^}]*\} ([0-9.e+]+)$", re.M)


class SingleRequests(VLLMClient):
    """A vLLM client that sends one request per context, all at once, instead of one batch."""

    async def next_token_topk(self, contexts: Sequence[Sequence[int]], k: int,
                              keys: Sequence[int] | None = None) -> TopKBatch:
        rows = await asyncio.gather(*(super(SingleRequests, self).next_token_topk([c], k) for c in contexts))
        return TopKBatch(np.concatenate([r.token_ids for r in rows]), np.concatenate([r.logprobs for r in rows]))


async def prefix_cache(session: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    """(tokens queried, tokens hit) of a server's prefix cache so far."""
    async with session.get(url + "/metrics") as response:
        text = await response.text()
    values = {name: float(value) for name, value in PREFIX_METRIC.findall(text)}
    return values.get("queries", 0.0), values.get("hits", 0.0)


@contextlib.asynccontextmanager
async def coordinator_for(variant: str, theta_url: str, t_url: str, args: argparse.Namespace):
    config = CoordinatorConfig(theta_url=theta_url, t_url=t_url, top_k=args.top_k,
                               max_batch_size=max(args.batch_sizes), connection_pool_size=max(args.batch_sizes),
                               local_tokenizers=variant == "no server tokenizer")
    engines = {}
    async with contextlib.AsyncExitStack() as stack:
        if variant == "single requests":
            engines = {name: await stack.enter_async_context(
                SingleRequests(url, name=name, connection_pool_size=max(args.batch_sizes), request_timeout_s=600))
                for name, url in (("theta_engine", theta_url), ("t_engine", t_url))}
        yield await stack.enter_async_context(DualVLLMCoordinator(config, **engines))


async def run(args: argparse.Namespace) -> dict:
    variants = ["batched", "single requests"]
    async with contextlib.AsyncExitStack() as stack:
        theta_url, t_url = args.theta_url, args.t_url
        urls = {}
        if not (theta_url and t_url):
            for skip in (False, True):
                urls["no server tokenizer" if skip else "batched"] = await stack.enter_async_context(
                    harness.servers(None, None, max_logprobs=max(args.top_k, 20),
                                   extra_args=tuple(args.server_args), skip_tokenizer_init=skip))
            theta_url, t_url = urls["batched"]
            variants.append("no server tokenizer")
        urls.update({v: (theta_url, t_url) for v in variants if v not in urls})
        session = await stack.enter_async_context(aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)))
        cpus = {v: (harness.ServerCPU(urls[v][0]), harness.ServerCPU(urls[v][1])) for v in variants}
        coordinators = {v: await stack.enter_async_context(coordinator_for(v, *urls[v], args)) for v in variants}
        rows = []
        for batch in args.batch_sizes:
            prompts = harness.prompts_for(batch, seed=0)
            active = [v for v in variants if v != "single requests" or batch <= args.single_max_batch]
            for variant in active:  # warm-up
                await coordinators[variant].generate_batch(prompts, max_tokens=4, seed=0, ignore_eos=True)
            runs: dict[str, list[dict[str, float]]] = {v: [] for v in active}
            for repeat in range(args.repeats):
                for variant in active:
                    coordinator = coordinators[variant]
                    cache_before = [await prefix_cache(session, u) for u in urls[variant]]
                    cpu_before = sum(c.seconds() for c in cpus[variant])
                    started = time.perf_counter()
                    outs = await coordinator.generate_batch(prompts, max_tokens=args.tokens, seed=repeat + 1,
                                                            ignore_eos=True)
                    seconds = time.perf_counter() - started
                    assert all(o.ok for o in outs), outs[0].error
                    tokens = batch * args.tokens
                    cache_after = [await prefix_cache(session, u) for u in urls[variant]]
                    queried = sum(a[0] - b[0] for a, b in zip(cache_after, cache_before))
                    hit = sum(a[1] - b[1] for a, b in zip(cache_after, cache_before))
                    runs[variant].append({
                        "tokens_per_s": tokens / seconds,
                        "servers_cpu_s_per_1k_tokens":
                            (sum(c.seconds() for c in cpus[variant]) - cpu_before) / tokens * 1e3,
                        "prefix_cache_hit_rate": hit / queried if queried else float("nan"),
                    })
            row: dict = {"batch_size": batch, "tokens_per_sequence": args.tokens}
            baseline = [m["tokens_per_s"] for m in runs[variants[0]]]
            for variant, measured in runs.items():
                key = variant.replace(" ", "_")
                for metric in measured[0]:
                    row[f"{key}_{metric}"] = statistics.median(m[metric] for m in measured)
                row[f"{key}_over_baseline_ratio"] = statistics.median(
                    m["tokens_per_s"] / b for m, b in zip(measured, baseline))
            rows.append(row)
            print(f"batch {batch:>4}: " + "  ".join(
                f"{v}: {row[v.replace(' ', '_') + '_tokens_per_s']:.0f} tok/s "
                f"(x{row[v.replace(' ', '_') + '_over_baseline_ratio']:.2f}, servers "
                f"{row[v.replace(' ', '_') + '_servers_cpu_s_per_1k_tokens']:.1f} CPU-s/1k tok, prefix hits "
                f"{row[v.replace(' ', '_') + '_prefix_cache_hit_rate']:.0%})" for v in active), flush=True)
    return {"machine": harness.machine(), "command": " ".join(["python", *sys.argv]), "top_k": args.top_k,
            "repeats": args.repeats, "variants": variants, "rows": rows}


def plot(report: dict, path: Path) -> None:
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    harness.plot_tokens_per_s(ax, report["rows"],
                             {v: f"{v.replace(' ', '_')}_tokens_per_s" for v in report["variants"]},
                             f"coordinator variants, top_k {report['top_k']}")
    harness.save_figure(fig, path)


def main() -> None:
    parser = harness.argument_parser(__doc__, live_servers=True)
    parser.add_argument("--server-args", nargs="*", default=[], help="extra vLLM arguments when starting servers")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--single-max-batch", type=int, default=64,
                        help="skip `single requests` above this batch size (it is slow)")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, default=harness.RESULTS_DIR / "levers.json")
    args = parser.parse_args()
    harness.finish(loop.run(run(args)), args.output, plot)


if __name__ == "__main__":
    main()
