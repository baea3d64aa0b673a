"""Tokens/s of the coordinator against the reference protocol and native vLLM generation.

    python benchmarks/throughput.py                   # starts the bundled tiny models (one pair)
    python benchmarks/throughput.py --theta-url URL --t-url URL --batch-sizes 1 8 64 --tokens 16 32 56
    python benchmarks/throughput.py --max-model-len 640 --tokens 512 --batch-sizes 64 256  # RL-like lengths
    python benchmarks/throughput.py --shape small --tokens 512 --batch-sizes 1 8 64 256  # a real vocabulary

Arms run back to back on the same two servers in every repeat, so their ratios come
from one run of this noisy shared machine:
- `coordinator`: DualVLLMCoordinator.generate_batch in per-token mode (one batched
  request per server per step, both servers at once), temperature 1, ignore_eos;
- `lockstep`: the same call in lockstep mode (coordinator/lockstep/: one long request
  per sequence per server, the servers' plugin asks the coordinator for every token);
  when this script starts the servers it starts them with the plugin, and per-token
  requests to them pay nothing for it;
- `coordinator_no_tokenizer`: the same on a second pair started with --skip-tokenizer-init
  (the servers detokenize nothing; the coordinator tokenizes with `local_tokenizers`),
  idle while the other arms run; only when this script starts the servers. The reference
  protocol sends text, so it needs servers with tokenizers;
- `reference`: benchmarks/reference_protocol.py, the reference implementation's protocol
  (full text per sequence per token, one request per sequence per server per token);
- `native`: the base server alone generating the same tokens natively (one request for
  the whole batch, `max_tokens` = N, ignore_eos, temperature 1): the bound no per-token
  protocol can beat. `native_topk` also returns the top-k at every token (`logprobs` k).

Each arm's tokens/s is generated tokens over its wall time. The CPU seconds per 1,000
tokens of each server's process tree (API, engine core, worker) and of this process are
recorded too: both servers and the coordinator share the machine's cores. Ratios are
medians of per-repeat ratios. Writes benchmarks/results/throughput.json (units in keys)
and throughput.png.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `benchmarks` is not an installed package

from dualvllm.common import loop  # noqa: E402
from benchmarks import harness  # noqa: E402
from benchmarks.reference_protocol import ReferenceProtocolClient  # noqa: E402
from dualvllm.coordinator import CoordinatorConfig, DualVLLMCoordinator  # noqa: E402
from dualvllm.engines.vllm_client import VLLMClient  # noqa: E402

ARMS = ("coordinator", "lockstep", "coordinator_no_tokenizer", "reference", "native", "native_topk")


async def run(args: argparse.Namespace) -> dict:
    async with contextlib.AsyncExitStack() as stack:
        logprobs = max(args.top_k, 20)
        context: dict[str, object] = {}
        if args.shape is not None:
            context = harness.shape_models(args.shape, args.max_model_len)
        elif args.max_model_len is not None:
            context = harness.long_context_models(Path(stack.enter_context(tempfile.TemporaryDirectory())),
                                                  args.max_model_len)
        theta_url, t_url = await stack.enter_async_context(harness.servers(args.theta_url, args.t_url,
                                                                          max_logprobs=logprobs, lockstep=True,
                                                                          **context))
        cpus = (harness.ServerCPU(theta_url), harness.ServerCPU(t_url))
        config = CoordinatorConfig(theta_url=theta_url, t_url=t_url, top_k=args.top_k,
                                   max_batch_size=max(args.batch_sizes), mode="per_token")
        coordinator = await stack.enter_async_context(DualVLLMCoordinator(config))
        reference = await stack.enter_async_context(
            ReferenceProtocolClient(theta_url, t_url, top_k=args.top_k, pool_size=args.pool_size))
        # One request carries a whole cell: 256 x 2,048 tokens at a real vocabulary take ~25 minutes here.
        native = await stack.enter_async_context(VLLMClient(theta_url, name="theta", request_timeout_s=7200))
        bare = bare_cpus = None
        if not (args.theta_url and args.t_url) and not args.no_tokenizer_arm:
            bare_urls = await stack.enter_async_context(harness.servers(None, None, max_logprobs=logprobs,
                                                                       skip_tokenizer_init=True, **context))
            bare_cpus = (harness.ServerCPU(bare_urls[0]), harness.ServerCPU(bare_urls[1]))
            bare = await stack.enter_async_context(DualVLLMCoordinator(config.model_copy(update={
                "theta_url": bare_urls[0], "t_url": bare_urls[1], "local_tokenizers": True})))
        model = (await native.model_info()).name
        rows = []
        for tokens in args.tokens:
            for batch in args.batch_sizes:
                prompts = harness.prompts_for(batch, seed=0)
                lockstep = None
                if not args.no_lockstep:  # one per row: its counters (parks, waits) are the row's
                    lockstep = await stack.enter_async_context(DualVLLMCoordinator(config.model_copy(update={
                        "mode": "lockstep"})))
                prompt_ids = [await native.tokenize(p) for p in prompts]

                async def coordinator_arm(seed: int, n: int, on: DualVLLMCoordinator = coordinator) -> int:
                    outs = await on.generate_batch(prompts, max_tokens=n, seed=seed, ignore_eos=True)
                    assert all(o.ok and len(o.generated_tokens) == n for o in outs), outs[0].error
                    return batch * n

                async def reference_arm(seed: int, n: int) -> int:
                    outs = await reference.generate(prompts, max_tokens=n, seed=seed)
                    return sum(len(o.tokens) for o in outs)

                async def native_arm(seed: int, n: int, logprobs: int | None) -> int:
                    payload = {"model": model, "prompt": prompt_ids, "max_tokens": n, "ignore_eos": True,
                               "temperature": 1.0, "seed": seed}
                    if logprobs:
                        payload |= {"logprobs": logprobs, "return_tokens_as_token_ids": True}
                    body = await native.call("POST", "/v1/completions", payload)
                    assert body["usage"]["completion_tokens"] == batch * n, body["usage"]
                    return batch * n

                arms = {"native": lambda s, n: native_arm(s, n, None)}
                if batch * tokens <= args.native_topk_max_tokens:
                    arms["native_topk"] = lambda s, n: native_arm(s, n, args.top_k)
                if batch <= args.per_token_max_batch:
                    arms["coordinator"] = coordinator_arm
                if lockstep is not None:
                    arms["lockstep"] = lambda s, n: coordinator_arm(s, n, lockstep)
                if bare is not None and batch <= args.per_token_max_batch:
                    arms["coordinator_no_tokenizer"] = lambda s, n: coordinator_arm(s, n, bare)
                if batch <= args.reference_max_batch:
                    arms["reference"] = reference_arm
                warmup = tokens if args.warmup_tokens is None else min(tokens, args.warmup_tokens)
                for arm in arms.values():  # warm-up (and the prefix cache, for every arm alike)
                    await arm(0, warmup)
                runs: dict[str, list[dict[str, float]]] = {name: [] for name in arms}
                for repeat in range(args.repeats):
                    for name, arm in arms.items():
                        meters = bare_cpus if name == "coordinator_no_tokenizer" else cpus
                        runs[name].append(await harness.timed(lambda: arm(repeat + 1, tokens), meters))
                rows.append(summarize(batch, tokens, runs))
                if lockstep is not None:  # over the warm-up and the repeats
                    rows[-1] |= {key: value for key, value in lockstep.get_statistics().items()
                                 if key.startswith("lockstep_")}
                print_row(rows[-1])
    return {"machine": harness.machine(), "command": " ".join(["python", *sys.argv]), "top_k": args.top_k,
            "repeats": args.repeats, "rows": rows}


def summarize(batch: int, tokens: int, runs: dict[str, list[dict[str, float]]]) -> dict:
    row: dict = {"batch_size": batch, "tokens_per_sequence": tokens}
    for name, measured in runs.items():
        for key in measured[0]:
            row[f"{name}_{key}"] = statistics.median(m[key] for m in measured)
    if "lockstep" in runs:
        lock = [m["tokens_per_s"] for m in runs["lockstep"]]
        row["lockstep_over_native_ratio"] = statistics.median(
            x / n["tokens_per_s"] for x, n in zip(lock, runs["native"]))
        if "native_topk" in runs:
            row["lockstep_over_native_topk_ratio"] = statistics.median(
                x / n["tokens_per_s"] for x, n in zip(lock, runs["native_topk"]))
    if "coordinator" not in runs:  # per-token mode skipped at this batch (--per-token-max-batch)
        return row
    coord = [m["tokens_per_s"] for m in runs["coordinator"]]
    row["coordinator_over_native_ratio"] = statistics.median(
        c / n["tokens_per_s"] for c, n in zip(coord, runs["native"]))
    if "native_topk" in runs:
        row["coordinator_over_native_topk_ratio"] = statistics.median(
            c / n["tokens_per_s"] for c, n in zip(coord, runs["native_topk"]))
    if "lockstep" in runs:
        row["lockstep_over_coordinator_ratio"] = statistics.median(x / c for x, c in zip(lock, coord))
    if "reference" in runs:
        row["coordinator_over_reference_ratio"] = statistics.median(
            c / r["tokens_per_s"] for c, r in zip(coord, runs["reference"]))
    if "coordinator_no_tokenizer" in runs:
        bare = [m["tokens_per_s"] for m in runs["coordinator_no_tokenizer"]]
        row["coordinator_no_tokenizer_over_coordinator_ratio"] = statistics.median(b / c for b, c in zip(bare, coord))
        row["coordinator_no_tokenizer_over_native_ratio"] = statistics.median(
            b / n["tokens_per_s"] for b, n in zip(bare, runs["native"]))
        if "reference" in runs:
            row["coordinator_no_tokenizer_over_reference_ratio"] = statistics.median(
                b / r["tokens_per_s"] for b, r in zip(bare, runs["reference"]))
    return row


def print_row(row: dict) -> None:
    if "coordinator_tokens_per_s" not in row:
        print(f"batch {row['batch_size']:>4} x {row['tokens_per_sequence']:>3} tokens  tokens/s: native "
              f"{row['native_tokens_per_s']:7.1f}  native+top-k {row.get('native_topk_tokens_per_s', float('nan')):7.1f}  (per-token "
              f"mode skipped); native theta CPU s per 1k tokens {row['native_theta_server_cpu_s_per_1k_tokens']:.2f}",
              flush=True)
    else:
        print_per_token_row(row)
    print_lockstep_row(row)


def print_per_token_row(row: dict) -> None:
    ref = row.get("reference_tokens_per_s")
    print(f"batch {row['batch_size']:>4} x {row['tokens_per_sequence']:>3} tokens  tokens/s: coordinator "
          f"{row['coordinator_tokens_per_s']:7.1f}  reference {ref if ref is None else round(ref, 1)!s:>7}  "
          f"native {row['native_tokens_per_s']:7.1f}  native+top-k {row.get('native_topk_tokens_per_s', float('nan')):7.1f}  |  "
          f"coordinator/native {row['coordinator_over_native_ratio']:.2f}  coordinator/reference "
          f"{row.get('coordinator_over_reference_ratio', float('nan')):.1f}  |  CPU s per 1k tokens "
          f"(coordinator, theta, t): {row['coordinator_coordinator_cpu_s_per_1k_tokens']:.2f} "
          f"{row['coordinator_theta_server_cpu_s_per_1k_tokens']:.2f} "
          f"{row['coordinator_t_server_cpu_s_per_1k_tokens']:.2f}; native theta "
          f"{row['native_theta_server_cpu_s_per_1k_tokens']:.2f}", flush=True)
    if "coordinator_no_tokenizer_tokens_per_s" in row:
        print(f"    servers without tokenizers: coordinator {row['coordinator_no_tokenizer_tokens_per_s']:7.1f} "
              f"tokens/s, x{row['coordinator_no_tokenizer_over_coordinator_ratio']:.2f} of the default, "
              f"/reference {row.get('coordinator_no_tokenizer_over_reference_ratio', float('nan')):.1f}, "
              f"/native {row['coordinator_no_tokenizer_over_native_ratio']:.2f}; servers' CPU s per 1k tokens "
              f"{row['coordinator_no_tokenizer_theta_server_cpu_s_per_1k_tokens']:.2f} "
              f"{row['coordinator_no_tokenizer_t_server_cpu_s_per_1k_tokens']:.2f}", flush=True)


def print_lockstep_row(row: dict) -> None:
    if "lockstep_tokens_per_s" in row:
        print(f"    lockstep: {row['lockstep_tokens_per_s']:7.1f} tokens/s, /native "
              f"{row['lockstep_over_native_ratio']:.2f}, /native+top-k {row.get('lockstep_over_native_topk_ratio', float('nan')):.2f}, "
              f"/per-token {row.get('lockstep_over_coordinator_ratio', float('nan')):.2f}; "
              f"CPU s per 1k tokens (coordinator, theta, t): {row['lockstep_coordinator_cpu_s_per_1k_tokens']:.3f} "
              f"{row['lockstep_theta_server_cpu_s_per_1k_tokens']:.2f} "
              f"{row['lockstep_t_server_cpu_s_per_1k_tokens']:.2f}; servers waited {row['lockstep_server_wait_ms_mean']:.1f} "
              f"ms per step, {row['lockstep_resubmissions_per_1k_tokens']:.1f} resubmissions per 1k tokens, "
              f"{100 * row['lockstep_split_report_share']:.0f}% of steps ran ahead, "
              f"{100 * row['lockstep_admission_miss_share']:.0f}% of admissions out of step "
              f"({row['lockstep_admission_rounds']} rounds, {row['lockstep_admission_forced']} forced)", flush=True)


def plot(report: dict, path: Path) -> None:
    plt = harness.pyplot()
    lengths = sorted({r["tokens_per_sequence"] for r in report["rows"]})
    fig, axes = plt.subplots(1, len(lengths), figsize=(5 * len(lengths), 4.2), squeeze=False)
    for ax, n in zip(axes[0], lengths):
        rows = [r for r in report["rows"] if r["tokens_per_sequence"] == n]
        harness.plot_tokens_per_s(ax, rows, {arm: f"{arm}_tokens_per_s" for arm in ARMS},
                                 f"{n} tokens per sequence, top_k {report['top_k']}")
    harness.save_figure(fig, path)


def main() -> None:
    parser = harness.argument_parser(__doc__, live_servers=True)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 32, 56],
                        help="output lengths (the bundled models' context is 64 tokens; see --max-model-len)")
    parser.add_argument("--max-model-len", type=int,
                        help="serve copies of the bundled models with this many positions, past the 64 they "
                             "were trained on (outputs there are meaningless; their cost is measured)")
    parser.add_argument("--shape", choices=harness.SHAPE_NAMES,
                        help="serve a realistic-shape pair (dualvllm.tinymodels.shapes: a 151,936-token vocabulary, built "
                             "and cached on first use) instead of the bundled tiny models, in bfloat16")
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--reference-max-batch", type=int, default=64,
                        help="skip the reference arm above this batch size (it is slow)")
    parser.add_argument("--pool-size", type=int, default=64, help="reference arm: connections per server")
    parser.add_argument("--per-token-max-batch", type=int, default=1 << 30,
                        help="skip per-token mode (and the arm without tokenizers) above this batch size: at a real "
                             "vocabulary and thousands of tokens it takes hours")
    parser.add_argument("--native-topk-max-tokens", type=int, default=1 << 30,
                        help="skip the native+top-k arm in cells of more tokens than this (batch x tokens per "
                             "sequence): at a real vocabulary it is the slowest arm, and lockstep's target is native")
    parser.add_argument("--warmup-tokens", type=int,
                        help="tokens per sequence of each arm's warm-up run (default: the measured length)")
    parser.add_argument("--no-lockstep", action="store_true",
                        help="skip the lockstep arm (for given servers without the plugin)")
    parser.add_argument("--no-tokenizer-arm", action="store_true",
                        help="skip the second pair of servers (without tokenizers) and its arm")
    parser.add_argument("--output", type=Path, default=harness.RESULTS_DIR / "throughput.json")
    args = parser.parse_args()
    if (args.max_model_len is not None or args.shape) and (args.theta_url or args.t_url):
        parser.error("--max-model-len and --shape set the servers this script starts; given servers keep their "
                     "own (drop --theta-url/--t-url, or those options)")
    harness.finish(loop.run(run(args)), args.output, plot)


if __name__ == "__main__":
    main()
