"""Held-out evaluation as RL papers report it: greedy accuracy and pass@k, per arm.

An arm is a fixed way to sample: the base alone (alpha = 0), q* (alpha* per token) or
the teacher alone (alpha = 1). For every held-out task an arm decodes greedily once and,
with `samples` > 0, samples `samples` completions at the temperature; a completion is
correct when its total reward reaches `success` (1.0: an exact answer, every test passed).
pass@k is the unbiased estimator of dualvllm.theory.passk, averaged over tasks. `dualvllm eval`
and the training runs' periodic evaluation both call `evaluate`.
"""

from __future__ import annotations

import dataclasses
import json
from concurrent.futures import Executor
from dataclasses import asdict, dataclass, field
from typing import Any
from collections.abc import Sequence

import numpy as np

from dualvllm.coordinator.core import DualVLLMCoordinator
from dualvllm.coordinator.sequence import SamplingParams
from dualvllm.theory.passk import pass_at_k
from dualvllm.training.config import EvalConfig
from dualvllm.training.rewards import RewardSpec, score_completions
from dualvllm.training.rollouts import Task, reward_fields

# The group of a row without the group_by field.
GROUP_MISSING = "(none)"
# fixed_alpha of each arm; None = alpha* per token.
ARMS: dict[str, float | None] = {"base": 0.0, "q*": None, "teacher": 1.0}


@dataclass(frozen=True)
class ArmResult:
    arm: str
    greedy_accuracy: float  # share of tasks whose greedy completion is correct
    pass_at: dict[int, float]  # k -> mean pass@k over tasks (empty without samples)
    mean_reward: float  # of the sampled completions (greedy ones without samples); unscored left out
    mean_alpha: float  # of the greedy completions' tokens
    tasks: int
    samples: int  # per task, for pass@k
    by_group: dict[str, float] = field(default_factory=dict)  # greedy accuracy per value of the group_by field

    def metrics(self, prefix: str = "") -> dict[str, float]:
        """Flat metrics for metrics.jsonl: greedy_accuracy, greedy_accuracy/<group>, pass@k, ... with `prefix`."""
        flat: dict[str, Any] = {
            f"{prefix}greedy_accuracy": self.greedy_accuracy,
            f"{prefix}mean_reward": self.mean_reward,
        }
        flat.update({f"{prefix}greedy_accuracy/{group}": v for group, v in self.by_group.items()})
        flat.update({f"{prefix}pass@{k}": v for k, v in self.pass_at.items()})
        return flat

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


async def evaluate(
    coordinator: DualVLLMCoordinator,
    tasks: Sequence[Task],
    spec: RewardSpec,
    executor: Executor,
    params: SamplingParams,
    *,
    arms: Sequence[str],
    samples: int = 0,
    ks: Sequence[int] = (),
    seed: int = 0,
    success: float = 1.0,
    reward_timeout_s: float = 60.0,
    show_progress: bool = False,
    group_by: str | None = None,
) -> list[ArmResult]:
    """Greedy accuracy and pass@k (`samples` per task, sampled with `params`) of each arm on
    `tasks`, in the order of `arms` (each arm sets the alpha); with `group_by`, greedy accuracy also
    per value of that row field (rows without it: GROUP_MISSING)."""
    if any(k > samples for k in ks):
        raise ValueError(f"pass@{max(ks)} needs at least {max(ks)} samples per task, got {samples}")
    results = []
    for arm in arms:
        alpha = ARMS[arm]
        greedy = await coordinator.generate_batch(
            [t.prompt for t in tasks],
            dataclasses.replace(params, temperature=0.0, fixed_alpha=alpha),
            seed=seed,
            show_progress=show_progress,
        )
        greedy_rewards = await _rewards(spec, tasks, greedy, executor, reward_timeout_s)
        correct = np.array([r is not None and r >= success for r in greedy_rewards])
        rewards = greedy_rewards
        pass_at: dict[int, float] = {}
        if samples:
            outputs = await coordinator.generate_batch(
                [t.prompt for t in tasks for _ in range(samples)],
                dataclasses.replace(params, fixed_alpha=alpha),
                seed=seed,
                show_progress=show_progress,
            )
            rewards = await _rewards(
                spec, [t for t in tasks for _ in range(samples)], outputs, executor, reward_timeout_s
            )
            hits = np.array([r is not None and r >= success for r in rewards]).reshape(len(tasks), samples)
            counts = hits.sum(axis=1)
            pass_at = {k: float(pass_at_k(np.full(len(tasks), samples), counts, k).mean()) for k in ks}
        scored = [r for r in rewards if r is not None]
        alphas = [a for o in greedy for a in o.alpha_history]
        results.append(
            ArmResult(
                arm=arm,
                greedy_accuracy=float(correct.mean()),
                pass_at=pass_at,
                mean_reward=float(np.mean(scored)) if scored else float("nan"),
                mean_alpha=float(np.mean(alphas)) if alphas else float("nan"),
                tasks=len(tasks),
                samples=samples,
                by_group=_by_group(tasks, correct, group_by),
            )
        )
    return results


def _by_group(tasks: Sequence[Task], correct: np.ndarray, group_by: str | None) -> dict[str, float]:
    """Mean of `correct` [n] per value of each task's `group_by` field, in sorted order."""
    if group_by is None:
        return {}
    groups = np.array([str(t.row.get(group_by, GROUP_MISSING)) for t in tasks])  # [n]
    return {str(g): float(correct[groups == g].mean()) for g in np.unique(groups)}


async def _rewards(
    spec: RewardSpec, tasks: Sequence[Task], outputs: Sequence[Any], executor: Executor, timeout_s: float
) -> list[float | None]:
    """Each output's total reward; a failed generation counts as unscored (None)."""
    scores = await score_completions(
        spec,
        [t.prompt_text for t in tasks],
        [o.generated_text for o in outputs],
        [reward_fields(t.row, o) for t, o in zip(tasks, outputs)],
        executor,
        timeout_s=timeout_s,
    )
    return [r if o.ok else None for r, o in zip(scores.total, outputs)]


def render(results: Sequence[ArmResult]) -> str:
    """A table: one row per arm."""
    ks = sorted({k for r in results for k in r.pass_at})
    head = f"{'arm':<10}{'greedy':>9}" + "".join(f"{f'pass@{k}':>9}" for k in ks) + f"{'reward':>9}{'alpha':>8}"
    rows = [
        f"{r.arm:<10}{r.greedy_accuracy:>9.1%}"
        + "".join(f"{r.pass_at[k]:>9.1%}" for k in ks)
        + f"{r.mean_reward:>9.3f}{r.mean_alpha:>8.3f}"
        for r in results
    ]
    groups = [
        f"  {r.arm} greedy by group: " + ", ".join(f"{g} {v:.1%}" for g, v in r.by_group.items())
        for r in results
        if r.by_group
    ]
    return "\n".join([head, *rows, *groups])


async def run_eval(config: EvalConfig, *, show_progress: bool = True) -> str:
    """`dualvllm eval`: start the servers of `config`, evaluate every arm, return the report.

    The problems are --eval-dataset, else all of --dataset (up to --eval-prompts), else the
    bundled test split. With `config.output` the report is also written there as JSON.
    """
    from transformers import AutoTokenizer

    from dualvllm import tinymodels
    from dualvllm.training.problems import load_problems
    from dualvllm.training.serving import serving
    from dualvllm.training.verifiers import verifier_pool

    if config.dataset is not None and config.eval_dataset is None:
        config = config.model_copy(update={"eval_dataset": config.dataset})
    base_dir = config.base or str(tinymodels.BASE_DIR)
    problems = load_problems(config, AutoTokenizer.from_pretrained(base_dir))
    tasks = problems.held_out
    with verifier_pool() as pool:
        async with serving(config, base_dir, batch_size=len(tasks) * max(config.eval_samples, 1)) as coordinator:
            results = await evaluate(
                coordinator,
                tasks,
                problems.spec,
                pool,
                config.sampling_params(),
                arms=config.arms,
                samples=config.eval_samples,
                ks=config.pass_ks,
                seed=config.seed,
                reward_timeout_s=config.reward_timeout,
                show_progress=show_progress,
                group_by=config.eval_group_by,
            )
            retained = (
                await evaluate(
                    coordinator,
                    problems.retained,
                    problems.spec,
                    pool,
                    config.sampling_params(),
                    arms=config.arms,
                    seed=config.seed,
                    reward_timeout_s=config.reward_timeout,
                    show_progress=show_progress,
                    group_by=config.eval_group_by,
                )
                if problems.retained
                else []
            )
    text = (
        f"{len(tasks)} problems; greedy and {config.eval_samples} samples each at temperature "
        f"{config.temperature:g}\n{render(results)}"
    )
    if retained:
        text += f"\nretained skill ({len(problems.retained)} problems, greedy)\n{render(retained)}"
    if config.output is not None:
        config.output.parent.mkdir(parents=True, exist_ok=True)
        config.output.write_text(
            json.dumps(
                {
                    "config": json.loads(config.model_dump_json()),
                    "arms": [r.to_dict() for r in results],
                    "retained": [r.to_dict() for r in retained],
                },
                indent=2,
            )
            + "\n"
        )
    return text
