"""Held-out evaluation over fake servers: greedy accuracy and pass@k per arm, from the samples."""

from __future__ import annotations

import numpy as np
import pytest

from dualvllm.coordinator import CoordinatorConfig, DualVLLMCoordinator, SamplingParams
from dualvllm.theory.passk import pass_at_k
from dualvllm.training.evaluation import GROUP_MISSING, evaluate, render
from dualvllm.training.rewards import reward_spec
from dualvllm.training.rollouts import Task
from dualvllm.training.verifiers import verifier_pool

# A completion is "correct" when it starts with one of these letters (the fake models' alphabet).
PATTERN = r"^[a-e]"


def tasks() -> list[Task]:
    return [Task(prompt_ids=tuple(range(1, n + 2)), t_prompt_ids=None, prompt_text=f"p{n}", row={})
            for n in range(6)]


def correct(texts) -> np.ndarray:
    return np.array([t[:1] in "abcde" and t != "" for t in texts])


async def test_arms_report_what_their_own_samples_say(fake_theta, fake_t):
    spec = reward_spec(["format"], format_pattern=PATTERN)
    config = CoordinatorConfig(theta_url=fake_theta.url, t_url=fake_t.url, top_k=8, retry_delay=0.0)
    with verifier_pool() as pool:
        async with DualVLLMCoordinator(config) as c:
            results = await evaluate(c, tasks(), spec, pool, SamplingParams(max_tokens=3, temperature=1.0),
                                     arms=("base", "q*", "teacher"), samples=4, ks=(1, 2, 4), seed=7)
            # The same calls, made by hand: the arm's results must be these samples' statistics.
            prompts = [t.prompt for t in tasks()]
            greedy = await c.generate_batch(prompts, max_tokens=3, temperature=0.0, fixed_alpha=None, seed=7)
            sampled = await c.generate_batch([p for p in prompts for _ in range(4)], max_tokens=3,
                                             temperature=1.0, fixed_alpha=None, seed=7)
    by_arm = {r.arm: r for r in results}
    assert [r.arm for r in results] == ["base", "q*", "teacher"]
    assert by_arm["base"].mean_alpha == 0.0 and by_arm["teacher"].mean_alpha == 1.0
    assert 0.0 < by_arm["q*"].mean_alpha < 1.0
    q = by_arm["q*"]
    assert q.greedy_accuracy == pytest.approx(correct([o.generated_text for o in greedy]).mean())
    counts = correct([o.generated_text for o in sampled]).reshape(6, 4).sum(axis=1)
    for k in (1, 2, 4):
        assert q.pass_at[k] == pytest.approx(pass_at_k(np.full(6, 4), counts, k).mean())
    assert q.pass_at[1] <= q.pass_at[2] <= q.pass_at[4]
    table = render(results)
    assert "pass@4" in table and table.count("\n") == 3


async def test_greedy_only_without_samples(fake_theta, fake_t):
    spec = reward_spec(["format"], format_pattern=PATTERN)
    config = CoordinatorConfig(theta_url=fake_theta.url, t_url=fake_t.url, top_k=8, retry_delay=0.0)
    with verifier_pool() as pool:
        async with DualVLLMCoordinator(config) as c:
            [base] = await evaluate(c, tasks(), spec, pool, SamplingParams(max_tokens=2), arms=("base",))
            with pytest.raises(ValueError, match="pass@4 needs at least 4 samples"):
                await evaluate(c, tasks(), spec, pool, SamplingParams(max_tokens=2), arms=("base",), samples=2, ks=(4,))
    assert base.pass_at == {} and base.samples == 0 and 0.0 <= base.greedy_accuracy <= 1.0


async def test_accuracy_by_group_is_each_groups_share_of_right_greedy_answers(fake_theta, fake_t):
    spec = reward_spec(["format"], format_pattern=PATTERN)
    grouped = [Task(t.prompt_ids, None, t.prompt_text, row={"level": "odd" if i % 2 else "even"} if i < 5 else {})
               for i, t in enumerate(tasks())]
    config = CoordinatorConfig(theta_url=fake_theta.url, t_url=fake_t.url, top_k=8, retry_delay=0.0)
    with verifier_pool() as pool:
        async with DualVLLMCoordinator(config) as c:
            [base] = await evaluate(c, grouped, spec, pool, SamplingParams(max_tokens=3), arms=("base",), seed=3,
                                    group_by="level")
            greedy = await c.generate_batch([t.prompt for t in grouped], max_tokens=3, temperature=0.0,
                                            fixed_alpha=0.0, seed=3)
    right = correct([o.generated_text for o in greedy])
    assert base.by_group == pytest.approx({"even": right[[0, 2, 4]].mean(), "odd": right[[1, 3]].mean(),
                                           GROUP_MISSING: float(right[5])})
    assert base.metrics()["greedy_accuracy/odd"] == base.by_group["odd"]
