"""What a sequence costs the coordinator, apart from its tokens: the all-in CPU split in two.

    python benchmarks/sequence_overhead.py                          # bundled models, lockstep, batch 64
    python benchmarks/sequence_overhead.py --group 1 8 --tokens 8 48 --local-tokenizers
    python benchmarks/sequence_overhead.py --theta-url URL --t-url URL --batch 256 --tokens 64 512

The coordinator's process CPU for one `generate_batch` call is taken as
`batch x (per_sequence + tokens x per_token)`: two output lengths give both terms.
`per_token` is the step loop (reports, merge, alpha*, sampling, replies in lockstep mode);
`per_sequence` is what each sequence costs once, whatever its length: tokenizing its prompt
(a /tokenize request per server, unless `local_tokenizers`), its requests to the servers
(in lockstep mode one streamed completion per server), its detokenization (a /detokenize
request, unless `local_tokenizers`) and its output. On short sequences the per-sequence
term dominates the all-in CPU per token that benchmarks/throughput.py reports.

`--stop S` gives every call a stop string: a sequence with stop strings has the newest
tokens' text checked after every token (coordinator/delivery.py), which adds to the
per-token term.

`--group G` repeats each distinct prompt G times in a call (`batch / G` distinct prompts),
as RL rollouts do (GRPO's group of samples per prompt): each distinct text is tokenized
once per server and call, so the per-sequence term falls with G.

Every call is ignore_eos, temperature 1; one warm-up call, then `--repeats` measured calls
per point, median of their CPU. Writes benchmarks/results/sequence_overhead.json.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `benchmarks` is not an installed package

from dualvllm.common import loop  # noqa: E402
from benchmarks import harness  # noqa: E402
from dualvllm.coordinator import CoordinatorConfig, DualVLLMCoordinator  # noqa: E402


async def call_cpu(coordinator: DualVLLMCoordinator, prompts: list[str], tokens: int, seed: int,
                   stop: tuple[str, ...]) -> tuple[float, float, int]:
    """(process CPU seconds, wall seconds, tokens generated) of one call."""
    cpu, wall = time.process_time(), time.perf_counter()
    outputs = await coordinator.generate_batch(prompts, max_tokens=tokens, seed=seed, ignore_eos=True, stop=stop)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    failed = [o.error for o in outputs if not o.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(outputs)} sequences failed, e.g. {failed[0]}")
    short = [o for o in outputs if o.finish_reason == "context_limit"]
    if short:  # the split would divide by tokens that were never generated
        raise SystemExit(f"{len(short)} of {len(outputs)} sequences reached the models' context limit before "
                         f"{tokens} tokens: pick shorter --tokens (the bundled models' context is 64 tokens)")
    return cpu, wall, sum(len(o.generated_tokens) for o in outputs)


async def run(args) -> dict:
    short, long = sorted(args.tokens)
    if long < 2 * short:
        raise SystemExit("--tokens needs two lengths at least 2x apart: the split divides by their difference, "
                         "and the machine's noise swamps a small one")
    stop = tuple(args.stop or ())
    rows = []
    async with harness.servers(args.theta_url, args.t_url, max_logprobs=max(args.top_k, 20), lockstep=True) as urls:
        config = CoordinatorConfig(theta_url=urls[0], t_url=urls[1], top_k=args.top_k, mode=args.mode,
                                   max_batch_size=args.batch, local_tokenizers=args.local_tokenizers)
        async with DualVLLMCoordinator(config) as coordinator:
            for group in args.group:
                if args.batch % group:
                    raise SystemExit(f"--group {group} does not divide --batch {args.batch}")
                distinct = harness.prompts_for(args.batch // group, seed=0)
                prompts = [prompt for prompt in distinct for _ in range(group)]
                cpu: dict[int, float] = {}
                wall: dict[int, float] = {}
                for tokens in (short, long):
                    await call_cpu(coordinator, prompts, tokens, seed=0, stop=stop)  # warm-up
                    runs = [await call_cpu(coordinator, prompts, tokens, seed=1 + r, stop=stop)
                            for r in range(args.repeats)]
                    cpu[tokens] = statistics.median(c for c, _, _ in runs)
                    wall[tokens] = statistics.median(w for _, w, _ in runs)
                per_token = (cpu[long] - cpu[short]) / (args.batch * (long - short))
                per_sequence = cpu[short] / args.batch - short * per_token
                row = {"group": group, "per_sequence_ms": 1e3 * per_sequence, "per_token_us": 1e6 * per_token}
                for tokens in (short, long):
                    row[f"all_in_us_per_token_at_{tokens}"] = 1e6 * cpu[tokens] / (args.batch * tokens)
                    row[f"tokens_per_s_at_{tokens}"] = args.batch * tokens / wall[tokens]
                rows.append(row)
                print(f"group {group:>3}: {row['per_sequence_ms']:.2f} ms per sequence + {row['per_token_us']:.1f} µs "
                      f"per token; all-in {row[f'all_in_us_per_token_at_{short}']:.1f} µs per token at {short} tokens, "
                      f"{row[f'all_in_us_per_token_at_{long}']:.1f} at {long} "
                      f"({row[f'tokens_per_s_at_{long}']:,.0f} tokens/s)", flush=True)
    return {"machine": harness.machine(), "args": {k: v for k, v in vars(args).items() if k != "output"}, "rows": rows}


def main() -> None:
    parser = harness.argument_parser(__doc__, live_servers=True)
    parser.add_argument("--mode", choices=("lockstep", "per_token"), default="lockstep")
    parser.add_argument("--batch", type=int, default=64, help="sequences per call")
    parser.add_argument("--tokens", type=int, nargs=2, default=[8, 48],
                        help="the two output lengths (the bundled models' context is 64 tokens)")
    parser.add_argument("--group", type=int, nargs="+", default=[1, 8], help="samples per distinct prompt")
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3, help="measured calls per point (after one warm-up)")
    parser.add_argument("--stop", action="append",
                        help="a stop string every call passes (repeatable): pick one the text never holds, and the "
                             "per-token term shows what checking it costs")
    parser.add_argument("--local-tokenizers", action="store_true",
                        help="tokenize and detokenize in this process (CoordinatorConfig.local_tokenizers)")
    parser.add_argument("--output", type=Path, default=harness.RESULTS_DIR / "sequence_overhead.json")
    args = parser.parse_args()
    report = loop.run(run(args))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
