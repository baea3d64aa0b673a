"""The difficulty curriculum: KDE-valley buckets, EMAs and weights by hand, and choose()'s
contract (unseen first, no repeats, skips, hard buckets favoured, resumable)."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualvllm.training.curriculum import Curriculum, bucket_weights, difficulty_buckets, ema_update, weighted_draw

HARD = [1.0] + [0.0] * 9  # mean 0.1, has advantage
EASY = [1.0] * 9 + [0.0]  # mean 0.9, has advantage


def seen_curriculum(rewards: list[list[float]], **options) -> Curriculum:
    """A curriculum whose tasks have all been chosen once and given these groups."""
    curriculum = Curriculum(n_tasks=len(rewards), seed=0, **options)
    chosen = curriculum.choose(len(rewards))
    curriculum.update(chosen, [rewards[i] for i in chosen])
    return curriculum


def test_ema_update_by_hand():
    ema = np.array([np.nan, 0.5, 1.0])
    means = np.array([0.25, 1.0, 0.0])
    # First group: the mean itself; then 0.7 * 0.5 + 0.3 * 1.0 = 0.65 and 0.7 * 1.0 + 0.3 * 0.0 = 0.7.
    np.testing.assert_allclose(ema_update(ema, means, 0.7), [0.25, 0.65, 0.7])


def test_bucket_weights_by_hand():
    np.testing.assert_allclose(bucket_weights(3, 3.0), [3.0, 2.0, 1.0])
    np.testing.assert_allclose(bucket_weights(2, 5.0), [5.0, 1.0])
    np.testing.assert_allclose(bucket_weights(1, 3.0), [1.0])


def test_two_separated_clusters_split_between_them():
    # Scott's bandwidth: 6^(-1/5) * std = 0.699 * 0.41 = 0.29; the clusters are ~0.8 = 2.8
    # bandwidths apart (> 2, so the mixture is bimodal) and the valley is near 0.5.
    emas = np.array([0.1, 0.12, 0.9, 0.88, 0.11, 0.91])
    np.testing.assert_array_equal(difficulty_buckets(emas), [0, 0, 1, 1, 0, 1])


def test_three_clusters_hardest_first():
    # 60 points: bandwidth 60^(-1/5) * 0.41 = 0.18, clusters 0.5 = 2.7 bandwidths apart.
    spread = np.linspace(0.0, 0.04, 20)
    emas = np.concatenate([0.5 + spread, 1.0 - spread, spread])
    np.testing.assert_array_equal(difficulty_buckets(emas), [1] * 20 + [2] * 20 + [0] * 20)


def test_one_cluster_is_one_bucket():
    # Evenly spaced, spacing 0.02 < bandwidth 11^(-1/5) * 0.066 = 0.041: a single smooth mode.
    np.testing.assert_array_equal(difficulty_buckets(np.linspace(0.4, 0.6, 11)), [0] * 11)


def test_too_few_tasks_is_one_bucket():
    np.testing.assert_array_equal(difficulty_buckets(np.array([0.0, 1.0, 0.0, 1.0])), [0, 0, 0, 0])
    assert difficulty_buckets(np.array([])).shape == (0,)


@pytest.mark.parametrize("emas", [np.full(10, 0.5), np.full(10, 0.0), np.r_[np.full(9, 0.5), 0.5 + 1e-15]])
def test_all_equal_is_one_bucket_without_warnings(emas):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(difficulty_buckets(emas), [0] * 10)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=0, max_size=40))
def test_buckets_are_contiguous_in_ema_and_numbered_from_hardest(values):
    emas = np.array(values)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ids = difficulty_buckets(emas)
    order = np.argsort(emas, kind="stable")
    assert np.all(np.diff(ids[order]) >= 0)  # a lower EMA is never in an easier bucket
    if emas.size:
        assert set(ids.tolist()) == set(range(ids.max() + 1))  # no empty bucket


def test_weighted_draw_is_distinct_and_proportional():
    rng = np.random.default_rng(0)
    assert sorted(weighted_draw(np.array([1.0, 2.0, 5.0]), 5, rng).tolist()) == [0, 1, 2]
    # First pick of each draw: P = w / sum w = (0.125, 0.25, 0.625).
    firsts = np.bincount([weighted_draw(np.array([1.0, 2.0, 5.0]), 2, rng)[0] for _ in range(4000)], minlength=3)
    np.testing.assert_allclose(firsts / 4000, [0.125, 0.25, 0.625], atol=0.02)


def test_unseen_tasks_come_first_in_a_seeded_order():
    curriculum = Curriculum(n_tasks=10, seed=3)
    first = curriculum.choose(4)
    curriculum.update(first, [HARD] * 4)  # seen tasks with signal: eligible, yet unseen ones go first
    second = curriculum.choose(4)
    third = curriculum.choose(4)
    assert len(set(first + second + third[:2])) == 10  # the first pass covers every task once
    assert set(third[2:]) <= set(first)  # then seen, eligible tasks
    again = Curriculum(n_tasks=10, seed=3)
    assert again.choose(10) == first + second + third[:2]  # the same seed, the same order
    assert Curriculum(n_tasks=10, seed=4).choose(10) != first + second + third[:2]


@pytest.mark.parametrize("count", [0, 1, 7, 12])
def test_choose_never_repeats_within_a_call(count):
    curriculum = seen_curriculum([HARD] * 6 + [EASY] * 6)
    for _ in range(20):
        chosen = curriculum.choose(count)
        assert len(chosen) == count == len(set(chosen)) and all(0 <= i < 12 for i in chosen)


def test_choose_refuses_more_than_all_tasks():
    with pytest.raises(ValueError, match=r"choose\(4\).*0\.\.3 distinct tasks"):
        Curriculum(n_tasks=3, seed=0).choose(4)


def test_zero_advantage_task_sits_out_exactly_skip_steps_calls():
    # Task 5 is all-wrong (EMA 0) and alone in the hardest bucket, weighted 1000 to 1: once
    # eligible again, choose(1) picks it; while skipped, the five others are drawn.
    curriculum = seen_curriculum([EASY] * 5 + [[0.0] * 10], skip_steps=3, hard_weight=1000.0)
    assert curriculum.buckets() == [[5], [0, 1, 2, 3, 4]]
    assert curriculum.stats()["curriculum/skipped"] == 1.0
    assert all(curriculum.choose(1) != [5] for _ in range(3))
    assert curriculum.stats()["curriculum/skipped"] == 0.0
    assert curriculum.choose(1) == [5]


def test_an_equal_group_skips_again_and_a_group_with_signal_clears_the_skip():
    curriculum = seen_curriculum([EASY] * 5 + [[0.0] * 10], skip_steps=3)
    curriculum.update([5], [[1.0, 1.0]])  # all right this time: skipped again
    assert 5 not in curriculum.choose(5)  # five eligible tasks remain: no fallback needed
    curriculum.update([5], [[1.0, 0.0]])  # a group with signal: eligible at once
    assert curriculum.stats()["curriculum/skipped"] == 0.0


def test_skipped_tasks_fill_in_only_when_too_few_remain():
    curriculum = seen_curriculum([EASY] * 4 + [[1.0, 1.0]] * 2, skip_steps=10)
    assert sorted(curriculum.choose(4)) == [0, 1, 2, 3]
    assert sorted(curriculum.choose(6)) == [0, 1, 2, 3, 4, 5]


def test_hard_bucket_is_drawn_about_hard_weight_times_as_often():
    curriculum = seen_curriculum([HARD] * 5 + [EASY] * 5, hard_weight=3.0)
    assert curriculum.buckets() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    counts = np.bincount([curriculum.choose(1)[0] for _ in range(2000)], minlength=10)
    # One draw per call: P(a hard task) = 3 / (5 * 3 + 5 * 1) = 0.15, an easy one 0.05.
    assert counts[:5].sum() / counts[5:].sum() == pytest.approx(3.0, rel=0.1)
    assert counts[:5].min() > counts[5:].max()


def test_state_round_trip_makes_the_same_choices():
    live = seen_curriculum([HARD] * 4 + [EASY] * 4 + [[0.0, 0.0]] * 2, skip_steps=2)
    live.choose(3)
    resumed = Curriculum.from_state(json.loads(json.dumps(live.state_dict(), allow_nan=False)))
    for step in range(6):
        a, b = live.choose(4), resumed.choose(4)
        assert a == b
        rewards = [[float((step + i) % 2), 1.0] for i in range(4)]
        live.update(a, rewards)
        resumed.update(b, rewards)
    assert live.state_dict() == resumed.state_dict()


def test_from_state_refuses_another_training_set():
    state = Curriculum(n_tasks=4, seed=0).state_dict()
    with pytest.raises(ValueError, match="5 'ema' entries for n_tasks=4"):
        Curriculum.from_state({**state, "ema": [None] * 5})
    with pytest.raises(ValueError, match="lacks 'calls'"):
        Curriculum.from_state({k: v for k, v in state.items() if k != "calls"})


@pytest.mark.parametrize(("indices", "rewards", "message"), [
    ([0, 1], [[1.0, 0.0]], "2 task indices but 1 reward groups"),
    ([4], [[1.0, 0.0]], "task index 4 is outside 0..3"),
    ([-1], [[1.0, 0.0]], "task index -1 is outside 0..3"),
    ([1, 1], [[1.0], [0.0]], "task 1 has more than one group"),
    ([2], [[]], "task 2's group needs one or more finite rewards"),
    ([2], [[1.0, float("nan")]], "task 2's group needs one or more finite rewards"),
    ([0.5], [[1.0]], "must be a flat sequence of integers"),
])
def test_update_validates_its_input_and_changes_nothing_on_error(indices, rewards, message):
    curriculum = Curriculum(n_tasks=4, seed=0)
    before = curriculum.state_dict()
    with pytest.raises(ValueError, match=message):
        curriculum.update(indices, rewards)
    assert curriculum.state_dict() == before


def test_stats_report_buckets_skips_seen_and_mean_ema():
    curriculum = Curriculum(n_tasks=8, seed=0)
    assert curriculum.stats() == pytest.approx({"curriculum/buckets": 0.0, "curriculum/skipped": 0.0,
                                                "curriculum/seen": 0.0, "curriculum/mean_ema": float("nan")},
                                               nan_ok=True)
    curriculum.update([0, 1, 2, 3, 4, 5], [HARD, HARD, HARD, EASY, EASY, [1.0, 1.0]])
    # EMAs 0.1, 0.1, 0.1, 0.9, 0.9, 1.0: mean 3.1 / 6; task 5 had no advantage.
    assert curriculum.stats() == pytest.approx({"curriculum/bucket_0": 3.0, "curriculum/bucket_1": 3.0,
                                                "curriculum/buckets": 2.0, "curriculum/skipped": 1.0,
                                                "curriculum/seen": 6.0, "curriculum/mean_ema": 3.1 / 6})


@pytest.mark.parametrize("options", [dict(n_tasks=0), dict(ema_decay=1.0), dict(ema_decay=-0.1),
                                     dict(skip_steps=-1), dict(hard_weight=0.0)])
def test_bad_options_are_refused(options):
    with pytest.raises(ValueError):
        Curriculum(**{"n_tasks": 4, "seed": 0, **options})
