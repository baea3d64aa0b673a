"""How the teacher scores the base's own samples: why on-policy distillation collapsed on the mixed task.

    python benchmarks/teacher_coverage.py                      # the mixed pair, 96 training prompts, top-20
    python benchmarks/teacher_coverage.py --prompts 300 --top-k 50

The base samples a completion for each of the first N prompts of the mixed task's training
split (temperature 1, no filter). For every sampled token it prints, per difficulty: the share
outside the teacher's top-k, the teacher's exact logprob of the token, and the value a rollout
carries instead when the token is outside the top-k (the merge's "min" fill: the smallest
logprob the teacher reported), which is what `--method opd`'s per-token advantage reads.
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=22)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch
    from transformers import Qwen2ForCausalLM, Qwen2Tokenizer

    from dualvllm import tinymodels
    from dualvllm.tinymodels.task import MIXED_DATA

    torch.manual_seed(args.seed)
    base = Qwen2ForCausalLM.from_pretrained(tinymodels.BASE_MIXED_DIR, dtype=torch.float32).eval()
    teacher = Qwen2ForCausalLM.from_pretrained(tinymodels.TEACHER_MIXED_DIR, dtype=torch.float32).eval()
    tokenizer = Qwen2Tokenizer.from_pretrained(tinymodels.BASE_MIXED_DIR)
    with open(MIXED_DATA["train"]) as lines:
        rows = [json.loads(line) for _, line in zip(range(args.prompts), lines)]
    by_difficulty: dict[str, list[tuple[float, float, bool]]] = {}
    for row in rows:
        prompt = tokenizer(row["prompt"], return_tensors="pt").input_ids
        with torch.no_grad():
            sequence = base.generate(prompt, do_sample=True, max_new_tokens=args.max_tokens, top_k=0, top_p=1.0)
            logprobs = torch.log_softmax(teacher(sequence).logits[0, prompt.shape[1] - 1 : -1].float(), -1)  # [n, V]
        for position, token in enumerate(sequence[0, prompt.shape[1] :].tolist()):
            row_logprobs = logprobs[position]
            exact = float(row_logprobs[token])
            smallest_reported = float(torch.topk(row_logprobs, args.top_k).values[-1])
            outside = exact < smallest_reported
            by_difficulty.setdefault(row["difficulty"], []).append(
                (exact, smallest_reported if outside else exact, outside)
            )
    print(f"{args.prompts} prompts, the teacher's top-{args.top_k}; log p_t of the base's sampled tokens")
    print(f"{'difficulty':>12} {'tokens':>7} {'outside':>8} {'exact':>8} {'as carried':>11} {'exact, outside':>15} {'carried, outside':>17}")
    everything = [value for values in by_difficulty.values() for value in values]
    for name, values in [*sorted(by_difficulty.items()), ("all", everything)]:
        exact, carried, outside = (np.array(column) for column in zip(*values))
        inside_out = (f"{exact[outside].mean():15.2f} {carried[outside].mean():17.2f}" if outside.any()
                      else f"{'-':>15} {'-':>17}")
        print(f"{name:>12} {len(exact):7d} {outside.mean():8.3f} {exact.mean():8.2f} {carried.mean():11.2f} {inside_out}")


if __name__ == "__main__":
    main()
