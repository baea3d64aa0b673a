"""What the lockstep plugin itself costs per decode step at a real vocabulary, without servers.

    python benchmarks/lockstep_plugin_topk.py                      # V = 151,936 and the toy's 98
    python benchmarks/lockstep_plugin_topk.py --vocab 151936 --batch-sizes 64 256 --threads 1

At every decode step the plugin (engines/vllm_plugin/processor.py) reads the lockstep rows'
float32 logits [B, V]: their top-k log-softmax goes to the coordinator (`topk`), and after the
answer every row is masked to its token (`mask`: one [B, V] write). This times both on one
thread, as a server pinned to one core runs them, in CPU time, and the plugin's former top-k
(`topk_log_softmax`: a row copy, a full log-softmax, then the top-k) for comparison; each is
the median of `--repeats` timed calls after a warm-up. The model's forward pass and vLLM's
own sampler (a softmax and a draw over the same [B, V]) come on top; both servers pay the
plugin, so a lockstep step costs the base server `topk` + `mask` more than native decoding.
Writes benchmarks/results/lockstep_plugin_topk.json (units in the keys).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `benchmarks` is not an installed package

from benchmarks import harness  # noqa: E402
from dualvllm.engines.vllm_plugin.processor import row_topk  # noqa: E402

TOP_K = 20


def median_ms(call, repeats: int) -> float:
    """Median CPU time of `call` on this thread: with one torch thread the work runs here, and
    CPU time, unlike wall time, does not grow when other processes share the cores."""
    call()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.thread_time()
        call()
        times.append(time.thread_time() - started)
    return statistics.median(times) * 1e3


def measure(vocab: int, batch: int, repeats: int) -> dict:
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0)) * 3  # [B, V]
    rows = list(range(batch))
    index = torch.tensor(rows)
    chosen = torch.zeros(batch, dtype=torch.long)

    def former() -> None:
        torch.topk(torch.log_softmax(logits.index_select(0, index), dim=-1), TOP_K, dim=-1)

    def mask() -> None:
        masked = logits.clone()  # the clone is timed apart below and taken out
        masked.index_fill_(0, index, float("-inf"))
        masked[index, chosen] = 0.0

    clone_ms = median_ms(logits.clone, repeats)
    row = {"vocab": vocab, "batch_size": batch,
           "topk_ms_per_step": median_ms(lambda: row_topk(logits, rows, TOP_K), repeats),
           "topk_log_softmax_ms_per_step": median_ms(former, repeats),
           "mask_ms_per_step": max(0.0, median_ms(mask, repeats) - clone_ms)}
    for key in ("topk", "topk_log_softmax", "mask"):
        row[f"{key}_us_per_token"] = row[f"{key}_ms_per_step"] * 1e3 / batch
    return row


def main() -> None:
    parser = harness.argument_parser(__doc__, live_servers=False)
    parser.add_argument("--vocab", type=int, nargs="+", default=[151_936, 98])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a pinned server uses one per core)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--output", type=Path, default=harness.RESULTS_DIR / "lockstep_plugin_topk.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for vocab in args.vocab:
        for batch in args.batch_sizes:
            rows.append(measure(vocab, batch, args.repeats))
            r = rows[-1]
            print(f"V {vocab:>7}  batch {batch:>4}: top-k {r['topk_ms_per_step']:8.2f} ms/step "
                  f"({r['topk_us_per_token']:7.1f} µs/token; former {r['topk_log_softmax_us_per_token']:7.1f}), "
                  f"mask {r['mask_us_per_token']:6.1f} µs/token", flush=True)
    report = {"machine": harness.machine(), "command": " ".join(["python", *sys.argv]), "threads": args.threads,
              "top_k": TOP_K, "rows": rows}
    harness.finish(report, args.output, plot)


def plot(report: dict, path: Path) -> None:
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for vocab in sorted({r["vocab"] for r in report["rows"]}):
        rows = [r for r in report["rows"] if r["vocab"] == vocab]
        ax.plot([r["batch_size"] for r in rows], [r["topk_us_per_token"] for r in rows], "o-", label=f"top-k, V {vocab}")
        ax.plot([r["batch_size"] for r in rows], [r["mask_us_per_token"] for r in rows], "x--", label=f"mask, V {vocab}")
    ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="µs per token", title="lockstep plugin, one thread")
    ax.legend(fontsize=8)
    harness.save_figure(fig, path)


if __name__ == "__main__":
    main()
