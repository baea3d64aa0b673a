"""One q*-GRPO arm run two ways on the bundled arithmetic task: through TRL and through `dualvllm train`.

    python benchmarks/trl_compare.py --seeds 0 1 2 3 4 5 --steps 150 --eval-every 25     # docs/trl.md's table
    python benchmarks/trl_compare.py --arms dualvllm --max-staleness 0 --seeds 0 1 2   # no stale rollouts

- **dualvllm train**: dualvllm.training.grpo.train_grpo with `--engine transformers`.
- **TRL**: TRL 1.16's GRPOTrainer as dualvllm.training.trl_trainer.QStarGRPOTrainer, its rollouts from
  dualvllm.training.trl_rollouts.QStarRollouts.

Both in process, as `--engine transformers` runs (training/inprocess.py): the base role is a
TransformersEngine over the model being trained (no push), the bundled teacher beside it, the
coordinator in per-token mode. Same seed, 8 prompts x 8 rollouts per update, learning rate,
correction, dapo normalization with group-std scaling, 6 tokens at temperature 1, top-k 20,
AdamW with torch's defaults (weight decay 0.01; TRL's own default is 0) at a constant rate,
gradient norm clipped at 1, float32. Both are evaluated by dualvllm.training.recipe.held_out (greedy
accuracy of the base alone) on the same held-out problems, chosen by the seed.

Both take the same 8 prompts at every update (TRL's sampler unshuffled over dualvllm train's
seeded order; `--trl-shuffles` lets it draw its own). What differs by construction: `dualvllm
train` samples the next batch while it learns (a batch may come from the weights one update
old; `--max-staleness 0` drops those), and the two arms draw their rollouts' random numbers
differently.

Prints the rollouts' mean reward (averaged over windows of --eval-every updates), the
held-out accuracy per arm and seed, and TRL's accuracy minus dualvllm train's per seed;
writes OUTPUT/trl_compare.json (accuracies as fractions, differences in points, wall_s; for TRL each
update's and evaluation's seconds, update_s and eval_s, and its log history). benchmarks/trl_settings.py runs TRL's own
importance-sampling settings through the same run_trl.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from dualvllm import tinymodels
from dualvllm.common import loop
from dualvllm.training.config import TRAIN_OPTIONS, GRPOTrainConfig, TrainConfig
from dualvllm.training.config_sources import read_recipe

ARMS = {"dualvllm": "dualvllm train", "trl": "TRL"}  # folder -> name
PROMPTS_PER_STEP, GROUP_SIZE = 8, 8
# The bundled models' recipe: the values `dualvllm train` took by default before its defaults became a real LLM's.
RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny-arith.yaml"


def train_config(out: Path, seed: int, args: argparse.Namespace, **fields: Any) -> TrainConfig:
    """The run's `dualvllm train` options: the recipe's, the budget in `args` (steps, eval_every, eval_prompts,
    learning_rate), and `fields` (the correction, a task's dataset, teacher, max_tokens, ...)."""
    return TrainConfig.parse(config_file=RECIPE, output_dir=out, engine="transformers", seed=seed, steps=args.steps,
                             eval_every=args.eval_every, eval_prompts=args.eval_prompts,
                             prompts_per_step=PROMPTS_PER_STEP, group_size=GROUP_SIZE,
                             learning_rate=args.learning_rate, **fields)


def run_dualvllm(config: TrainConfig) -> dict[str, Any]:
    from dualvllm.training.grpo import train_grpo

    loop.run(train_grpo(config, show_progress=False))
    records = [json.loads(line) for line in (config.output_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward_mean"] for r in records if "reward_mean" in r]
    accuracy = {r["step"]: r["held_out_accuracy"] for r in records if "held_out_accuracy" in r}
    return {"reward_mean": rewards, "held_out_accuracy": accuracy}


# GRPOConfig's options for the run -> (the GRPOTrainer class to run, its args): what a TRL arm trains with.
TrainerChoice = Callable[[dict[str, Any]], tuple[type, Any]]
# (the model being trained, its tokenizer) -> more held-out measurements, by name (a task's answer log-probability).
Probe = Callable[[Any, Any], dict[str, float]]


def qstar_trainer(correction: str) -> TrainerChoice:
    """QStarGRPOTrainer with this project's `correction` (the TRL arm of the comparison above)."""

    def choose(options: dict[str, Any]) -> tuple[type, Any]:
        from dualvllm.training.trl_trainer import QStarGRPOConfig, QStarGRPOTrainer

        return QStarGRPOTrainer, QStarGRPOConfig(**options, correction=correction)

    return choose


def run_trl(config: GRPOTrainConfig, *, shuffle: bool = False, trainer: TrainerChoice | None = None,
            probe: Probe | None = None) -> dict[str, Any]:
    """One TRL run of `config` in process: its held-out accuracy (and `probe`'s measurements) at every
    evaluation and the evaluation's seconds (eval_s), the rollouts' mean reward, each update's seconds
    (update_s: rollouts, loss and step, evaluations left out) and TRL's log history. `trainer` picks the
    trainer (default QStarGRPOTrainer with `config.correction`)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback

    from dualvllm.coordinator import CoordinatorConfig
    from dualvllm.engines.transformers_engine import TransformersEngine
    from dualvllm.training.recipe import held_out, prepare
    from dualvllm.training.rewards import reward_exact
    from dualvllm.training.trl_rollouts import QStarRollouts
    from dualvllm.training.verifiers import verifier_pool

    inputs = prepare(config)
    torch.manual_seed(config.seed)
    model = AutoModelForCausalLM.from_pretrained(inputs.base_dir, dtype=torch.float32)
    base = TransformersEngine.live(model, inputs.tokenizer, name="theta")
    teacher = TransformersEngine(config.teacher or tinymodels.TEACHER_DIR, name="t")
    rows = Dataset.from_list([{"prompt": t.prompt_text, "answer": t.row["answer"]} for t in inputs.problems.train])
    trainer_class, args = (trainer or qstar_trainer(config.correction))(dict(
        output_dir=str(config.output_dir), per_device_train_batch_size=PROMPTS_PER_STEP * GROUP_SIZE,
        num_generations=GROUP_SIZE, max_completion_length=config.max_tokens, max_steps=config.steps,
        learning_rate=config.learning_rate, lr_scheduler_type="constant", weight_decay=0.01, max_grad_norm=1.0,
        loss_type=config.normalization, scale_rewards="group", beta=0.0,
        temperature=config.temperature, seed=config.seed, use_cpu=True, bf16=False, logging_steps=1,
        save_strategy="no", report_to=[], disable_tqdm=True,
        gradient_checkpointing=False,  # TRL turns it on, and with it the model's KV cache off, which the engine reads
        # The rows are in dualvllm train's order (problems.train, shuffled by the seed), which it takes 8 at a time:
        # unshuffled, TRL's sampler hands both arms the same prompts at every update.
        shuffle_dataset=shuffle))
    coordinator = CoordinatorConfig(top_k=config.top_k, mode="per_token", seed=config.seed,
                                    max_batch_size=PROMPTS_PER_STEP * GROUP_SIZE)
    evaluations: dict[str, dict[int, float]] = {"held_out_accuracy": {}, "eval_s": {}}
    update_s: list[float] = []
    with verifier_pool() as pool, QStarRollouts(coordinator, theta_engine=base, t_engine=teacher,
                                                seed=config.seed) as rollouts:

        def evaluate(step: int) -> None:
            started = time.perf_counter()
            scores = rollouts.run(held_out(rollouts.coordinator, config, inputs.problems, pool), timeout_s=None,
                                  what="the held-out evaluation")
            evaluations["held_out_accuracy"][step] = scores["held_out_accuracy"]
            for name, value in (probe(model, inputs.tokenizer) if probe else {}).items():
                evaluations.setdefault(name, {})[step] = value
            evaluations["eval_s"][step] = time.perf_counter() - started

        class InProcessSync(TrainerCallback):
            """The in-process counterpart of a weight push: drop the base engine's cached keys and values,
            computed with the weights before this update, and evaluate on dualvllm train's schedule."""

            since = 0.0  # when the update being timed began: training began, or the last one's bookkeeping ended

            def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                self.since = time.perf_counter()

            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                rollouts.run(_drop_cache(base), timeout_s=None, what="dropping the base engine's cache")
                update_s.append(time.perf_counter() - self.since)
                if state.global_step % config.eval_every == 0 or state.global_step == config.steps:
                    evaluate(state.global_step)
                self.since = time.perf_counter()

        sampled: list[list[str]] = []  # the prompts of each update, in order (TRL repeats each GROUP_SIZE times)

        def rollout(prompts: list[str], grpo: Any) -> dict[str, list]:
            sampled.append(prompts[::GROUP_SIZE])
            return rollouts(prompts, grpo)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TRL warns that rollout_func is experimental
            grpo = trainer_class(model=model, reward_funcs=reward_exact, args=args, train_dataset=rows,
                                 processing_class=inputs.tokenizer, rollout_func=rollout, callbacks=[InProcessSync()])
        evaluate(0)
        grpo.train()
    if not shuffle:
        texts = [t.prompt_text for t in inputs.problems.train]
        expected = [texts[PROMPTS_PER_STEP * k:PROMPTS_PER_STEP * (k + 1)] for k in range(len(sampled))]
        assert sampled == expected, "TRL's unshuffled sampler did not hand out dualvllm train's prompts in its order"
    rewards = [e["reward"] for e in grpo.state.log_history if "reward" in e]
    return {"reward_mean": rewards, **evaluations, "update_s": update_s, "log_history": grpo.state.log_history}


async def _drop_cache(engine: Any) -> None:
    async with engine.updating():
        pass


def paired_differences(results: dict[str, dict[str, Any]]) -> dict[int, list[float]]:
    """update -> TRL's held-out accuracy minus dualvllm train's, in points, one per seed both arms ran."""
    ours, trl = results[ARMS["dualvllm"]], results[ARMS["trl"]]
    diffs: dict[int, list[float]] = {}
    for seed in sorted(ours.keys() & trl.keys(), key=int):
        for step, accuracy in trl[seed]["held_out_accuracy"].items():
            if step in ours[seed]["held_out_accuracy"]:
                diffs.setdefault(int(step), []).append(100 * (accuracy - ours[seed]["held_out_accuracy"][step]))
    return dict(sorted(diffs.items()))


def windows(values: list[float], width: int) -> list[float]:
    return [float(np.mean(values[i:i + width])) for i in range(0, len(values), width)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4, 5])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--eval-prompts", type=int, default=200)
    parser.add_argument("--learning-rate", type=float, default=read_recipe(RECIPE, TRAIN_OPTIONS)["learning_rate"])
    parser.add_argument("--correction", default="sequence", choices=("none", "sequence", "token", "vespo"))
    parser.add_argument("--max-staleness", type=int, default=GRPOTrainConfig.model_fields["max_staleness"].default,
                        help="dualvllm train's --max-staleness (0: every batch sampled from the current weights, "
                             "as TRL's are; a batch sampled during an update is dropped, and its prompts with it).")
    parser.add_argument("--arms", nargs="+", choices=tuple(ARMS), default=list(ARMS))
    parser.add_argument("--trl-shuffles", action="store_true",
                        help="Let TRL's sampler draw prompts in its own shuffled order instead of dualvllm train's.")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/trl_compare"))
    args = parser.parse_args()
    runs = {"dualvllm": run_dualvllm, "trl": functools.partial(run_trl, shuffle=args.trl_shuffles)}
    arms = [ARMS[folder] for folder in args.arms]
    results: dict[str, dict[str, Any]] = {arm: {} for arm in arms}
    for seed in args.seeds:
        for folder in args.arms:
            arm, run = ARMS[folder], runs[folder]
            out = args.output / f"seed-{seed}" / folder
            if out.exists():
                raise SystemExit(f"{out} exists; remove it or choose another --output")
            started = time.perf_counter()
            result = run(train_config(out, seed, args, correction=args.correction, max_staleness=args.max_staleness))
            result["wall_s"] = time.perf_counter() - started
            results[arm][str(seed)] = result
            print(f"seed {seed} {arm}: {len(result['reward_mean'])} updates in {result['wall_s']:.0f} s, held-out "
                  f"accuracy {result['held_out_accuracy']}", flush=True)
    print(f"\nmean reward of the rollouts per {args.eval_every} updates (seeds {args.seeds}):")
    for arm in arms:
        for seed, result in results[arm].items():
            curve = " ".join(f"{v:.3f}" for v in windows(result["reward_mean"], args.eval_every))
            print(f"  {arm:15s} seed {seed}: {curve}")
    print("\nheld-out greedy accuracy by update:")
    steps = sorted({int(s) for r in results[arms[0]].values() for s in r["held_out_accuracy"]})
    print("  " + " " * 24 + " ".join(f"{s:>6d}" for s in steps))
    for arm in arms:
        for seed, result in results[arm].items():
            accuracy = {int(k): v for k, v in result["held_out_accuracy"].items()}
            print(f"  {arm:15s} seed {seed}: " + " ".join(f"{100 * accuracy.get(s, float('nan')):5.1f}%" for s in steps))
    paired = paired_differences(results) if len(arms) == 2 else {}
    if paired:
        print("\nTRL minus dualvllm train, same seed (points of held-out accuracy): mean [min, max]")
        for step, diffs in paired.items():
            print(f"  update {step:>4d}: {np.mean(diffs):+5.1f} [{min(diffs):+5.1f}, {max(diffs):+5.1f}]")
    args.output.mkdir(parents=True, exist_ok=True)
    summary = {"command": vars(args) | {"output": str(args.output)}, "prompts_per_step": PROMPTS_PER_STEP,
               "group_size": GROUP_SIZE, "results": results,
               "trl_minus_dualvllm_accuracy_points": {str(k): v for k, v in paired.items()}}
    (args.output / "trl_compare.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
