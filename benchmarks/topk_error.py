"""What the top-k approximation costs: alpha*, KLs, ESS ratio and q* from top-k lists
against the exact full-vocabulary computation.

    python benchmarks/topk_error.py                      # ~2 minutes on 2 CPU cores
    python benchmarks/topk_error.py --ks 1 5 10 20 50 100 --contexts 400

Two sources of real next-token distribution pairs (base, teacher):
- "tiny": the bundled models (vocabulary 98) at many prompts and positions (inside the
  prompt, after "=", inside the teacher's answer), computed by the in-process engine;
- "large-related": a random-initialized Qwen2 model with a 32,000-token vocabulary at
  random contexts, its output layer scaled so next-token entropies are in the range
  real LMs have (the mean is printed; at the default init they are almost uniform),
  and as teacher a perturbed copy of it (related models, as a fine-tuned teacher is);
- "large-independent": the same base and an independent random teacher: two models
  that disagree everywhere, the worst case for any top-k scheme.

For each k and each missing-token rule of `dualvllm.theory.merge` the top-k lists of both models
are merged exactly as the coordinator does, and compared with the exact values:
|alpha*_topk - alpha*_exact|, |KL_topk - KL_exact| for both KLs, |log ESS ratio error| and
the total variation between the top-k q* (zero outside the candidate set) and exact q*.
Prints a table, writes JSON (units in the keys) and a plot of mean |alpha error| against k.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from dualvllm import tinymodels
from dualvllm.common import loop
from dualvllm.theory import FILL_RULES, merge_topk, mixture_logprobs, solve_alpha, token_diagnostics
from dualvllm.theory.alpha import alpha_kls
from dualvllm.tinymodels.task import problems

LARGE_VOCAB = 32_000
# Output-layer scale for the random model: mean next-token entropy ~2-3 nats, like real LMs.
LARGE_LOGIT_SCALE = 40.0
# Teacher = base + this many weight standard deviations of noise: KL(base || teacher) ~1 nat
# per token, the order of a base model against a stronger teacher of its family.
RELATED_NOISE = 0.1


def tiny_pairs(n_contexts: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Full next-token logprobs [N, 98] of the bundled base and teacher at varied positions."""
    from dualvllm.engines.transformers_engine import TransformersEngine

    async def collect() -> tuple[np.ndarray, np.ndarray]:
        async with TransformersEngine(tinymodels.BASE_DIR) as base, TransformersEngine(tinymodels.TEACHER_DIR) as teacher:
            contexts: list[list[int]] = []
            for p in problems("test", seed=seed):
                text = p.prompt + p.answer
                cut = int(np.random.default_rng([seed, p.a, p.b]).integers(1, len(text) + 1))
                contexts.append(await base.tokenize(text[:cut]))
                if len(contexts) == n_contexts:
                    break
            return await base.next_token_logprobs(contexts), await teacher.next_token_logprobs(contexts)

    return loop.run(collect())


def large_pairs(n_contexts: int, seed: int, relative_noise: float | None) -> tuple[np.ndarray, np.ndarray]:
    """Full next-token logprobs [N, 32000] of two random Qwen2 models at random contexts.

    relative_noise: the teacher is the base with every weight tensor perturbed by
    Gaussian noise of this many standard deviations (a related model, as a fine-tuned
    teacher is); None: the teacher is an independent random model (the worst case).
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=LARGE_VOCAB, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=32, tie_word_embeddings=False)
    contexts = torch.from_numpy(np.random.default_rng(seed).integers(0, LARGE_VOCAB, (n_contexts, 12)))
    torch.manual_seed(seed + 1)
    base = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        base.lm_head.weight.mul_(LARGE_LOGIT_SCALE)
    torch.manual_seed(seed + 2)
    teacher = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        teacher.lm_head.weight.mul_(LARGE_LOGIT_SCALE)
        if relative_noise is not None:
            for mine, theirs in zip(teacher.parameters(), base.parameters()):
                mine.copy_(theirs + relative_noise * theirs.std() * torch.randn_like(theirs))
    out = []
    for model in (base, teacher):
        with torch.no_grad():
            out.append(torch.log_softmax(model(contexts).logits[:, -1].double(), dim=-1).numpy())
    return out[0], out[1]


def top_k(logp: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """What a server reports: the k most likely ids and their logprobs per row."""
    ids = np.argpartition(-logp, k - 1, axis=1)[:, :k]
    return ids, np.take_along_axis(logp, ids, axis=1)


def exact_values(lp: np.ndarray, lr: np.ndarray) -> dict[str, np.ndarray]:
    mask = np.ones(lp.shape, bool)
    alpha = solve_alpha(lp, lr, tol=1e-10, max_iter=100)
    logq = mixture_logprobs(lp, lr, alpha, mask)
    diag = token_diagnostics(lp, lr, logq, mask, np.ones(len(lp)), np.ones(len(lp)))
    return {"alpha": alpha, "logq": logq, "kl_theta": diag["kl_theta"], "kl_t": diag["kl_t"],
            "ess_ratio": diag["ess_ratio"], "entropy_theta": -np.sum(np.exp(lp) * lp, axis=1),
            "kl_base_teacher": np.sum(np.exp(lp) * (lp - lr), axis=1)}


def approx_errors(lp: np.ndarray, lr: np.ndarray, exact: dict[str, np.ndarray], k: int, rule: str) -> dict[str, float]:
    merged = merge_topk(*top_k(lp, k), *top_k(lr, k), fill=rule, vocab_size=lp.shape[1])
    mask = merged.mask
    alpha = solve_alpha(merged.logp_theta, merged.logp_t, mask)
    kl_theta, kl_t = alpha_kls(merged.logp_theta, merged.logp_t, alpha, mask)
    logq = mixture_logprobs(merged.logp_theta, merged.logp_t, alpha, mask)
    diag = token_diagnostics(merged.logp_theta, merged.logp_t, logq, mask, merged.coverage_theta, merged.coverage_t)
    rows = np.arange(len(lp))[:, None]
    ids = np.where(mask, merged.token_ids, 0)
    q_exact_on_set = np.where(mask, np.exp(exact["logq"][rows, ids]), 0.0)
    q_topk = np.where(mask, np.exp(np.where(mask, logq, -np.inf)), 0.0)
    # TV = half the L1 distance; exact q* mass outside the candidate set counts fully.
    tv = 0.5 * (np.abs(q_topk - q_exact_on_set).sum(axis=1) + (1.0 - q_exact_on_set.sum(axis=1)))
    alpha_err = np.abs(alpha - exact["alpha"])
    return {
        "alpha_abs_err_mean": float(alpha_err.mean()),
        "alpha_abs_err_p95": float(np.percentile(alpha_err, 95)),
        "kl_theta_abs_err_mean_nats": float(np.abs(kl_theta - exact["kl_theta"]).mean()),
        "kl_t_abs_err_mean_nats": float(np.abs(kl_t - exact["kl_t"]).mean()),
        # ESS ratios span many orders of magnitude: compare them in log space.
        "log_ess_ratio_abs_err_mean": float(np.abs(np.log(diag["ess_ratio"]) - np.log(exact["ess_ratio"])).mean()),
        "tv_mean": float(tv.mean()),
        "coverage_theta_mean": float(merged.coverage_theta.mean()),
        "coverage_t_mean": float(merged.coverage_t.mean()),
    }


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sources = list(results["sources"])
    fig, axes = plt.subplots(1, len(sources), figsize=(5 * len(sources), 4), squeeze=False)
    for ax, source in zip(axes[0], sources):
        rows = results["sources"][source]["rows"]
        for rule in FILL_RULES:
            mine = [r for r in rows if r["rule"] == rule]
            ax.plot([r["k"] for r in mine], [max(r["alpha_abs_err_mean"], 1e-7) for r in mine], marker="o", label=rule)
        ax.axhline(0.01, color="grey", linestyle=":", linewidth=1)
        ax.set(xscale="log", yscale="log", xlabel="k (top-k per model)", ylabel="mean |alpha* top-k - exact|",
               title=f"{source} (vocab {results['sources'][source]['vocab_size']})")
        ax.legend(title="missing-token rule")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 5, 10, 20, 50, 100])
    parser.add_argument("--contexts", type=int, default=400, help="distribution pairs per source")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/topk_error.json"))
    args = parser.parse_args()
    results: dict = {"command": "python benchmarks/topk_error.py " + " ".join(
        f"--ks {' '.join(map(str, args.ks))} --contexts {args.contexts} --seed {args.seed}".split()),
        "sources": {}}
    sources = (("tiny", tiny_pairs),
               ("large-related", lambda n, seed: large_pairs(n, seed, relative_noise=RELATED_NOISE)),
               ("large-independent", lambda n, seed: large_pairs(n, seed, relative_noise=None)))
    for source, collect in sources:
        started = time.perf_counter()
        lp, lr = collect(args.contexts, args.seed)
        exact = exact_values(lp, lr)
        rows = []
        for k in args.ks:
            if k > lp.shape[1]:
                continue
            for rule in FILL_RULES:
                rows.append({"k": k, "rule": rule, **approx_errors(lp, lr, exact, k, rule)})
        results["sources"][source] = {
            "vocab_size": lp.shape[1], "contexts": len(lp), "rows": rows,
            "exact_alpha_mean": float(exact["alpha"].mean()),
            "entropy_theta_mean_nats": float(exact["entropy_theta"].mean()),
            "kl_base_teacher_mean_nats": float(exact["kl_base_teacher"].mean()),
            "seconds": round(time.perf_counter() - started, 1),
        }
        print(f"\n{source}: {len(lp)} contexts, vocabulary {lp.shape[1]}, exact alpha* mean "
              f"{exact['alpha'].mean():.3f}, base entropy mean {exact['entropy_theta'].mean():.2f} nats, "
              f"KL(base || teacher) mean {exact['kl_base_teacher'].mean():.2f} nats")
        print(f"{'k':>5} {'rule':>7} {'|d alpha| mean':>15} {'p95':>8} {'|d KL_theta|':>13} {'|d KL_t|':>9} "
              f"{'|d log ESS r|':>14} {'TV(q)':>8} {'cover theta':>12} {'cover t':>8}")
        for r in rows:
            print(f"{r['k']:>5} {r['rule']:>7} {r['alpha_abs_err_mean']:>15.5f} {r['alpha_abs_err_p95']:>8.4f} "
                  f"{r['kl_theta_abs_err_mean_nats']:>13.5f} {r['kl_t_abs_err_mean_nats']:>9.5f} "
                  f"{r['log_ess_ratio_abs_err_mean']:>14.4f} {r['tv_mean']:>8.5f} {r['coverage_theta_mean']:>12.4f} "
                  f"{r['coverage_t_mean']:>8.4f}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    figure = args.output.with_suffix(".png")
    plot(results, figure)
    print(f"\nwrote {args.output} and {figure}")


if __name__ == "__main__":
    main()
