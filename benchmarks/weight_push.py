"""Weight pushes at a real shape, through the disk and in memory: how long each phase takes,
how long sampling stalls, and how far a bf16 server's logprobs sit from the pushed weights.

    python benchmarks/weight_push.py --shapes small                # tied and untied, 3 pushes each way
    python benchmarks/weight_push.py --shapes tiny small --pushes 2 --tolerance 100
    python benchmarks/weight_push.py --shapes qwen3-0.6b --variants untied --pushes 2
    python benchmarks/weight_push.py --shapes small --variants untied --replicas 1 2 --lora-rank 0   # a pool
    python benchmarks/weight_push.py --shapes small qwen3-0.6b --variants untied --via disk memory digest --pushes 3 --lora-rank 0

For each variant (tied or untied embeddings) of the realistic-shape base (dualvllm.tinymodels.shapes,
a 151,936-token vocabulary, bf16 checkpoint), one dev-mode vLLM server is started with
`--dtype auto` (bfloat16: the checkpoint's dtype) and a float32 learner is loaded from the
same checkpoint, as `dualvllm train` does. Each push perturbs every learner weight by
N(0, 1e-3^2), then pushes with dualvllm.training.weight_sync.BasePusher, one way after the other
(`--via`): `disk` (the checkpoint saved in the server's dtype with the expected logprobs
computed from it, then pause, /collective_rpc reload_weights, prefix-cache reset, resume,
probe) and `memory` (the expected logprobs from a copy of the weights in the server's dtype,
then pause(keep), vLLM's four weight-transfer phases through dualvllm's shared-memory
engine, a cache reset, resume, probe) and `digest` (the same transfer, proved by the server's
digest of the bytes it loaded: one pusher kept for every round, which probes its first push
only, `push_probe_every` 0), with the seconds of each phase. Meanwhile `--streams`
streaming requests keep the server sampling; the stall is the longest gap between two of
their tokens that overlaps the push, and tokens/s during the push is set against tokens/s
in the seconds before it. The |server - expected| logprobs
over the probes' top-k are recorded (max and median): they are what PUSH_TOLERANCE must
accept. For contrast, the same against the learner's float32 weights (`vs_float32_*`) and
against the previous push's weights (`vs_previous_*`: the update itself, which a bf16
verification cannot tell from round-off when it is as small as this).
With `--replicas N`, N servers form a ReplicaPool that every push reaches (all at once, each
verified on its own); the streams sample from the first, and a push's phases are the slowest
replica's. Writes benchmarks/results/weight_push.json (units in the keys).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `benchmarks` is not an installed package

from dualvllm.common import loop  # noqa: E402
from benchmarks import harness  # noqa: E402
from dualvllm.engines.launcher import ServerConfig, VLLMServer  # noqa: E402
from dualvllm.engines.pool import ReplicaPool  # noqa: E402
from dualvllm.engines.vllm_client import VLLMClient  # noqa: E402
from dualvllm.training import lora, weight_transfer  # noqa: E402
from dualvllm.training.weight_sync import (PUSH_TOLERANCE, BasePusher, checkpoint_logprobs, compare_logprobs,  # noqa: E402
                                  learner_logprobs, served_dtype)

PROBE_LENGTHS = (3, 5, 17, 33, 64, 120)  # prompt-like contexts, short to long
PERTURBATION_STD = 1e-3
STREAM_TOKENS = 256  # per streaming request; a new one starts when one ends
BEFORE_S = 3.0  # seconds of undisturbed sampling before each push, the stall's baseline


def probes(vocab_real: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_real, size=n).tolist() for n in PROBE_LENGTHS]


def spread(served, expected: np.ndarray) -> dict[str, float]:
    diff = compare_logprobs(served, expected)
    return {"max_nats": diff.max_abs_diff, "median_nats": diff.median_abs_diff}


def model_dirs(shape: str, tied: bool) -> tuple[Path, str]:
    """(base checkpoint, the dtype to serve it in) of `shape`: "tiny" is the bundled base."""
    if shape == "tiny":
        from dualvllm import tinymodels

        return tinymodels.BASE_DIR, tinymodels.SERVER_DTYPE
    from dualvllm.tinymodels.shapes import ensure_pair

    return ensure_pair(shape, tied=tied)[0], "auto"


class Streams:
    """`n` streaming completions kept going against the server, each token's arrival time kept."""

    def __init__(self, url: str, model: str, prompt: list[int], n: int, max_tokens: int) -> None:
        self.url, self.model, self.prompt, self.n, self.max_tokens = url, model, prompt, n, max_tokens
        self.arrivals: list[float] = []
        self._tasks: list[asyncio.Task] = []

    async def __aenter__(self) -> Streams:
        import aiohttp

        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=600))
        self._tasks = [asyncio.create_task(self._keep_streaming(i)) for i in range(self.n)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._session.close()

    async def _keep_streaming(self, seed: int) -> None:
        payload = {"model": self.model, "prompt": self.prompt, "max_tokens": self.max_tokens, "ignore_eos": True,
                   "temperature": 1.0, "stream": True}
        while True:
            payload["seed"] = seed = seed + self.n
            async with self._session.post(self.url + "/v1/completions", json=payload) as response:
                async for line in response.content:
                    if line.startswith(b"data: {"):
                        self.arrivals.append(time.perf_counter())

    def around(self, start: float, end: float) -> dict[str, float]:
        """Sampling during [start, end] against the BEFORE_S seconds before it."""
        times = sorted(self.arrivals)
        gaps = [(b - a) for a, b in zip(times, times[1:]) if b >= start and a <= end]
        during = sum(start <= t <= end for t in times)
        before = sum(start - BEFORE_S <= t < start for t in times)
        return {"stall_s": max(gaps, default=end - start), "tokens_per_s_during": during / max(end - start, 1e-9),
                "tokens_per_s_before": before / BEFORE_S}


async def variant(shape: str, tied: bool, pushes: int, ways: list[str], streams: int, log_dir: Path,
                  tolerance: float | None, lora_rank: int, replicas: int = 1) -> dict:
    from transformers import AutoTokenizer

    base_dir, serve_dtype = model_dirs(shape, tied)
    name = f"{shape} {'tied' if tied else 'untied'}" + (f" x{replicas} replicas" if replicas > 1 else "")
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    contexts = probes(min(len(tokenizer), 90) if shape == "tiny" else len(tokenizer))
    if shape == "tiny":
        contexts = [c[:40] for c in contexts]  # within the toy's 64 positions
    # Qwen3-0.6B's config allows 40,960 positions, more than the CPU build's 1 GiB of KV cache holds.
    servers = [VLLMServer(ServerConfig(model=str(base_dir), dev_mode=True, lockstep=False, dtype=serve_dtype,
                                       max_model_len=None if shape == "tiny" else 4096,
                                       log_path=log_dir / f"{shape}-{'tied' if tied else 'untied'}-{i}.log"),
                          name=f"theta{i}") for i in range(replicas)]
    started = time.perf_counter()
    try:
        await asyncio.gather(*(server.start() for server in servers))
        startup_s = time.perf_counter() - started
        rows = await _pushes(servers, name, shape, base_dir, tokenizer, contexts, pushes, ways, streams,
                             tolerance, lora_rank)
    finally:
        for server in servers:
            server.stop()
    return {"shape": shape, "tied": tied, "replicas": replicas, "server_startup_s": startup_s, **rows}


async def _pushes(servers: list[VLLMServer], name: str, shape: str, base_dir: Path, tokenizer, contexts,
                  pushes: int, ways: list[str], streams: int, tolerance: float | None, lora_rank: int) -> dict:
    """The pushes of one variant, to every server (a ReplicaPool when there are several); the
    streams sample from the first, whose answers are compared with the pushed weights."""
    import torch
    from transformers import AutoModelForCausalLM

    rows = []
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(VLLMClient(s.url, name=f"theta{i}")) for i, s in enumerate(servers)]
        client = clients[0]
        base = clients[0] if len(clients) == 1 else ReplicaPool(clients, name="theta", probe_contexts=contexts)
        dtype = await served_dtype(client)
        learner = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        start = await asyncio.to_thread(checkpoint_logprobs, base_dir, contexts, dtype=dtype)
        before = spread(await client.next_token_topk(contexts, 20), start)  # the server as started
        print(f"{name} as started: |server - checkpoint| max {before['max_nats']:.3f} median "
              f"{before['median_nats']:.3f} nats", flush=True)
        model = (await client.model_info()).name
        previous = None
        # One pusher for every digest push: it probes the first (the run's first push) and none after.
        digest_pusher = BasePusher(base, contexts, via="memory", tolerance=tolerance, probe_every=0)
        stream_tokens = min(STREAM_TOKENS, (await client.model_info()).max_model_len - 9)  # the toy: 64 positions
        async with Streams(client.url, model, contexts[0][:8], streams, stream_tokens) as sampling:
            with tempfile.TemporaryDirectory() as scratch:
                rounds = [(push, via) for push in range(pushes) for via in ways]
                if lora_rank:  # then one push of a LoRA learner: only its adapted layers move
                    rounds.append((pushes, "memory-lora"))
                for push, via in rounds:
                    if via == "memory-lora":
                        learner = lora.wrap(learner, rank=lora_rank, alpha=2 * lora_rank)
                    with torch.no_grad():
                        for pname, parameter in learner.named_parameters():
                            if via != "memory-lora" or "lora_B" in pname:
                                parameter.add_(PERTURBATION_STD * torch.randn_like(parameter))
                    pusher = (digest_pusher if via == "digest" else
                              BasePusher(base, contexts, via=via.removesuffix("-lora"), tolerance=tolerance))
                    await asyncio.sleep(BEFORE_S)  # sampling undisturbed, to compare with
                    t0 = time.perf_counter()
                    report = await pusher.push(learner, tokenizer, Path(scratch) / f"push-{push}-{via}")
                    t1 = time.perf_counter()
                    served = await client.next_token_topk(contexts, 20)
                    expected = (await asyncio.to_thread(
                        checkpoint_logprobs, report.path, contexts, dtype=dtype) if report.path else
                        await asyncio.to_thread(weight_transfer.expected_logprobs, learner, contexts, dtype))
                    row = {"push": push, "via": via, "verified_by": report.verified_by, "seconds": t1 - t0,
                           **{f"{phase}_s": v for phase, v in report.seconds.items()},
                           "bytes_mb": (report.bytes_moved or _checkpoint_bytes(report.path)) / 1e6,
                           "reload_sends": report.reload_sends, **sampling.around(t0, t1),
                           **{f"vs_expected_{k}": v for k, v in spread(served, expected).items()},
                           **{f"vs_float32_{k}": v for k, v in
                              spread(served, learner_logprobs(learner, contexts)).items()}}
                    if previous is not None:
                        row |= {f"vs_previous_{k}": v for k, v in spread(served, previous).items()}
                    previous = expected
                    rows.append(row)
                    phases = ", ".join(f"{k.removesuffix('_s')} {v:.2f}" for k, v in row.items()
                                       if k.endswith("_s") and k not in ("stall_s",))
                    print(f"{name} push {push} via {via} ({report.verified_by}): {row['seconds']:.2f} s ({phases}), "
                          f"{row['bytes_mb']:.0f} MB; sampling stalled {row['stall_s']:.2f} s, "
                          f"{row['tokens_per_s_during']:.0f} tokens/s during vs "
                          f"{row['tokens_per_s_before']:.0f} before; |server - expected| max "
                          f"{row['vs_expected_max_nats']:.3f} median {row['vs_expected_median_nats']:.3f} "
                          f"nats", flush=True)
                    if via == "disk":
                        shutil.rmtree(report.path, ignore_errors=True)
    return {"served_dtype": dtype, **{f"as_started_{k}": v for k, v in before.items()},
            "tolerance_nats": PUSH_TOLERANCE[dtype], "rows": rows}


def _checkpoint_bytes(path: Path | None) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors")) if path is not None else 0


async def run(args: argparse.Namespace) -> dict:
    results = []
    with tempfile.TemporaryDirectory() as logs:
        for shape in args.shapes:
            for name in args.variants:
                if shape == "tiny" and name == "tied":
                    continue  # the bundled base is untied
                for replicas in args.replicas:
                    results.append(await variant(shape, name == "tied", args.pushes, args.via, args.streams,
                                                 Path(logs), args.tolerance, args.lora_rank, replicas))
    return {"machine": harness.machine(), "command": " ".join(["python", *sys.argv]),
            "perturbation_std": PERTURBATION_STD, "variants": results}


def plot(report: dict, path: Path) -> None:
    plt = harness.pyplot()
    fig, (time_ax, stall_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for result in report["variants"]:
        for via in sorted({r["via"] for r in result["rows"]}):
            rows = [r for r in result["rows"] if r["via"] == via]
            label = f"{result['shape']} {'tied' if result['tied'] else 'untied'} x{result['replicas']}, {via}"
            time_ax.plot([r["seconds"] for r in rows], "o-", label=label)
            stall_ax.plot([r["stall_s"] for r in rows], "o-", label=label)
    time_ax.set(xlabel="push", ylabel="seconds", title="push, all phases")
    stall_ax.set(xlabel="push", ylabel="seconds", title="longest gap between sampled tokens")
    time_ax.legend(fontsize=8)
    harness.save_figure(fig, path)


def main() -> None:
    parser = harness.argument_parser(__doc__, live_servers=False)
    parser.add_argument("--shapes", nargs="+", choices=("tiny", *harness.SHAPE_NAMES), default=["small"],
                        help="tiny: the bundled toy base (float32, untied only); else a realistic-shape base "
                             "(bfloat16), each variant of it")
    parser.add_argument("--via", nargs="+", choices=("disk", "memory", "digest"), default=["disk", "memory", "digest"],
                        help="how each push goes, in this order within every round (memory: probed every push; "
                             "digest: in memory, proved by digest after a probed first push)")
    parser.add_argument("--streams", type=int, default=4, help="streaming requests sampling during the pushes")
    parser.add_argument("--lora-rank", type=int, default=16,
                        help="then one in-memory push of the learner with LoRA adapters of this rank on every "
                             "projection (dualvllm.training.lora.wrap): only the adapted decoder layers move; 0: none")
    parser.add_argument("--variants", nargs="+", choices=("untied", "tied"), default=["untied", "tied"])
    parser.add_argument("--pushes", type=int, default=3)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1],
                        help="base servers in a ReplicaPool, each pushed to (all at once, as dualvllm train does); "
                             "several counts run one after the other")
    parser.add_argument("--tolerance", type=float,
                        help="accept pushes this far off (nats; default: PUSH_TOLERANCE of the served dtype), to "
                             "measure a variant that fails verification")
    parser.add_argument("--output", type=Path, default=harness.RESULTS_DIR / "weight_push.json")
    args = parser.parse_args()
    harness.finish(loop.run(run(args)), args.output, plot)


if __name__ == "__main__":
    main()
