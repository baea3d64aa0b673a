"""Peak memory and wall time of one learner update at a real vocabulary (issue 41), no model files.

    python benchmarks/learner_memory.py --shape small                    # Qwen3 layout, 2 layers, V = 151,936
    python benchmarks/learner_memory.py --shape qwen3-0.6b --rollouts 8 --completion-tokens 128 \\
        --micro-batch 1 --gradient-checkpointing                         # a first look at the real shape
    nice python benchmarks/learner_memory.py --shape qwen3-0.6b --rollouts 64 --completion-tokens 1024 \\
        --micro-batch 1 --gradient-checkpointing                         # the failing update of issue 41

The model is built from its config with random weights, in float32 as the learner keeps its
master weights (AdamW over all of them): `small` is Qwen3's layout at vocabulary 151,936 with
hidden 128, 2 layers, head_dim 64; `qwen3-0.6b` is Qwen3-0.6B's exact config (hidden 1,024,
28 layers, 16 heads, 8 KV heads, head_dim 128, intermediate 3,072, tied embeddings).

The batch: `--rollouts` rollouts in groups of `--group-size`, each `--prompt-tokens` prompt
tokens then `--completion-tokens` completion tokens (random ids, every rollout full length:
the worst case), rewards 0/1 alternating within each group, log q* per token, and the
teacher's top-20 at every state. Two updates, each `Learner.train_step` (forward, backward,
clipping, AdamW step): GRPO (correction sequence, dapo: the default objective, whose
advantages need a first pass without gradients when micro-batched) and method distill
(forward KL on the teacher's top-20 with the tail bucket).

Each update runs in a fresh subprocess, so one update's peak cannot inflate the other's:
peak RSS is that process's ru_maxrss (torch, the model, its gradients, AdamW's two moments,
the update). In the subprocess a warm-up update on 2 rollouts of 8 + 8 tokens runs first
(AdamW's moments then exist, kernels are loaded), then the measured one.
`--code-root DIR` imports the learner from another checkout (a worktree of an older commit)
to measure it before a change; the learner's new options are then not passed. That checkout
must have the `dualvllm.<name>` packages (dualvllm/training -> ../training); one from before
them has no `dualvllm.training`.
Writes benchmarks/results/learner_memory.json (units in the keys) and a plot.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `benchmarks` is not an installed package

VOCAB = 151_936  # Qwen2.5 / Qwen3
SHAPES = {
    "small": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                  intermediate_size=384, tie_word_embeddings=True),
    # Qwen/Qwen3-0.6B's config.json
    "qwen3-0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=3072, tie_word_embeddings=True, rope_theta=1_000_000,
                       max_position_embeddings=40_960, rms_norm_eps=1e-6),
}
UPDATES = ("grpo", "distill")
TOP_K = 20
TARGET_PEAK_RSS_GB = 16.0  # issue 41: both updates of 64 x 1,024 tokens at Qwen3-0.6B within 16 GB
GB = 1e9


def build_model(shape: str):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, **SHAPES[shape])).float()


def synthetic_batch(rollouts: int, group_size: int, prompt_tokens: int, completion_tokens: int, seed: int):
    """Random rollouts shaped like real ones, with everything both updates read."""
    import numpy as np

    from dualvllm.training.rollouts import Rollout, ScoredBatch

    rng = np.random.default_rng(seed)
    rows = []
    for i in range(rollouts):
        n = completion_tokens
        topk_ids = rng.integers(1, VOCAB, size=(n, TOP_K), dtype=np.int64)
        topk_logprobs = np.sort(np.log(rng.dirichlet(np.ones(TOP_K + 1), size=n)[:, :TOP_K]), axis=1)[:, ::-1]
        rows.append(Rollout(prompt_ids=tuple(rng.integers(1, VOCAB, prompt_tokens).tolist()),
                            completion_ids=tuple(rng.integers(1, VOCAB, n).tolist()),
                            logprobs_q=tuple(rng.uniform(-13.0, -11.0, n).tolist()), alphas=(0.5,) * n, text="",
                            reward=float(i % 2), logprobs_t=tuple(rng.uniform(-13.0, -1.0, n).tolist()),
                            teacher_topk=(topk_ids, topk_logprobs.copy())))
    groups = tuple(tuple(rows[start:start + group_size]) for start in range(0, rollouts, group_size))
    return ScoredBatch(groups=groups, policy_version=0, data_position=0, sample_seconds=0.0,
                       tokens=rollouts * completion_tokens)


def objective_for(update: str):
    from dualvllm.training.learner import Objective

    if update == "grpo":
        return Objective(method="grpo", correction="sequence", normalization="dapo")
    return Objective(method="distill", distill_coef=1.0, distill_beta=0.0)


def child(spec: dict) -> dict:
    """One update in this (fresh) process: its wall time and the process's peak RSS."""
    if spec["code_root"]:
        sys.path.insert(0, spec["code_root"])
    import logging

    import psutil
    import torch

    from dualvllm.training.learner import Learner

    options = {}
    if not spec["code_root"]:
        options = dict(micro_batch_size=spec["micro_batch"], gradient_checkpointing=spec["gradient_checkpointing"])
        if spec["logit_chunk"] is not None:
            options["logit_chunk_size"] = spec["logit_chunk"]
    model = build_model(spec["shape"])
    rss_model = psutil.Process().memory_info().rss
    learner = Learner(model, learning_rate=1e-6, kl_coef=0.0, pad_id=0, **options)
    objective = objective_for(spec["update"])
    learner.train_step(synthetic_batch(2, 2, 8, 8, seed=1), objective)  # warm-up
    batch = synthetic_batch(spec["rollouts"], spec["group_size"], spec["prompt_tokens"], spec["completion_tokens"],
                            seed=2)
    rss_before = psutil.Process().memory_info().rss
    # The measured update's progress, micro-batch by micro-batch, on stderr (an update at the
    # real shape runs for an hour on 2 CPU cores; the parent echoes it).
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    logging.getLogger("dualvllm.training").setLevel(logging.DEBUG)
    started = time.perf_counter()
    metrics = learner.train_step(batch, objective)
    seconds = time.perf_counter() - started
    assert all(v == v for v in metrics.values()), f"the update gave a nan metric: {metrics}"
    return {"wall_s": seconds, "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB,
            "rss_after_model_gb": rss_model / GB, "rss_before_update_gb": rss_before / GB,
            "train_tokens": metrics["train_tokens"], "tokens_per_s": metrics["train_tokens"] / seconds,
            "loss": metrics["loss"], "torch_threads": torch.get_num_threads()}


def measure(spec: dict) -> dict:
    """`child(spec)` in a fresh interpreter (same niceness), its report read from its last line; its
    stderr (the update's progress) echoed as it comes."""
    with subprocess.Popen([sys.executable, __file__, "--child", json.dumps(spec)], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, cwd=REPO) as child_process:
        last = ""
        for line in child_process.stderr:  # type: ignore[union-attr]
            print(line, end="", file=sys.stderr, flush=True)
            last = line.strip() or last
        stdout = child_process.stdout.read()  # type: ignore[union-attr]
        code = child_process.wait()
    if code != 0:
        return {**spec, "failed": last or f"exit {code}", "exit_code": code}
    return {**spec, **json.loads(stdout.strip().splitlines()[-1])}


def unchunked_logits_gb(rollouts: int, prompt_tokens: int, completion_tokens: int) -> dict[str, float]:
    """What the learner before issue 41 allocated at this shape, in float32: the model's logits
    [B, L, V], their completion rows [B, T, V] and their log_softmax [B, T, V] (each alone
    larger than the whole update needs now)."""
    rows_by_positions = rollouts * (prompt_tokens + completion_tokens)
    return {"unchunked_model_logits_gb": rows_by_positions * VOCAB * 4 / GB,
            "unchunked_completion_logits_gb": rollouts * completion_tokens * VOCAB * 4 / GB}


def print_row(row: dict) -> None:
    options = (f"micro-batch {row['micro_batch'] or 'all'}, chunk {row['logit_chunk'] or 'default'}, "
               f"checkpointing {'on' if row['gradient_checkpointing'] else 'off'}"
               + (f", code from {row['code_root']}" if row["code_root"] else ""))
    if "failed" in row:
        print(f"{row['update']:<8} {row['shape']:<11} {row['rollouts']} x {row['completion_tokens']}  {options}  "
              f"FAILED: {row['failed']}", flush=True)
        return
    print(f"{row['update']:<8} {row['shape']:<11} {row['rollouts']} x ({row['prompt_tokens']} + "
          f"{row['completion_tokens']})  {options}  |  {row['wall_s']:8.1f} s  {row['tokens_per_s']:7.1f} tok/s  |  "
          f"peak RSS {row['peak_rss_gb']:6.2f} GB (model built {row['rss_after_model_gb']:.2f}, before the update "
          f"{row['rss_before_update_gb']:.2f})", flush=True)


def plot(report: dict, path: Path) -> None:
    """Peak RSS of each update against the target."""
    from benchmarks import harness

    plt = harness.pyplot()
    rows = [r for r in report["rows"] if "failed" not in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar([r["update"] for r in rows], [r["peak_rss_gb"] for r in rows])
    ax.axhline(TARGET_PEAK_RSS_GB, color="red", linestyle="--", label=f"target {TARGET_PEAK_RSS_GB:.0f} GB")
    first = report["rows"][0]
    ax.set(ylabel="peak RSS (GB)", title=f"{first['shape']}, {first['rollouts']} x {first['completion_tokens']} "
                                         "tokens, one update")
    ax.legend(fontsize=8)
    harness.save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--shape", choices=list(SHAPES), default="small")
    parser.add_argument("--rollouts", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8, help="rollouts per prompt (the GRPO groups)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--completion-tokens", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=None, help="rollouts per pass; default: the whole batch")
    parser.add_argument("--logit-chunk", type=int, default=None, help="positions per lm_head chunk; default: "
                                                                       "the learner's")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--updates", nargs="+", choices=UPDATES, default=list(UPDATES))
    parser.add_argument("--code-root", default="", help="import the learner from this checkout (before a change)")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/learner_memory.json"))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    from benchmarks import harness

    rows = []
    for update in args.updates:
        spec = {"update": update, "shape": args.shape, "rollouts": args.rollouts, "group_size": args.group_size,
                "prompt_tokens": args.prompt_tokens, "completion_tokens": args.completion_tokens,
                "micro_batch": args.micro_batch, "logit_chunk": args.logit_chunk,
                "gradient_checkpointing": args.gradient_checkpointing, "code_root": args.code_root}
        rows.append(measure(spec))
        print_row(rows[-1])
    report = {"machine": harness.machine(), "command": " ".join(["python", *sys.argv]), "rows": rows,
              "target_peak_rss_gb": TARGET_PEAK_RSS_GB,
              **unchunked_logits_gb(args.rollouts, args.prompt_tokens, args.completion_tokens)}
    print(f"before issue 41, float32 logits alone at this shape: {report['unchunked_model_logits_gb']:.1f} GB "
          f"[B, L, V], {report['unchunked_completion_logits_gb']:.1f} GB per [B, T, V]")
    harness.finish(report, args.output, plot)


if __name__ == "__main__":
    main()
