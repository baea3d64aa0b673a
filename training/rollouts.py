"""The sampling side of streaming GRPO: q* rollouts, scored, handed over through a queue.

The sampler and the learner meet only through `ScoredBatch` messages in a bounded
asyncio queue: the sampler keeps generating (at most `queue_size` batches ahead) while
the learner trains, and every rollout carries the policy version it was sampled with.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Awaitable, Callable, Sequence

from coordinator.core import DualVLLMCoordinator
from coordinator.outputs import GenerationOutput
from training.verifiers import Verifier, score_in_pool

log = logging.getLogger("dualvllm.training")


@dataclass(frozen=True)
class Task:
    """One training prompt: its token ids (shared by learner and servers) and its reference."""

    prompt_ids: tuple[int, ...]
    reference: str


@dataclass(frozen=True)
class Rollout:
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]  # sampled tokens, EOS included when sampled
    logprobs_q: tuple[float, ...]  # log q*(y_t): the behaviour policy, for importance weights
    alphas: tuple[float, ...]
    text: str
    reward: float


Groups = tuple[tuple[Rollout, ...], ...]


@dataclass(frozen=True)
class ScoredBatch:
    """The rollouts of `prompts_per_step` prompts, `group_size` each, grouped by prompt."""

    groups: Groups
    policy_version: int  # how many weight pushes the base server had seen when sampling began
    data_position: int  # index of the next unused task after this batch
    sample_seconds: float
    tokens: int


async def sample_batch(coordinator: DualVLLMCoordinator, tasks: Sequence[Task], *, group_size: int,
                       max_tokens: int, temperature: float, fixed_alpha: float | None, seed: int,
                       verifier: Verifier, executor: Executor) -> Groups:
    """`group_size` rollouts per task from q*, scored off the event loop; failed rollouts are dropped."""
    prompts = [list(task.prompt_ids) for task in tasks for _ in range(group_size)]
    outputs = await coordinator.generate_batch(prompts, max_tokens=max_tokens, temperature=temperature,
                                               fixed_alpha=fixed_alpha, seed=seed)
    failed = [o for o in outputs if not o.ok]
    if failed:
        log.warning("%d of %d rollouts failed and are dropped (first: %s)", len(failed), len(outputs), failed[0].error)
    references = [task.reference for task in tasks for _ in range(group_size)]
    rewards = await score_in_pool(verifier, [o.generated_text for o in outputs], references, executor)
    groups = []
    for i, task in enumerate(tasks):
        members = range(i * group_size, (i + 1) * group_size)
        groups.append(tuple(_rollout(task, outputs[j], rewards[j]) for j in members if outputs[j].ok))
    return tuple(g for g in groups if len(g) >= 2)  # a lone rollout has no group to compare with


def _rollout(task: Task, output: GenerationOutput, reward: float) -> Rollout:
    return Rollout(prompt_ids=task.prompt_ids, completion_ids=tuple(output.generated_tokens),
                   logprobs_q=tuple(output.logprobs_q), alphas=tuple(output.alpha_history),
                   text=output.generated_text, reward=reward)


async def produce(queue: asyncio.Queue[ScoredBatch], sample: Callable[[Sequence[Task], int], Awaitable[Groups]],
                  tasks: Sequence[Task], *, start: int, prompts_per_step: int,
                  policy_version: Callable[[], int]) -> None:
    """Fill `queue` with scored batches forever, cycling over `tasks` from `start`.

    `sample(tasks, seed)` returns their scored groups; the data position doubles as the
    seed, so a resumed run samples what an uninterrupted one would have.
    """
    position = start
    while True:
        chosen = [tasks[(position + i) % len(tasks)] for i in range(prompts_per_step)]
        version = policy_version()
        started = time.perf_counter()
        groups = await sample(chosen, position)
        position += prompts_per_step
        tokens = sum(len(r.completion_ids) for g in groups for r in g)
        await queue.put(ScoredBatch(groups=groups, policy_version=version, data_position=position,
                                    sample_seconds=time.perf_counter() - started, tokens=tokens))
