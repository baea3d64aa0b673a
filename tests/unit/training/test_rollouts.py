"""The sampler loop: batches in data order, or chosen by the curriculum, which learns from their groups."""

from __future__ import annotations

import asyncio

import pytest

from dualvllm.training.curriculum import Curriculum
from dualvllm.training.rollouts import Lead, Rollout, Sampled, ScoredBatch, Task, produce


def task(i: int) -> Task:
    return Task(prompt_ids=(i,), t_prompt_ids=None, prompt_text=str(i), row={"answer": "x"})


def rollout(t: Task, reward: float) -> Rollout:
    return Rollout(prompt_ids=t.prompt_ids, completion_ids=(1,), logprobs_q=(-1.0,), alphas=(0.5,), text="",
                   reward=reward)


async def run(curriculum: Curriculum | None, batches: int) -> tuple[list[list[int]], list[ScoredBatch]]:
    tasks = [task(i) for i in range(10)]
    asked: list[list[int]] = []

    async def sample(indices, seed) -> Sampled:
        chosen = [tasks[i] for i in indices]
        asked.append([t.prompt_ids[0] for t in chosen])
        # Task 0 is always all-wrong (no signal); the others alternate right and wrong.
        groups = tuple((rollout(t, 0.0), rollout(t, 0.0 if t.prompt_ids[0] == 0 else 1.0)) for t in chosen)
        return Sampled(groups=groups, reward_means={}, unscored=0, group_tasks=tuple(range(len(chosen))))

    queue: asyncio.Queue[ScoredBatch] = asyncio.Queue(maxsize=1)  # as in training: the sampler waits
    sampler = asyncio.create_task(produce(queue, sample, len(tasks), start=4, prompts_per_step=3,
                                          policy_version=lambda: 0, chooser=curriculum))
    out = [await queue.get() for _ in range(batches)]
    sampler.cancel()
    return asked, out


async def test_without_a_curriculum_batches_follow_the_data_position():
    asked, out = await run(None, 3)
    assert asked[:3] == [[4, 5, 6], [7, 8, 9], [0, 1, 2]]
    assert [b.data_position for b in out] == [7, 10, 13] and out[0].curriculum_state is None


async def test_the_curriculum_chooses_and_learns_from_every_group():
    curriculum = Curriculum(n_tasks=10, seed=3, skip_steps=5)
    asked, out = await run(curriculum, 6)
    picks = [i for batch in asked for i in batch]
    assert sorted(picks[:10]) == list(range(10))  # every task is asked once before any is asked again
    assert out[-1].curriculum_state == Curriculum.from_state(out[-1].curriculum_state).state_dict()
    assert out[-1].curriculum_stats["curriculum/seen"] == 10
    # Task 0's group carried no advantage, so it rests: not asked in the batches right after it was seen.
    seen_at = next(n for n, batch in enumerate(asked) if 0 in batch)
    assert all(0 not in batch for batch in asked[seen_at + 1:seen_at + 5])


async def learn(lead: Lead | None, updates: int) -> tuple[list[int], int]:
    """A learner that pushes after every update, beside a sampler with the defaults' queue of 2
    -> (each batch's staleness when the learner took it, the most batches started ahead)."""
    tasks = [task(i) for i in range(10)]
    version, most_ahead = 0, 0

    async def sample(indices, seed) -> Sampled:
        nonlocal most_ahead
        most_ahead = max(most_ahead, lead.ahead if lead is not None else 0)
        for _ in range(3):  # sampling takes a while: the learner runs meanwhile
            await asyncio.sleep(0)
        return Sampled(groups=(), reward_means={}, unscored=0, group_tasks=())

    queue: asyncio.Queue[ScoredBatch] = asyncio.Queue(maxsize=2)
    sampler = asyncio.create_task(produce(queue, sample, len(tasks), start=0, prompts_per_step=1,
                                          policy_version=lambda: version, lead=lead))
    staleness = []
    try:
        for _ in range(updates):
            batch = await asyncio.wait_for(queue.get(), 10)
            staleness.append(version - batch.policy_version)
            for _ in range(10):  # the update, slower than sampling
                await asyncio.sleep(0)
            version += 1  # its push
            if lead is not None:
                lead.trained()
    finally:
        sampler.cancel()
    return staleness, most_ahead


async def test_the_sampler_starts_only_batches_the_learner_will_still_take():
    staleness, most_ahead = await learn(Lead(max_staleness=1, push_every=1), 8)
    assert max(staleness) <= 1 and most_ahead <= 2  # one in training, one sampling
    # Unbounded, the queue lets it run further ahead, and its batches arrive too old to train on.
    unbounded, _ = await learn(None, 8)
    assert max(unbounded) > 1, unbounded


def test_the_lead_follows_staleness_and_push_interval():
    assert Lead(max_staleness=0, push_every=1).limit == 1  # on-policy: sample only while nothing waits
    assert Lead(max_staleness=1, push_every=4).limit == 5  # four updates share a push
    with pytest.raises(ValueError, match="max_staleness -1 must be >= 0"):
        Lead(max_staleness=-1, push_every=1)
