"""q*, the base and the teacher scored on lm-eval loglikelihood tasks through one q* endpoint.

Start the endpoint, then run lm-eval's `local-completions` model three times against it:
the pair's own name (q*, alpha* per token) and "<name>@alpha=0" / "@alpha=1" (the base
alone, the teacher alone; lm-eval sends no extra body fields with loglikelihood requests, so
the model name carries the fixed alpha). Tasks: benchmarks/lm_eval_tasks/
dualvllm_arithmetic_mc (multiple choice: the reversed sum against three near misses) and
dualvllm_arithmetic_ppl (loglikelihood_rolling over each whole problem line).

    .venv/bin/dualvllm serve --lockstep &          # q* endpoint: http://127.0.0.1:8100/v1
    .venv/bin/python benchmarks/lm_eval_loglikelihood.py --url http://127.0.0.1:8100/v1 \\
        --output benchmarks/results/lm_eval_loglikelihood.json

Each arm runs `python -m lm_eval` in its own process (lm-eval's API model runs its own event
loop); prints one row per arm and writes the JSON (accuracy, perplexities, seconds).
First, `echo_error` measures the echoed values against the exact q* over the whole
vocabulary (the in-process transformers engines' full distributions; alpha* solved over all
98 tokens, as benchmarks/topk_error.py does) on --exact-lines whole problem lines: the
top-k error of q* loglikelihoods.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from dualvllm import tinymodels
from dualvllm.common import loop
from dualvllm.theory import mixture_logprobs, solve_alpha
from dualvllm.tinymodels.task import problems

REPO = Path(__file__).resolve().parents[1]
TASKS = REPO / "benchmarks" / "lm_eval_tasks"
MC_TASK, PPL_TASK = "dualvllm_arithmetic_mc", "dualvllm_arithmetic_ppl"
ARMS = {"base": "@alpha=0", "q*": "", "teacher": "@alpha=1"}  # model-name suffix of each arm
# Requests lm-eval keeps in flight: enough to fill the coordinator's batch on 2 cores.
CONCURRENT_REQUESTS = 16
RUN_TIMEOUT_S = 1800


def served_name(url: str) -> str:
    """The pair's name: the first model GET /v1/models lists."""
    with urllib.request.urlopen(f"{url}/models", timeout=30) as answer:
        return json.load(answer)["data"][0]["id"]


def run_arm(url: str, model: str, *, limit: int | None, tokenizer: str, tasks: list[str]) -> dict[str, float]:
    """One lm-eval run of `tasks` for `model` -> its metrics and wall time."""
    with tempfile.TemporaryDirectory() as out:
        command = [
            sys.executable, "-m", "lm_eval", "--model", "local-completions",
            "--model_args", f"model={model},base_url={url}/completions,tokenizer_backend=huggingface,"
                            f"tokenizer={tokenizer},num_concurrent={CONCURRENT_REQUESTS},max_retries=1",
            "--include_path", str(TASKS), "--tasks", ",".join(tasks), "--output_path", out,
            *(["--limit", str(limit)] if limit else []),
        ]
        started = time.perf_counter()
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                              env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
        seconds = time.perf_counter() - started
        if done.returncode != 0:
            raise SystemExit(f"lm_eval failed for {model}:\n{(done.stdout + done.stderr)[-3000:]}")
        results = json.loads(next(Path(out).rglob("results_*.json")).read_text())["results"]
    nan = {"acc,none": float("nan"), "acc_stderr,none": float("nan"), "word_perplexity,none": float("nan"),
           "bits_per_byte,none": float("nan")}
    mc, ppl = results.get(MC_TASK, nan), results.get(PPL_TASK, nan)
    return {"mc_accuracy": mc["acc,none"], "mc_accuracy_stderr": mc["acc_stderr,none"],
            "word_perplexity": ppl["word_perplexity,none"], "bits_per_byte": ppl["bits_per_byte,none"],
            "wall_s": seconds}


async def echo_error(url: str, model: str, lines: int) -> dict[str, Any]:
    """Echoed log q*, alpha* and fixed-alpha values of `lines` test problem lines ("AB+CD=<answer><eos>")
    against the exact q* over the whole vocabulary -> errors per position (mean, max)."""
    from transformers import AutoTokenizer

    from dualvllm.engines.transformers_engine import TransformersEngine

    tokenizer = AutoTokenizer.from_pretrained(tinymodels.BASE_DIR)
    ids = [tokenizer(p.prompt + p.answer + "<eos>", add_special_tokens=False).input_ids
           for p in problems("test", n=lines, seed=5)]
    served = {}
    async with aiohttp.ClientSession() as session:
        for arm, suffix in ARMS.items():
            body = {"model": model + suffix, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0}
            async with session.post(f"{url}/completions", json=body) as answer:
                choices = (await answer.json())["choices"]
            served[arm] = {field: np.array([v for c in choices for v in c["dualvllm"]["prompt"][field][1:]])
                           for field in ("alpha", "logprobs_q", "logprobs_theta", "logprobs_t")}
    async with TransformersEngine(tinymodels.BASE_DIR) as base, TransformersEngine(tinymodels.TEACHER_DIR) as teacher:
        contexts = [line[:j] for line in ids for j in range(1, len(line))]
        full_base, full_teacher = await base.next_token_logprobs(contexts), await teacher.next_token_logprobs(contexts)
    tokens = np.array([t for line in ids for t in line[1:]])
    rows = np.arange(len(tokens))
    alpha = solve_alpha(full_base, full_teacher, tol=1e-10, max_iter=100)  # [R], over the whole vocabulary
    want_logq = mixture_logprobs(full_base, full_teacher, alpha, np.ones(full_base.shape, bool))[rows, tokens]
    q_star, errors = served["q*"], {}
    for name, got, want in (
            ("alpha", q_star["alpha"], alpha),
            ("q", np.exp(q_star["logprobs_q"]), np.exp(want_logq)),  # |q*(y) - exact q*(y)|, probabilities
            ("log_q", q_star["logprobs_q"], want_logq),
            ("base_q", np.exp(served["base"]["logprobs_q"]), np.exp(full_base[rows, tokens])),
            ("teacher_q", np.exp(served["teacher"]["logprobs_q"]), np.exp(full_teacher[rows, tokens])),
            ("raw_logprob_theta", q_star["logprobs_theta"], full_base[rows, tokens]),
            ("raw_logprob_t", q_star["logprobs_t"], full_teacher[rows, tokens])):
        gap = np.abs(got - want)
        errors[name] = {"mean": float(gap.mean()), "max": float(gap.max())}
    return {"lines": lines, "positions": int(len(tokens)),
            "fixed_alpha_values": sorted({*served["base"]["alpha"].tolist(), *served["teacher"]["alpha"].tolist()}),
            "errors": errors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8100/v1", help="the q* endpoint's /v1 URL")
    parser.add_argument("--model", default=None, help="the pair's served name; default: the first GET /v1/models lists")
    parser.add_argument("--limit", type=int, default=None, help="problems per task (default: all 484)")
    parser.add_argument("--tokenizer", default=str(tinymodels.BASE_DIR),
                        help="the models' tokenizer, for lm-eval's context lengths (default: the bundled base's)")
    parser.add_argument("--exact-lines", type=int, default=64,
                        help="problem lines whose echoed values are compared with the exact q* (0 = skip)")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    parser.add_argument("--tasks", nargs="+", choices=[MC_TASK, PPL_TASK], default=[MC_TASK, PPL_TASK],
                        help="the tasks of each arm's lm-eval run (the wall time covers these only)")
    parser.add_argument("--output", type=Path, default=None, help="write the results here as JSON")
    args = parser.parse_args()
    name = args.model or served_name(args.url)
    exact = None
    if args.exact_lines:
        exact = loop.run(echo_error(args.url, name, args.exact_lines))
        print(f"echo against the exact q* ({exact['positions']} positions): "
              + ", ".join(f"|{k}| mean {v['mean']:.2e} max {v['max']:.2e}" for k, v in exact["errors"].items()))
    rows = {}
    print(f"{'arm':<8} {'model':<28} {'mc acc':>8} {'word ppl':>9} {'bits/byte':>9} {'wall s':>7}")
    for arm in args.arms:
        suffix = ARMS[arm]
        row = rows[arm] = {"model": name + suffix, **run_arm(args.url, name + suffix, limit=args.limit,
                                                              tokenizer=args.tokenizer, tasks=args.tasks)}
        print(f"{arm:<8} {row['model']:<28} {row['mc_accuracy']:>8.4f} {row['word_perplexity']:>9.4f} "
              f"{row['bits_per_byte']:>9.4f} {row['wall_s']:>7.1f}", flush=True)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({"url": args.url, "limit": args.limit, "tasks": args.tasks, "exact": exact,
                                           "arms": rows},
                                          indent=2))


if __name__ == "__main__":
    main()
