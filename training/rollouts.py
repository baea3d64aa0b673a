"""The sampling side of streaming GRPO: q* rollouts, scored, handed over through a queue.

The sampler and the learner meet only through `ScoredBatch` messages in a bounded
asyncio queue: the sampler keeps generating (at most `queue_size` batches ahead) while
the learner trains, and every rollout carries the policy version it was sampled with.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Protocol
from collections.abc import Awaitable, Callable, Mapping, Sequence

import numpy as np

from dualvllm.coordinator.core import DualVLLMCoordinator
from dualvllm.coordinator.outputs import GenerationOutput
from dualvllm.coordinator.sequence import SamplingParams
from dualvllm.training.rewards import RewardSpec, score_completions

log = logging.getLogger("dualvllm.training")
# The on-policy part of a pooled group draws from its own seeds, apart from every batch's q* part.
ON_POLICY_SEED_OFFSET = 1 << 40


@dataclass(frozen=True)
class Task:
    """One training prompt, as token ids of the base tokenizer (the learner's and the servers')."""

    prompt_ids: tuple[int, ...]  # what the base sees: the learner trains on it and the base server samples with it
    t_prompt_ids: tuple[int, ...] | None  # what the teacher sees, when it differs (a privileged-information teacher)
    prompt_text: str  # the base prompt as text, for reward functions
    row: Mapping[str, Any] = field(hash=False, compare=False)  # the dataset row: references for rewards

    @property
    def prompt(self) -> list[int] | tuple[list[int], list[int]]:
        """The prompt as the coordinator takes it."""
        theta = list(self.prompt_ids)
        return theta if self.t_prompt_ids is None else (theta, list(self.t_prompt_ids))


@dataclass(frozen=True)
class Rollout:
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]  # sampled tokens, EOS included when sampled
    logprobs_q: tuple[float, ...]  # log q*(y_t): the behaviour policy, for importance weights
    alphas: tuple[float, ...]
    text: str
    reward: float
    # log pi_t(y_t), raw (the fill value of dualvllm.theory.merge where y_t was outside the teacher's
    # top-k): what on-policy distillation's per-token advantage needs. Empty when not recorded.
    logprobs_t: tuple[float, ...] = ()
    # The teacher's top-k at each visited state, int64 ids and raw logprobs [T, k] (-inf in
    # padding): what the distillation term needs. None unless sampled with record_topk.
    teacher_topk: tuple[np.ndarray, np.ndarray] | None = field(default=None, compare=False)
    on_policy: bool = False  # sampled at alpha = 0 in a pooled group (the rest are guided by the teacher)


Groups = tuple[tuple[Rollout, ...], ...]


@dataclass(frozen=True)
class ScoredBatch:
    """The rollouts of `prompts_per_step` prompts, `group_size` each, grouped by prompt."""

    groups: Groups
    policy_version: int  # how many weight pushes the base server had seen when sampling began
    data_position: int  # index of the next unused task after this batch
    sample_seconds: float
    tokens: int
    reward_means: dict[str, float] = field(default_factory=dict)  # each named reward over the scored rollouts
    unscored: int = 0  # rollouts a reward could not score (None): left out of the update
    curriculum_state: dict | None = None  # the curriculum as it was when this batch was queued (for checkpoints)
    curriculum_stats: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Sampled:
    """What `sample_batch` returns: the groups, and what the rewards said of every rollout."""

    groups: Groups
    reward_means: dict[str, float]
    unscored: int
    group_tasks: tuple[int, ...]  # for each group, the index of its task in the tasks sampled


async def sample_batch(
    coordinator: DualVLLMCoordinator,
    tasks: Sequence[Task],
    params: SamplingParams,
    *,
    group_size: int,
    seed: int,
    spec: RewardSpec,
    executor: Executor,
    reward_timeout_s: float,
    on_policy: int = 0,
    min_group: int = 2,
) -> Sampled:
    """`group_size` rollouts per task sampled with `params` (q* unless its fixed_alpha says
    otherwise), scored off the event loop.

    With `on_policy` = N > 0 the groups are pooled: each task's first N rollouts are sampled
    at alpha = 0 (the base alone, no alpha cap), the other group_size - N with `params`.
    `params.record_topk` keeps the teacher's top-k at every visited state (Rollout.teacher_topk);
    `params.max_alpha` caps alpha* (an alpha schedule).
    Failed rollouts and rollouts a reward scored None are dropped (logged), and so are
    groups left with fewer than `min_group` rollouts (2 for grpo: a lone rollout has no
    group to compare with; 1 for methods that train on each rollout alone).
    """
    if not tasks:
        return Sampled(groups=(), reward_means={}, unscored=0, group_tasks=())
    guided = group_size - on_policy

    async def part(count: int, part_params: SamplingParams, part_seed: int) -> list[GenerationOutput]:
        # One call per part: a call has one fixed_alpha; both share the coordinator's batch.
        if not count:
            return []
        return await coordinator.generate_batch(
            [task.prompt for task in tasks for _ in range(count)], part_params, seed=part_seed
        )

    q_part, own_part = await asyncio.gather(
        part(guided, params, seed),
        part(on_policy, dataclasses.replace(params, fixed_alpha=0.0, max_alpha=None), seed + ON_POLICY_SEED_OFFSET),
    )
    outputs, is_on_policy = [], []
    for i in range(len(tasks)):  # each task's group: its on-policy rollouts first, then the guided ones
        outputs.extend(own_part[i * on_policy : (i + 1) * on_policy])
        outputs.extend(q_part[i * guided : (i + 1) * guided])
        is_on_policy.extend([True] * on_policy + [False] * guided)
    failed = [o for o in outputs if not o.ok]
    if failed:
        log.warning("%d of %d rollouts failed and are dropped (first: %s)", len(failed), len(outputs), failed[0].error)
    owners = [task for task in tasks for _ in range(group_size)]
    scores = await score_completions(
        spec,
        [task.prompt_text for task in owners],
        [o.generated_text for o in outputs],
        [reward_fields(task.row, o) for task, o in zip(owners, outputs)],
        executor,
        timeout_s=reward_timeout_s,
    )
    unscored = sum(1 for o, r in zip(outputs, scores.total) if o.ok and r is None)
    if unscored:
        log.warning(
            "%d of %d rollouts have no reward (a reward failed or gave None) and are left out", unscored, len(outputs)
        )
    groups = []
    for i, task in enumerate(tasks):
        members = range(i * group_size, (i + 1) * group_size)
        groups.append(
            tuple(
                _rollout(task, outputs[j], total, is_on_policy[j])
                for j in members
                if outputs[j].ok and (total := scores.total[j]) is not None
            )
        )
    means = {
        name: _mean([v for o, v in zip(outputs, values) if o.ok and v is not None])
        for name, values in scores.by_name.items()
    }
    kept = [i for i, g in enumerate(groups) if len(g) >= min_group]
    return Sampled(
        groups=tuple(groups[i] for i in kept), reward_means=means, unscored=unscored, group_tasks=tuple(kept)
    )


def reward_fields(row: Mapping[str, Any], output: GenerationOutput) -> dict[str, Any]:
    """A rollout's keywords for reward functions: its row's fields and its sampled token ids."""
    return {**row, "completion_ids": list(output.generated_tokens)}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _rollout(task: Task, output: GenerationOutput, reward: float, on_policy: bool) -> Rollout:
    teacher_topk = None
    if output.topk_ids is not None and output.topk_logprobs is not None:
        teacher_topk = (output.topk_ids[:, 1], output.topk_logprobs[:, 1])  # [T, k]: row 1 is the teacher's
    return Rollout(
        prompt_ids=task.prompt_ids,
        completion_ids=tuple(output.generated_tokens),
        logprobs_q=tuple(output.logprobs_q),
        alphas=tuple(output.alpha_history),
        text=output.generated_text,
        reward=reward,
        logprobs_t=tuple(output.logprobs_t),
        teacher_topk=teacher_topk,
        on_policy=on_policy,
    )


class Chooser(Protocol):
    """Picks each batch's prompts and learns from their groups: dualvllm.training.curriculum.Curriculum,
    dualvllm.training.regimes.Regimes. Its state goes into each batch, for the checkpoint."""

    def choose(self, count: int) -> list[int]: ...

    def observe(self, task_indices: Sequence[int], groups: Groups) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def stats(self) -> dict[str, float]: ...


class Lead:
    """How far the sampler may run ahead of the learner without sampling for the bin.

    A batch is dropped when the learner reaches it more than `max_staleness` pushes after it
    was started. Started while `ahead` batches are untrained (the one in training included),
    it waits for `ahead` updates, so for at most ceil(ahead / push_every) pushes: it is trained
    only if `ahead` <= max_staleness * push_every. The sampler therefore starts a batch only
    below that. Without this bound, the defaults (push every update, max_staleness 1, a queue of
    2) let the sampler run three batches ahead, and about every other batch was sampled and
    then dropped: on the realistic small shape, 10 dropped in 12 updates.
    """

    def __init__(self, max_staleness: int, push_every: int) -> None:
        if max_staleness < 0 or push_every < 1:
            raise ValueError(f"max_staleness {max_staleness} must be >= 0 and push_every {push_every} >= 1")
        self.limit = max_staleness * push_every + 1  # batches untrained, a new one included
        self.ahead = 0  # batches started and not yet trained or dropped
        self._trained = asyncio.Event()

    async def start(self) -> None:
        """Until a new batch would still be fresh enough when the learner reaches it."""
        while self.ahead >= self.limit:
            self._trained.clear()
            await self._trained.wait()  # (the sampler's task is cancelled on every stop path)
        self.ahead += 1

    def trained(self) -> None:
        """The learner is done with a batch: trained and pushed, or dropped."""
        self.ahead = max(self.ahead - 1, 0)
        self._trained.set()


async def produce(
    queue: asyncio.Queue[ScoredBatch],
    sample: Callable[[Sequence[int], int], Awaitable[Sampled]],
    n_tasks: int,
    *,
    start: int,
    prompts_per_step: int,
    policy_version: Callable[[], int],
    chooser: Chooser | None = None,
    lead: Lead | None = None,
) -> None:
    """Fill `queue` with scored batches forever, cycling over the tasks 0..n_tasks-1 from `start`.

    `sample(task_indices, seed)` returns their scored groups; the data position doubles as the
    seed, so a resumed run samples what an uninterrupted one would have. With a `chooser` (a
    curriculum, the adaptive recipe's regimes), it picks each batch's tasks instead of the
    cycle and learns from the groups; each batch carries its state for the checkpoint. With a
    `lead`, a batch starts only while the learner would still take it (Lead).
    """
    position = start
    while True:
        if lead is not None:
            await lead.start()
        if chooser is not None:
            indices = chooser.choose(prompts_per_step)
        else:
            indices = [(position + i) % n_tasks for i in range(prompts_per_step)]
        version = policy_version()
        started = time.perf_counter()
        sampled = await sample(indices, position)
        position += prompts_per_step
        state, stats = None, {}
        if chooser is not None:
            chooser.observe([indices[j] for j in sampled.group_tasks], sampled.groups)
            state, stats = chooser.state_dict(), chooser.stats()
        tokens = sum(len(r.completion_ids) for g in sampled.groups for r in g)
        await queue.put(
            ScoredBatch(
                groups=sampled.groups,
                policy_version=version,
                data_position=position,
                sample_seconds=time.perf_counter() - started,
                tokens=tokens,
                reward_means=sampled.reward_means,
                unscored=sampled.unscored,
                curriculum_state=state,
                curriculum_stats=stats,
            )
        )
