"""The GPU check (issue 55): the realistic-shape pairs, q* on the device, one learner update at Qwen3-0.6B's shape.

    bash scripts/gpu_check.sh                                 # one GPU; torch, transformers, accelerate, peft; no vLLM
    bash scripts/gpu_check.sh --device cpu                    # the smoke test CI runs (about a minute on 2 cores)
    python benchmarks/gpu_check.py --device cuda --output benchmarks/results/gpu_check.json

It imports no vLLM (run as a script, `vllm` is blocked in sys.modules before any dualvllm
module is imported, so a module that imports it fails its check here as it would on a machine
without it) and reaches no network: the pairs are built from the repository (dualvllm.tinymodels.shapes). Checks:

- pairs: `ensure_pair("small")` and `ensure_pair("qwen3-0.6b")` (Qwen3-0.6B's config, untied, as
  `dualvllm train` takes it), built offline once and cached (`--device cpu`: the small one only).
- q_star/<shape>: the in-process engines on the device (TransformersEngine, float32, KV cache)
  give both models' whole next-token distributions after each of `--q-prompts` prompts, for
  `--q-tokens` steps; dualvllm.theory's alpha* and q* from them (the coordinator's per-token
  math, over every token: its top-k is bounded at 1,000) are compared with exact q* from both
  models run in float64 on the same device (tests/exact_q.py: Brent's method, independent of
  dualvllm.theory). Passes when the largest errors of alpha* and of log q* (tokens with exact
  q* above LIKELY) are within Q_STAR_TOLERANCE.
- learner_update: one `Learner.train_step` of the distillation update (`--method distill`'s:
  forward KL to the teacher's top-20 with the tail bucket) on 64 rollouts of 128 prompt + 1,024
  completion tokens, random (benchmarks/learner_memory.py's batch; SIZES), after a warm-up update
  of 2 rollouts of 8 + 8: the qwen3-0.6b base in float32 master weights, bf16 autocast,
  micro-batches of 8 rollouts with gradient checkpointing. Passes when the
  loss and the gradient norm are finite and the weights moved. Peak GPU memory is
  torch.cuda.max_memory_allocated over the measured update (GiB); tokens/s counts its
  completion tokens over its wall time (the device synchronized).

Besides torch, transformers, accelerate and peft it needs dualvllm's own dependencies (pyproject.toml's
`dependencies`, no extra): it names the missing ones and exits with 2 before any check. Of those,
the GPU machines lent to this project (/work/.library/device/KINDS.md's package list) lack
pydantic, pydantic-core, pydantic-settings, annotated-types, typing-inspection, python-dotenv and
msgspec: carry them as wheels for their Python (3.12), as that README says.

`--device cpu` runs the same code at a smoke size (the small pair, 4 rollouts of 16 + 32 tokens,
float32). Writes one JSON (units in the keys) and prints it; the exit code is 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import json
import math
import platform
import resource
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `benchmarks` and `tests` are not installed packages

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.learner_memory import objective_for, synthetic_batch  # noqa: E402
from tests.exact_q import exact_q_star  # noqa: E402

# float32 engines against a float64 reference: log q* of a sampled token within 1e-3 nats and
# alpha* within 1e-3 (the engine's top-k logprobs are within ~1e-6 of float64 on the same logits,
# tests/unit/engines/test_transformers.py; the rest is float32 against float64 matmuls).
Q_STAR_TOLERANCE = 1e-3
# What the checks import besides the standard library (dualvllm's own dependencies among them).
REQUIRED_MODULES = (
    "numpy",
    "scipy",
    "numba",
    "aiohttp",
    "msgspec",
    "pydantic",
    "pydantic_settings",
    "transformers",
    "tokenizers",
    "safetensors",
)
# log q* is compared where exact q* is above this; the rest of the vocabulary by |q* - exact|.
LIKELY = 1e-6
GIB = 2**30
PROMPTS = (
    "The base model and the teacher share one tokenizer, so their token ids can be mixed.",
    "def add(a: int, b: int) -> int:\n    return a + b\n",
    "Le café de la gare est très bon. 数学は楽しい。",
    "| arm | accuracy | tokens/s |\n|-----|----------|----------|\n",
)
# (pairs built, the learner's shape, rollouts, prompt tokens, completion tokens, micro-batch, autocast)
SIZES = {
    "cuda": (("small", "qwen3-0.6b"), "qwen3-0.6b", 64, 128, 1024, 8, "bf16"),
    "cpu": (("small",), "small", 4, 16, 32, None, "no"),
}


def build_pairs(shapes: tuple[str, ...]) -> tuple[dict[str, tuple[Path, Path]], dict[str, Any]]:
    from dualvllm.tinymodels.shapes import ensure_pair

    started = time.perf_counter()
    pairs = {shape: ensure_pair(shape) for shape in shapes}
    report = {"passed": True, "shapes": list(shapes), "wall_s": time.perf_counter() - started}
    return pairs, report


async def q_star_check(base: Path, teacher: Path, device: torch.device, prompts: int, tokens: int) -> dict[str, Any]:
    """q* from the in-process engines' full distributions on `device` against exact float64 q*.

    At each of `tokens` steps the two engines (float32, KV cache) give every context's whole
    next-token distribution, and dualvllm.theory turns them into alpha* (solve_alpha) and q*
    (mixture_logprobs), as the coordinator's per-token step does over its candidates; the
    reference runs both models in float64 on the same device and solves with Brent's method
    (tests/exact_q.py). Each context then takes a token drawn from the reference q*.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dualvllm.engines.transformers_engine import TransformersEngine
    from dualvllm.theory.alpha import solve_alpha
    from dualvllm.theory.mixture import mixture_logprobs

    tokenizer = AutoTokenizer.from_pretrained(base)
    contexts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in (PROMPTS * prompts)[:prompts]]
    references = [
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).to(device).eval() for path in (base, teacher)
    ]
    rng = np.random.default_rng(0)
    alpha_errors, logprob_errors, prob_errors = [], [], []
    engine_s = 0.0
    async with (
        TransformersEngine(base, name="theta", device=device.type) as theta,
        TransformersEngine(teacher, name="t", device=device.type) as t,
    ):
        for _ in range(tokens):
            started = time.perf_counter()
            lp, lr = await theta.next_token_logprobs(contexts), await t.next_token_logprobs(contexts)  # [B, V]
            alpha = solve_alpha(lp, lr)  # [B]
            logq = mixture_logprobs(lp, lr, alpha)  # [B, V]
            engine_s += time.perf_counter() - started
            grown = []
            for row, context in enumerate(contexts):
                ids = torch.tensor([context], device=device)
                with torch.no_grad():
                    exact = [torch.log_softmax(m(ids).logits[0, -1], dim=-1).cpu().numpy() for m in references]
                q, exact_alpha = exact_q_star(*exact)
                likely = q > LIKELY
                alpha_errors.append(abs(float(alpha[row]) - exact_alpha))
                logprob_errors.append(float(np.max(np.abs(logq[row, likely] - np.log(q[likely])))))
                prob_errors.append(float(np.max(np.abs(np.exp(logq[row]) - q))))
                grown.append([*context, int(rng.choice(q.shape[0], p=q / q.sum()))])
            contexts = grown
    largest = (max(logprob_errors), max(alpha_errors))
    return {
        "passed": max(largest) <= Q_STAR_TOLERANCE,
        "base": str(base),
        "vocab_size": int(q.shape[0]),
        "states": len(alpha_errors),
        "max_abs_logprob_q_error_nats": largest[0],
        "max_abs_alpha_error": largest[1],
        "max_abs_q_error": max(prob_errors),
        "tolerance": Q_STAR_TOLERANCE,
        "logprob_error_over": f"tokens with exact q* > {LIKELY:g}",
        "engine_and_theory_wall_s": engine_s,
    }


def learner_update(
    base: Path,
    device: torch.device,
    precision: str,
    rollouts: int,
    prompt_tokens: int,
    completion_tokens: int,
    micro_batch: int | None,
) -> dict[str, Any]:
    """One distillation update of the base in float32 master weights on `device`, autocast to `precision`."""
    from transformers import AutoModelForCausalLM

    from dualvllm.training import device as devices
    from dualvllm.training.learner import Learner

    gc.collect()  # the q* check's models are gone before the update is measured
    if device.type == "cuda":
        torch.cuda.empty_cache()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).to(device)
    dtype = devices.autocast_dtype(device, precision)  # type: ignore[arg-type]
    learner = Learner(
        model,
        learning_rate=1e-6,
        kl_coef=0.0,
        pad_id=0,
        micro_batch_size=micro_batch,
        gradient_checkpointing=micro_batch is not None,
        autocast_dtype=dtype,
    )
    objective = objective_for("distill")

    def step(batch: Any) -> dict[str, float]:
        return learner.train_step(batch, objective)

    step(synthetic_batch(2, 2, 8, 8, seed=1))  # warm-up: AdamW's moments exist, kernels are loaded
    batch = synthetic_batch(rollouts, 1, prompt_tokens, completion_tokens, seed=2)
    before = [p.detach().clone() for p in list(model.parameters())[:4]]
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    held = torch.cuda.memory_allocated(device) / GIB if cuda else None
    started = time.perf_counter()
    metrics = step(batch)
    if cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    moved = any(not torch.equal(b, p.detach()) for b, p in zip(before, list(model.parameters())[:4]))
    finite = all(math.isfinite(float(metrics[key])) for key in ("loss", "grad_norm") if key in metrics)
    return {
        "passed": finite and moved,
        "base": str(base),
        "parameters": sum(p.numel() for p in model.parameters()),
        "update": "distill (forward KL, teacher top-20 + tail)",
        "rollouts": rollouts,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "micro_batch_size": micro_batch,
        "gradient_checkpointing": micro_batch is not None,
        "autocast_dtype": None if dtype is None else str(dtype).removeprefix("torch."),
        "loss": float(metrics["loss"]),
        "grad_norm": float(metrics.get("grad_norm", float("nan"))),
        "weights_moved": moved,
        "update_wall_s": seconds,
        "train_tokens": int(metrics["train_tokens"]),
        "train_tokens_per_s": metrics["train_tokens"] / seconds,
        "gpu_memory_before_update_gib": held,
        "peak_gpu_memory_gib": torch.cuda.max_memory_allocated(device) / GIB if cuda else None,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB,
    }


def run_check(name: str, report: dict[str, Any], check: Any) -> Any:
    """`check()`'s result, or its failure recorded under `name` (a check that raises has failed)."""
    print(f"gpu_check: {name} ...", file=sys.stderr, flush=True)
    try:
        result = check()
    except Exception as exc:  # noqa: BLE001 - every failure is the check's result, written to the JSON
        report["checks"][name] = {"passed": False, "error": f"{type(exc).__name__}: {exc}"}
        return None
    report["checks"][name] = result[1] if isinstance(result, tuple) else result
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the smoke test")
    parser.add_argument("--output", type=Path, default=REPO / "benchmarks" / "results" / "gpu_check.json")
    parser.add_argument("--q-prompts", type=int, default=4)
    parser.add_argument("--q-tokens", type=int, default=8)
    args = parser.parse_args(argv)
    if missing := [name for name in REQUIRED_MODULES if importlib.util.find_spec(name) is None]:
        print(
            f"gpu_check: missing Python packages: {', '.join(missing)}; install dualvllm's dependencies "
            "(pip install -e . from the repository's root, no extra) or carry their wheels",
            file=sys.stderr,
        )
        return 2
    shapes, learner_shape, rollouts, prompt_tokens, completion_tokens, micro_batch, precision = SIZES[args.device]
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device cuda: torch {torch.__version__} sees no GPU; --device cpu runs the smoke test")
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    started = time.perf_counter()
    report: dict[str, Any] = {
        "device": str(device),
        "gpu_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "python_version": platform.python_version(),
        "checks": {},
    }
    built = run_check("pairs", report, lambda: build_pairs(shapes))
    pairs = built[0] if built else {}
    for shape, (base, teacher) in pairs.items():
        run_check(
            f"q_star/{shape}",
            report,
            lambda base=base, teacher=teacher: asyncio.run(
                q_star_check(base, teacher, device, args.q_prompts, args.q_tokens)
            ),
        )
    if learner_shape in pairs:
        run_check(
            "learner_update",
            report,
            lambda: learner_update(
                pairs[learner_shape][0], device, precision, rollouts, prompt_tokens, completion_tokens, micro_batch
            ),
        )
    else:
        report["checks"]["learner_update"] = {"passed": False, "error": f"the {learner_shape} pair was not built"}
    update = report["checks"]["learner_update"]
    report["peak_gpu_memory_gib"] = update.get("peak_gpu_memory_gib")
    report["train_tokens_per_s"] = update.get("train_tokens_per_s")
    report["vllm_imported"] = sys.modules.get("vllm") is not None
    report["passed"] = all(c["passed"] for c in report["checks"].values()) and not report["vllm_imported"]
    report["wall_s"] = time.perf_counter() - started
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    print(f"gpu_check: {'passed' if report['passed'] else 'FAILED'}; {args.output}", file=sys.stderr)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    # Before any dualvllm module is imported (they are, inside the checks): the machines this
    # check is for have no vLLM, so an import of it must fail here too.
    sys.modules["vllm"] = None  # type: ignore[assignment]
    sys.exit(main())
