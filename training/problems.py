"""The run's problems: dataset rows as token-id tasks for the learner and the coordinator.

    TaskConfig --load_problems--> Problems(train tasks, held-out tasks, reward spec)

Everything here runs before any server starts, so a bad dataset, template or reward is
refused in one line. The learner and the servers see the very same token ids: prompts
are tokenized once, here, with the base tokenizer, and sent to the servers as ids.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Callable

from dualvllm.common.errors import InvalidInputError
from dualvllm.training.task_config import SELF_TEACHERS, TaskConfig
from dualvllm.training.data import BUNDLED_TEST, BUNDLED_TRAIN, Example, build_examples, held_out_split, load_rows
from dualvllm.training.rewards import RewardSpec, required_fields, reward_spec
from dualvllm.training.rollouts import Task

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Problems:
    train: list[Task]  # in the run's order (shuffled by the seed)
    held_out: list[Task]  # the first eval_prompts of the held-out set, chosen by the seed
    spec: RewardSpec
    retained: list[Task] = field(default_factory=list)  # a skill kept, not trained: what forgetting costs


def load_problems(config: TaskConfig, tokenizer: Any) -> Problems:
    """The training and held-out tasks and the reward spec of `config`, all validated."""
    spec = reward_spec(
        config.reward, config.reward_weights, length_budget=config.length_budget, format_pattern=config.format_pattern
    )
    render = _chat_renderer(config, tokenizer)

    def examples(path: Path) -> list[Example]:
        return build_examples(
            load_rows(path),
            source=str(path),
            prompt_template=config.prompt_template,
            teacher_template=config.teacher_template,
            chat_template=render,
            required_fields=required_fields(spec),
        )

    if config.dataset is None:
        train, held_out = examples(BUNDLED_TRAIN), examples(BUNDLED_TEST)
    elif config.eval_dataset is not None:
        train, held_out = examples(config.dataset), examples(config.eval_dataset)
    else:
        rows = examples(config.dataset)
        n = min(config.eval_prompts, max(1, round(config.eval_fraction * len(rows))))
        train, held_out = held_out_split(rows, n, config.seed)
        log.info(
            "held out %d of the %d rows of %s for evaluation (--eval-fraction %g, at most --eval-prompts %d); "
            "give --eval-dataset to evaluate on other data",
            n,
            len(rows),
            config.dataset,
            config.eval_fraction,
            config.eval_prompts,
        )
    random.Random(config.seed).shuffle(train)
    random.Random(config.seed + 1).shuffle(held_out)
    held_out = held_out[: config.eval_prompts]
    wrap = config.chat_template is not None
    tasks = [[_task(e, tokenizer, render if wrap else None) for e in part] for part in (train, held_out)]
    if config.teacher in SELF_TEACHERS:
        _check_teacher_sees_more(config.teacher, tasks[0] + tasks[1])
    retained: list[Task] = []
    if config.retained_dataset is not None:  # scored by the base alone: no teacher prompt to check
        kept = examples(config.retained_dataset)
        random.Random(config.seed + 2).shuffle(kept)
        retained = [_task(e, tokenizer, render if wrap else None) for e in kept[: config.eval_prompts]]
    if config.eval_group_by is not None:
        for name, part in (("held-out", tasks[1]), ("retained", retained)):
            if part and not any(config.eval_group_by in task.row for task in part):
                raise InvalidInputError(
                    f"--eval-group-by {config.eval_group_by}: no {name} row has that field "
                    f"(its fields: {', '.join(sorted(part[0].row))})"
                )
    return Problems(train=tasks[0], held_out=tasks[1], spec=spec, retained=retained)


def _chat_renderer(config: TaskConfig, tokenizer: Any) -> Callable[[list[dict]], str] | None:
    """messages -> text, with the configured template or the base tokenizer's own (None if it has none)."""
    template = None
    if config.chat_template not in (None, "tokenizer"):
        template = Path(config.chat_template).read_text(encoding="utf-8")
    elif getattr(tokenizer, "chat_template", None) is None:
        if config.chat_template == "tokenizer":
            raise InvalidInputError(
                "--chat-template tokenizer: the base tokenizer has no chat template; give a "
                "Jinja template file with --chat-template PATH, or drop the option"
            )
        return None

    def render(messages: list[dict]) -> str:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, chat_template=template
        )

    return render


def _task(example: Example, tokenizer: Any, wrap: Callable[[list[dict]], str] | None) -> Task:
    """Token ids of both prompts; with `wrap`, each text prompt is first one rendered user message."""

    def ids(part: str | tuple[int, ...]) -> tuple[int, ...]:
        if not isinstance(part, str):
            return tuple(part)
        if wrap is not None:
            # The rendered chat holds its own special tokens: add none on top.
            return tuple(tokenizer(wrap([{"role": "user", "content": part}]), add_special_tokens=False)["input_ids"])
        return tuple(tokenizer(part, add_special_tokens=True)["input_ids"])

    theta = ids(example.theta_prompt)
    t = None if example.t_prompt is None else ids(example.t_prompt)
    text = (
        tokenizer.decode(list(theta))
        if wrap is not None or not isinstance(example.theta_prompt, str)
        else example.theta_prompt
    )
    return Task(prompt_ids=theta, t_prompt_ids=None if t == theta else t, prompt_text=text, row=example.row)


def _check_teacher_sees_more(teacher: str, tasks: list[Task]) -> None:
    same = next((task for task in tasks if task.t_prompt_ids is None), None)
    if same is not None:
        raise InvalidInputError(
            f"--teacher {teacher} is the base model shown the teacher's prompt, and the prompt {same.prompt_text!r} "
            "is the same for both, so q* would be the base itself. Give --teacher-template (e.g. "
            "'{prompt}{answer} ') or rows with theta_prompt and t_prompt that differ"
        )
