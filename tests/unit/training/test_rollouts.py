"""The sampler loop: batches in data order, or chosen by the curriculum, which learns from their groups."""

from __future__ import annotations

import asyncio

from dualvllm.training.curriculum import Curriculum
from dualvllm.training.rollouts import Rollout, Sampled, ScoredBatch, Task, produce


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
