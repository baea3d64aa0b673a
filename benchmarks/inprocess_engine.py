"""The in-process engine's cost per token at a real vocabulary (151,936 tokens), no servers.

    python benchmarks/inprocess_engine.py                  # a random-weight Qwen3 with the real vocabulary
    python benchmarks/inprocess_engine.py --model DIR --batch-sizes 1 8 64 --tokens 128 512

Steps a batch of B contexts (a prompt of `--prompt-tokens` random ids each) for N tokens
through `TransformersEngine.next_token_topk(contexts, k)`, appending one of the returned
top-k tokens to every row after each call, as the coordinator does in per-token mode (it
rebuilds each context as a new list every step, and so does this script). The first call
prefills the prompts; the other N - 1 run one token per row on the engine's KV cache.

Reports, per (B, N): tokens/s (B * N over the run's wall time, prefill included), the
prefill call, the median decode call, and where a decode call goes: the model's forward
pass (timed by hooks on the model, so any version of the engine can be measured) and,
when the engine reports them (`engine.scorer.phase_seconds`; older engines: `engine.phase_seconds`), matching the contexts
against its cache, its KV bookkeeping (gathering, merging, masks) and the vocabulary work
(top-k and normalizer). `other` is the rest of the call (the thread hop, the lock,
building the answer). After each run, the top-k logprobs of a few rows are compared with
the engine's full float64 distribution (`next_token_logprobs`) for the same contexts.

The default model is built here: Qwen3 architecture, vocabulary 151,936, hidden 128, 2
layers, 2 heads of 64, intermediate 512, random weights, saved in a temporary directory
with the bundled base model's tokenizer (the engine needs one to load; the ids need not
match). Its layers are cheap next to a real model's, so the costs that grow with the
vocabulary and the context show. One warm-up run of 4 tokens per batch size first.
Writes benchmarks/results/inprocess_engine.json (units in the keys) and a plot.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `benchmarks` is not an installed package

from dualvllm import tinymodels  # noqa: E402
from dualvllm.common import loop  # noqa: E402
from benchmarks import harness  # noqa: E402
from dualvllm.engines.transformers_engine import TransformersEngine  # noqa: E402

PHASES = ("contexts", "kv", "forward", "vocab")  # as the engine names them; "forward" is also hooked
CHECKED_ROWS = 8  # rows compared with the full distribution after a run (a float64 [rows, V] array)
QWEN3_SHAPE = dict(vocab_size=151_936, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=2, head_dim=64, intermediate_size=512, max_position_embeddings=4096)


@contextlib.contextmanager
def model_dir(given: Path | None) -> Iterator[Path]:
    """`given`, or a random-weight Qwen3 of QWEN3_SHAPE saved in a temporary directory."""
    if given is not None:
        yield given
        return
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="inprocess-engine-") as tmp:
        Qwen3ForCausalLM(Qwen3Config(**QWEN3_SHAPE)).save_pretrained(tmp)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tinymodels.BASE_DIR / name, Path(tmp) / name)
        yield Path(tmp)


class ForwardClock:
    """Seconds spent in the model's forward passes, from hooks on the model."""

    def __init__(self, model: Any) -> None:
        self.seconds = 0.0
        self._started = 0.0
        model.register_forward_pre_hook(self._enter)
        model.register_forward_hook(self._exit)

    def _enter(self, *_: object) -> None:
        self._started = time.perf_counter()

    def _exit(self, *_: object) -> None:
        self.seconds += time.perf_counter() - self._started


async def run(engine: TransformersEngine, clock: ForwardClock, batch: int, tokens: int, args: argparse.Namespace,
              seed: int) -> dict:
    """One run of `batch` contexts for `tokens` steps; its timings and the top-k's error."""
    rng = np.random.default_rng(seed)
    vocab = (await engine.model_info()).vocab_size
    prompts = [[int(t) for t in rng.integers(0, vocab, args.prompt_tokens)] for _ in range(batch)]
    generated: list[list[int]] = [[] for _ in range(batch)]
    calls: list[dict[str, float]] = []
    started = time.perf_counter()
    for _ in range(tokens):
        contexts = [[*p, *g] for p, g in zip(prompts, generated)]
        phases_before = dict(getattr(getattr(engine, "scorer", engine), "phase_seconds", {}))
        forward_before, call_started = clock.seconds, time.perf_counter()
        top = await engine.next_token_topk(contexts, args.top_k)
        call = {"total": time.perf_counter() - call_started, "forward": clock.seconds - forward_before}
        for phase, seconds in getattr(getattr(engine, "scorer", engine), "phase_seconds", {}).items():
            if phase != "forward":
                call[phase] = seconds - phases_before[phase]
        calls.append(call)
        picks = rng.integers(0, top.token_ids.shape[1], batch)
        for row, pick in enumerate(picks):
            generated[row].append(int(top.token_ids[row, pick]))
    wall_s = time.perf_counter() - started
    checked = contexts[:CHECKED_ROWS]
    full = await engine.next_token_logprobs(checked)  # float64 [rows, V]
    top = await engine.next_token_topk(checked, args.top_k)
    expected = np.take_along_axis(full, top.token_ids, axis=1)
    row: dict[str, Any] = {"batch_size": batch, "tokens_per_sequence": tokens, "prompt_tokens": args.prompt_tokens,
                           "top_k": args.top_k, "tokens_per_s": batch * tokens / wall_s, "wall_s": wall_s,
                           "prefill_call_ms": calls[0]["total"] * 1e3,
                           "topk_logprob_max_abs_error": float(np.max(np.abs(top.logprobs - expected))),
                           "topk_ids_equal_full_argsort": bool(
                               (top.token_ids == np.argsort(-full, axis=1, kind="stable")[:, :args.top_k]).all())}
    decode = calls[1:]
    for phase in ("total", *PHASES):
        if all(phase in c for c in decode):
            row[f"decode_{phase}_median_ms"] = float(np.median([c[phase] for c in decode])) * 1e3
    accounted = [c["forward"] + sum(c.get(p, 0.0) for p in PHASES if p != "forward") for c in decode]
    row["decode_other_median_ms"] = float(np.median([c["total"] - a for c, a in zip(decode, accounted)])) * 1e3
    return row


def print_row(row: dict) -> None:
    phases = "  ".join(f"{p} {row[f'decode_{p}_median_ms']:7.2f}" for p in (*PHASES, "other")
                       if f"decode_{p}_median_ms" in row)
    print(f"B {row['batch_size']:>3}  N {row['tokens_per_sequence']:>4}  {row['tokens_per_s']:8.1f} tok/s  "
          f"prefill {row['prefill_call_ms']:8.1f} ms  decode call {row['decode_total_median_ms']:7.2f} ms "
          f"[{phases}]  top-k error {row['topk_logprob_max_abs_error']:.1e}", flush=True)


def plot(report: dict, path: Path) -> None:
    """The median decode call per (B, N), stacked by where it goes."""
    plt = harness.pyplot()
    rows = report["rows"]
    labels = [f"B{r['batch_size']} N{r['tokens_per_sequence']}" for r in rows]
    fig, ax = plt.subplots(figsize=(9, 5))
    stacked = np.zeros(len(rows))
    for phase in (*PHASES, "other"):
        values = np.array([r.get(f"decode_{phase}_median_ms", 0.0) for r in rows])
        ax.bar(labels, values, bottom=stacked, label=phase)
        stacked += values
    ax.set(ylabel="median ms per decode call",
           title=f"next_token_topk, vocabulary {report['vocab_size']}")
    ax.legend(fontsize=8)
    harness.save_figure(fig, path)


async def measure(args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    with model_dir(args.model) as path:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(path)
    clock = ForwardClock(model)
    rows = []
    async with TransformersEngine.live(model, tokenizer) as engine:
        for batch in args.batch_sizes:
            await run(engine, clock, batch, 4, args, seed=0)  # warm-up
            for tokens in args.tokens:
                rows.append(await run(engine, clock, batch, tokens, args, seed=batch * 1000 + tokens))
                print_row(rows[-1])
    return {"machine": harness.machine(), "command": " ".join(["python", *sys.argv]),
            "model": str(args.model or QWEN3_SHAPE), "vocab_size": model.config.vocab_size,
            "torch_threads": torch.get_num_threads(), "rows": rows}


def main() -> None:
    parser = harness.argument_parser(__doc__, live_servers=False)
    parser.add_argument("--model", type=Path, help="a model directory; default: a random-weight Qwen3, see above")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 512], help="tokens per sequence per run")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="random prompt ids per sequence")
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--threads", type=int, help="torch intra-op threads; default: torch's choice (one per core). "
                        "1 keeps other processes on a shared machine from stalling every parallel region")
    parser.add_argument("--output", type=Path, default=harness.RESULTS_DIR / "inprocess_engine.json")
    args = parser.parse_args()
    harness.finish(loop.run(measure(args)), args.output, plot)


if __name__ == "__main__":
    main()
