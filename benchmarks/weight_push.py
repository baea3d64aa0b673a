"""Weight pushes at a real shape: how long each phase takes, and how far a bf16 server's
logprobs sit from the pushed checkpoint's own.

    python benchmarks/weight_push.py --shape small                 # tied and untied, 3 pushes each
    python benchmarks/weight_push.py --shape qwen3-0.6b --variants tied --pushes 2

For each variant (tied or untied embeddings) of the realistic-shape base (tinymodels.shapes,
a 151,936-token vocabulary, bf16 checkpoint), one dev-mode vLLM server is started with
`--dtype auto` (bfloat16: the checkpoint's dtype) and a float32 learner is loaded from the
same checkpoint, as `dualvllm train` does. Each push perturbs every learner weight by
N(0, 1e-3^2), then times the phases of training.weight_sync's push: `write` (the checkpoint
saved in the server's dtype, and the expected logprobs computed from it at that dtype in
transformers), `reload` (pause, /collective_rpc reload_weights, prefix-cache reset, resume)
and `probe` (the server's top-k on the probe contexts). The |server - expected| logprobs
over the probes' top-k are recorded (max and median): they are what PUSH_TOLERANCE must
accept. For contrast, the same against the learner's float32 weights (`vs_float32_*`) and
against the previous push's weights (`vs_previous_*`: the update itself, which a bf16
verification cannot tell from round-off when it is as small as this).
Writes benchmarks/results/weight_push.json (units in the keys).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `benchmarks` is not an installed package

from common import loop  # noqa: E402
from benchmarks import harness  # noqa: E402
from engines.launcher import ServerConfig, VLLMServer  # noqa: E402
from engines.vllm_client import VLLMClient  # noqa: E402
from training.weight_sync import (PUSH_TOLERANCE, checkpoint_logprobs, compare_logprobs,  # noqa: E402
                                  learner_logprobs, reload_and_verify, served_dtype, write_push)

PROBE_LENGTHS = (3, 5, 17, 33, 64, 120)  # prompt-like contexts, short to long
PERTURBATION_STD = 1e-3


def probes(vocab_real: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_real, size=n).tolist() for n in PROBE_LENGTHS]


def spread(served, expected: np.ndarray) -> dict[str, float]:
    diff = compare_logprobs(served, expected)
    return {"max_nats": diff.max_abs_diff, "median_nats": diff.median_abs_diff}


async def variant(shape: str, tied: bool, pushes: int, log_dir: Path, tolerance: float | None) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tinymodels.shapes import ensure_pair

    base_dir, _ = ensure_pair(shape, tied=tied)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    contexts = probes(len(tokenizer))
    server = VLLMServer(ServerConfig(model=str(base_dir), dev_mode=True, lockstep=False,
                                     log_path=log_dir / f"{shape}-{'tied' if tied else 'untied'}.log"), name="theta")
    started = time.perf_counter()
    await server.start()
    startup_s = time.perf_counter() - started
    rows = []
    try:
        async with VLLMClient(server.url, name="theta") as client:
            dtype = await served_dtype(client)
            learner = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
            start = await asyncio.to_thread(checkpoint_logprobs, base_dir, contexts, dtype=dtype)
            before = spread(await client.next_token_topk(contexts, 20), start)  # the server as started
            print(f"{shape} {'tied' if tied else 'untied'} as started: |server - checkpoint| max "
                  f"{before['max_nats']:.3f} median {before['median_nats']:.3f} nats", flush=True)
            previous = None
            with tempfile.TemporaryDirectory() as scratch:
                for push in range(pushes):
                    with torch.no_grad():
                        for parameter in learner.parameters():
                            parameter.add_(PERTURBATION_STD * torch.randn_like(parameter))
                    out = Path(scratch) / f"push-{push}"
                    t0 = time.perf_counter()
                    expected = await asyncio.to_thread(write_push, learner, tokenizer, out, contexts, dtype=dtype)
                    t1 = time.perf_counter()
                    report = await reload_and_verify(client, out, contexts, expected, top_k=20,
                                                     tolerance=tolerance or PUSH_TOLERANCE[dtype])
                    t2 = time.perf_counter()
                    served = await client.next_token_topk(contexts, 20)
                    t3 = time.perf_counter()
                    row = {"push": push, "write_s": t1 - t0, "reload_and_verify_s": t2 - t1, "probe_s": t3 - t2,
                           "checkpoint_mb": sum(f.stat().st_size for f in out.glob("*.safetensors")) / 1e6,
                           "reload_sends": report.reload_sends,
                           **{f"vs_expected_{k}": v for k, v in spread(served, expected).items()},
                           **{f"vs_float32_{k}": v for k, v in
                              spread(served, learner_logprobs(learner, contexts)).items()}}
                    if previous is not None:
                        row |= {f"vs_previous_{k}": v for k, v in spread(served, previous).items()}
                    previous = expected
                    rows.append(row)
                    print(f"{shape} {'tied' if tied else 'untied'} push {push}: write {row['write_s']:.2f} s, "
                          f"reload+verify {row['reload_and_verify_s']:.2f} s, {row['checkpoint_mb']:.0f} MB; "
                          f"|server - expected| max {row['vs_expected_max_nats']:.3f} median "
                          f"{row['vs_expected_median_nats']:.3f} nats; vs float32 learner max "
                          f"{row['vs_float32_max_nats']:.3f}; vs previous push max "
                          f"{row.get('vs_previous_max_nats', float('nan')):.3f}", flush=True)
    finally:
        server.stop()
    return {"shape": shape, "tied": tied, "served_dtype": dtype, "server_startup_s": startup_s,
            **{f"as_started_{k}": v for k, v in before.items()},
            "tolerance_nats": PUSH_TOLERANCE[dtype], "rows": rows}


async def run(args: argparse.Namespace) -> dict:
    results = []
    with tempfile.TemporaryDirectory() as logs:
        for name in args.variants:
            results.append(await variant(args.shape, name == "tied", args.pushes, Path(logs), args.tolerance))
    return {"machine": harness.machine(), "command": " ".join(["python", *sys.argv]),
            "perturbation_std": PERTURBATION_STD, "variants": results}


def plot(report: dict, path: Path) -> None:
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for result in report["variants"]:
        label = f"{result['shape']} {'tied' if result['tied'] else 'untied'}"
        ax.plot([r["vs_expected_max_nats"] for r in result["rows"]], "o-", label=f"{label}: max")
        ax.plot([r["vs_expected_median_nats"] for r in result["rows"]], "x--", label=f"{label}: median")
    ax.set(xlabel="push", ylabel="|server - expected| (nats)", title="bf16 server vs the pushed checkpoint")
    ax.legend(fontsize=8)
    harness.save_figure(fig, path)


def main() -> None:
    parser = harness.argument_parser(__doc__, live_servers=False)
    parser.add_argument("--shape", choices=harness.SHAPE_NAMES, default="small")
    parser.add_argument("--variants", nargs="+", choices=("untied", "tied"), default=["untied", "tied"])
    parser.add_argument("--pushes", type=int, default=3)
    parser.add_argument("--tolerance", type=float,
                        help="accept pushes this far off (nats; default: PUSH_TOLERANCE of the served dtype), to "
                             "measure a variant that fails verification")
    parser.add_argument("--output", type=Path, default=harness.RESULTS_DIR / "weight_push.json")
    args = parser.parse_args()
    harness.finish(loop.run(run(args)), args.output, plot)


if __name__ == "__main__":
    main()
