"""What every training recipe (training/grpo.py, training/dpo.py) shares.

    prepare     the run's inputs, checked before any server starts: tokenizer, problems
                (dataset, templates, rewards), the output directory and its config.json
    held_out    the held-out evaluation of the base alone: greedy accuracy and pass@k

A recipe has torchtune's shape: `setup` (servers, learner, coordinator), `train_step`,
`evaluate`, `cleanup`, and `run` that calls them in order with cleanup on every path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dualvllm import tinymodels
from dualvllm.common.errors import InvalidInputError
from dualvllm.training import checkpoint
from dualvllm.training.config import TrainConfig
from dualvllm.training.evaluation import evaluate
from dualvllm.training.problems import Problems, load_problems


@dataclass(frozen=True)
class RunInputs:
    """A run's inputs, all validated."""

    base_dir: str  # the base model the run starts from (not a checkpoint)
    tokenizer: Any
    problems: Problems


def prepare(config: TrainConfig, *, resume: bool = False) -> RunInputs:
    """Load and check everything a run needs before a server starts; refuse to overwrite a run
    that holds checkpoints unless resuming; write the run's config.json."""
    from transformers import AutoTokenizer

    out = config.output_dir
    if not resume and out.is_dir() and checkpoint.latest(out) is not None:
        raise InvalidInputError(
            f"{out} already holds checkpoints; pass --resume to continue that run or choose a new --output-dir"
        )
    base_dir = config.base or str(tinymodels.BASE_DIR)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    problems = load_problems(config, tokenizer)  # refuses bad data before any server starts
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(config.model_dump_json(indent=2) + "\n")
    return RunInputs(base_dir=base_dir, tokenizer=tokenizer, problems=problems)


async def held_out(coordinator: Any, config: TrainConfig, problems: Problems, pool: Any) -> dict[str, float]:
    """The base alone on the held-out tasks: held_out_accuracy (greedy, and per --eval-group-by
    value as held_out_accuracy/<value>) and held_out_pass@k; on the retained skill's tasks, if
    any, retained_accuracy (greedy) the same way."""
    [base] = await evaluate(
        coordinator,
        problems.held_out,
        problems.spec,
        pool,
        config.sampling_params(),
        arms=("base",),
        samples=config.eval_samples,
        ks=config.pass_ks,
        seed=config.seed,
        reward_timeout_s=config.reward_timeout,
        group_by=config.eval_group_by,
    )
    metrics = {
        "held_out_accuracy": base.greedy_accuracy,
        **{f"held_out_accuracy/{g}": v for g, v in base.by_group.items()},
        **{f"held_out_pass@{k}": v for k, v in base.pass_at.items()},
    }
    if problems.retained:
        [kept] = await evaluate(
            coordinator,
            problems.retained,
            problems.spec,
            pool,
            config.sampling_params(),
            arms=("base",),
            seed=config.seed,
            reward_timeout_s=config.reward_timeout,
            group_by=config.eval_group_by,
        )
        metrics |= {
            "retained_accuracy": kept.greedy_accuracy,
            **{f"retained_accuracy/{g}": v for g, v in kept.by_group.items()},
        }
    return metrics
