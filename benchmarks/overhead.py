"""The coordinator's own CPU cost per sequence-token and its peak memory, no model servers.

    python benchmarks/overhead.py                      # ~1 minute
    python benchmarks/overhead.py --batch-sizes 1 8 64 256 --ks 20 100 --memory-sequences 1000

CPU cost is thread CPU time (time.thread_time), so other work on a shared machine does
not count; each measurement is warmed up, then repeated, and the median repeat is kept.

- `mix_and_sample`: merge + alpha* + sampling (coordinator/step.py) on synthetic top-k
  arrays shaped like the servers' answers ([B, k+1], the last column padding; the two
  lists share `--overlap` of their ids; ids from a 32,000-token vocabulary).
- `parse`: decoding one server's /v1/completions answer (JSON shaped like vLLM 0.32's,
  all fields) into a TopKBatch (engines/vllm_client.py); a step parses two.
- `step`: the whole coordinator path without HTTP: DualVLLMCoordinator over two
  in-process stub engines that answer instantly from a pool of the same synthetic rows,
  so it adds the scheduler, the per-sequence bookkeeping and asyncio to mix_and_sample.
  `bookkeeping` is that minus mix_and_sample, and also read from the step timings.
- memory: peak RSS of this process while it streams `--memory-sequences` sequences
  through a coordinator from two fake vLLM servers (tests/fake_vllm.py) running in a
  separate process, so only the coordinator's memory is counted.

Prints a table, writes benchmarks/results/overhead.json (units in the keys) and
benchmarks/results/overhead.png.
"""

from __future__ import annotations

import argparse
import itertools
import json
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `benchmarks` and `tests` are not installed packages

from dualvllm.common import loop  # noqa: E402
from benchmarks import harness  # noqa: E402
from dualvllm.coordinator import CoordinatorConfig, DualVLLMCoordinator  # noqa: E402
from dualvllm.coordinator.step import mix_and_sample  # noqa: E402
from dualvllm.engines.protocol import ModelInfo, TopKBatch  # noqa: E402
from dualvllm.engines import vllm_answers  # noqa: E402

VOCAB = 32_000
POOL_ROWS = 1024  # distinct synthetic rows the stub engines cycle through
RSS_POLL_S = 0.005


def synthetic_topk(batch: int, k: int, overlap: float, rng: np.random.Generator) -> tuple[TopKBatch, TopKBatch]:
    """Two [batch, k+1] top-k answers: sorted logprobs with a real tail mass, shared ids."""
    shared = int(round(overlap * k))
    ids = np.full((2, batch, k + 1), -1, dtype=np.int64)
    logp = np.full((2, batch, k + 1), -np.inf)
    for row in range(batch):
        picked = rng.choice(VOCAB, 2 * k - shared, replace=False)
        ids[0, row, :k] = picked[:k]
        ids[1, row, :k] = np.concatenate([picked[:shared], picked[k:]])
        for side in range(2):
            logits = np.sort(rng.normal(0.0, 2.0, k))[::-1]
            # The listed tokens hold 95% of the mass, like a top-k of a real LM.
            logp[side, row, :k] = logits - np.logaddexp.reduce(logits) + np.log(0.95)
            rng.shuffle(ids[side, row, :k])  # ranking by id is not rank by probability
    return TopKBatch(ids[0], logp[0]), TopKBatch(ids[1], logp[1])


def vllm_answer(batch: TopKBatch) -> bytes:
    """A /v1/completions body with every field vLLM 0.32 sends (captured shape)."""
    choices = []
    for index, (ids, lps) in enumerate(zip(batch.token_ids.tolist(), batch.logprobs.tolist())):
        top = {f"token_id:{i}": lp for i, lp in zip(ids, lps) if i >= 0}
        best = next(iter(top))
        choices.append({"index": index, "text": "7", "logprobs": {
            "text_offset": [0], "token_logprobs": [top[best]], "tokens": [best], "top_logprobs": [top]},
            "finish_reason": "length", "stop_reason": None, "token_ids": None, "prompt_logprobs": None,
            "prompt_token_ids": None, "routed_experts": None})
    return json.dumps({"id": "cmpl-0", "object": "text_completion", "created": 0, "model": "m",
                       "choices": choices, "service_tier": None, "system_fingerprint": "vllm-0.32.0",
                       "usage": {"prompt_tokens": 8, "total_tokens": 9, "completion_tokens": 1}}).encode()


def cpu_us(fn: Callable[[], object], repeats: int, inner: int) -> float:
    """Median over `repeats` of the thread CPU µs one call of `fn` takes (after a warm-up)."""
    for _ in range(max(inner // 4, 2)):
        fn()
    times = []
    for _ in range(repeats):
        started = time.thread_time()
        for _ in range(inner):
            fn()
        times.append((time.thread_time() - started) / inner * 1e6)
    return statistics.median(times)


class StubEngine:
    """An Engine that answers top-k requests instantly from a pool of synthetic rows."""

    def __init__(self, name: str, pool: TopKBatch) -> None:
        self.name = name
        self._pool = pool
        self._next = 0

    async def health(self) -> None:
        return None

    async def model_info(self) -> ModelInfo:
        return ModelInfo(name=self.name, root="stub", max_model_len=1 << 20, vocab_size=VOCAB)

    async def next_token_topk(self, contexts: Sequence[Sequence[int]], k: int,
                              keys: Sequence[int] | None = None) -> TopKBatch:
        rows = (self._next + np.arange(len(contexts))) % self._pool.batch_size
        self._next = int(rows[-1]) + 1
        return TopKBatch(self._pool.token_ids[rows], self._pool.logprobs[rows])

    async def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        return ""

    async def eos_token_ids(self) -> frozenset[int]:
        return frozenset({VOCAB})  # never sampled: sequences run to max_tokens


async def step_cost(batch: int, k: int, overlap: float, tokens: int, repeats: int) -> dict[str, float]:
    """Thread CPU µs per sequence-token of whole steps over stub engines, and their bookkeeping."""
    theta_pool, t_pool = synthetic_topk(POOL_ROWS, k, overlap, np.random.default_rng(1))
    config = CoordinatorConfig(top_k=k, max_batch_size=batch)
    async with DualVLLMCoordinator(config, theta_engine=StubEngine("theta", theta_pool),
                                   t_engine=StubEngine("t", t_pool)) as coordinator:
        prompts = [[1 + i % 50, 2, 3] for i in range(batch)]
        await coordinator.generate_batch(prompts, max_tokens=4, seed=0)  # warm-up
        per_token = []
        for run in range(repeats):
            started = time.thread_time()
            await coordinator.generate_batch(prompts, max_tokens=tokens, seed=run + 1)
            per_token.append((time.thread_time() - started) / (batch * tokens) * 1e6)
        timings = coordinator.recent_step_timings()[-tokens:]
    return {"step_us_per_token": statistics.median(per_token),
            "bookkeeping_wall_us_per_token": float(np.median([t.bookkeeping_s for t in timings])) / batch * 1e6}


def cpu_table(args: argparse.Namespace) -> list[dict]:
    rows = []
    for k, batch in itertools.product(args.ks, args.batch_sizes):
        rng = np.random.default_rng(0)
        theta, t = synthetic_topk(batch, k, args.overlap, rng)
        ones, nans = np.ones(batch), np.full(batch, np.nan)
        uniforms = rng.random(batch)
        inner = max(2, 2000 // batch)

        def mix() -> object:
            return mix_and_sample(theta, t, temperature=ones, fixed_alpha=nans, uniforms=uniforms,
                                  fill="min", alpha_tol=1e-6, alpha_max_iter=20)

        mix_us = cpu_us(mix, args.repeats, inner)
        body = vllm_answer(theta)
        ids = vllm_answers.TokenIdCache()
        parse_us = cpu_us(lambda: vllm_answers.next_token_rows(vllm_answers.decode_completion(body), batch, k, ids),
                          args.repeats, inner)
        step = loop.run(step_cost(batch, k, args.overlap, args.step_tokens, args.repeats))
        row = {
            "batch_size": batch, "top_k": k,
            "mix_and_sample_us_per_token": mix_us / batch,
            "parse_one_answer_us_per_token": parse_us / batch,
            "step_without_http_us_per_token": step["step_us_per_token"],
            "bookkeeping_us_per_token": step["step_us_per_token"] - mix_us / batch,
            "bookkeeping_wall_us_per_token_from_step_timings": step["bookkeeping_wall_us_per_token"],
        }
        # What one step costs the coordinator in all: the step, plus parsing both answers.
        row["total_us_per_token"] = row["step_without_http_us_per_token"] + 2 * row["parse_one_answer_us_per_token"]
        rows.append(row)
        print(f"k {k:>3}  batch {batch:>4}  mix_and_sample {row['mix_and_sample_us_per_token']:7.2f}  "
              f"bookkeeping {row['bookkeeping_us_per_token']:6.2f}  step {row['step_without_http_us_per_token']:7.2f}  "
              f"parse x2 {2 * row['parse_one_answer_us_per_token']:6.2f}  total {row['total_us_per_token']:7.2f}"
              "  µs per sequence-token", flush=True)
    return rows


FAKE_SERVERS = """
import asyncio, sys
sys.path.insert(0, {repo!r})
from tests.fake_vllm import FakeModel, FakeVLLM

async def main():
    servers = [FakeVLLM(FakeModel(seed=s, max_model_len={max_len}), name=n) for s, n in ((1, "base"), (2, "teacher"))]
    for server in servers:
        await server.start()
    print(" ".join(s.url for s in servers), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes stdin

asyncio.run(main())
"""


def memory(args: argparse.Namespace) -> dict[str, float]:
    """Peak RSS of this process while streaming sequences from fake servers in another process."""
    prompt_len = 4
    code = FAKE_SERVERS.format(repo=str(REPO), max_len=prompt_len + args.memory_tokens + 1)
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        theta_url, t_url = child.stdout.readline().split()
        rss = psutil.Process()
        peak = {"rss": 0}
        done = threading.Event()

        def poll() -> None:
            while not done.is_set():
                peak["rss"] = max(peak["rss"], rss.memory_info().rss)
                time.sleep(RSS_POLL_S)

        async def stream() -> tuple[int, int]:
            config = CoordinatorConfig(theta_url=theta_url, t_url=t_url, top_k=16, max_batch_size=args.memory_batch)
            async with DualVLLMCoordinator(config) as coordinator:
                before = rss.memory_info().rss
                watcher = threading.Thread(target=poll, daemon=True)
                watcher.start()
                prompts = ["abcd"[: 1 + i % prompt_len] for i in range(args.memory_sequences)]
                finished = tokens = 0
                async for output in coordinator.stream(prompts, max_tokens=args.memory_tokens, seed=0,
                                                       ignore_eos=True):
                    finished += 1
                    tokens += len(output.generated_tokens)
                done.set()
                watcher.join()
                return before, tokens

        started = time.perf_counter()
        before, tokens = loop.run(stream())
        seconds = time.perf_counter() - started
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    result = {
        "sequences": args.memory_sequences, "tokens_per_sequence": args.memory_tokens,
        "max_batch_size": args.memory_batch, "tokens": tokens, "seconds": seconds,
        "rss_before_streaming_mb": before / 2**20, "rss_peak_while_streaming_mb": peak["rss"] / 2**20,
        "ru_maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    print(f"memory: {args.memory_sequences} sequences x {args.memory_tokens} tokens ({tokens} tokens, "
          f"{seconds:.1f} s): RSS {result['rss_before_streaming_mb']:.0f} MB before, peak "
          f"{result['rss_peak_while_streaming_mb']:.0f} MB while streaming (ru_maxrss "
          f"{result['ru_maxrss_mb']:.0f} MB)", flush=True)
    return result


def plot(report: dict, path: Path) -> None:
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k in sorted({r["top_k"] for r in report["cpu"]}):
        rows = [r for r in report["cpu"] if r["top_k"] == k]
        batches = [r["batch_size"] for r in rows]
        ax.plot(batches, [r["mix_and_sample_us_per_token"] for r in rows], "o--", label=f"mix_and_sample, k={k}")
        ax.plot(batches, [r["total_us_per_token"] for r in rows], "s-", label=f"step + 2 parses, k={k}")
    ax.axhline(20, color="grey", lw=0.8, ls=":", label="target at batch 64, k=20")
    ax.set(xscale="log", yscale="log", xlabel="batch size (sequences per step)",
           ylabel="thread CPU µs per sequence-token", title="coordinator CPU cost, no servers")
    ax.legend(fontsize=8)
    harness.save_figure(fig, path)


def main() -> None:
    parser = harness.argument_parser(__doc__, live_servers=False)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--ks", type=int, nargs="+", default=[20, 100])
    parser.add_argument("--overlap", type=float, default=0.5, help="share of ids both top-k lists hold")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--step-tokens", type=int, default=32, help="tokens per sequence in the `step` runs")
    parser.add_argument("--memory-sequences", type=int, default=1000)
    parser.add_argument("--memory-tokens", type=int, default=128, help="tokens per streamed sequence")
    parser.add_argument("--memory-batch", type=int, default=64, help="max_batch_size while streaming")
    parser.add_argument("--output", type=Path, default=harness.RESULTS_DIR / "overhead.json")
    args = parser.parse_args()
    report = {"machine": harness.machine(), "command": " ".join(["python", *sys.argv]),
              "cpu": cpu_table(args), "memory": memory(args)}
    harness.finish(report, args.output, plot)


if __name__ == "__main__":
    main()
