"""A difficulty curriculum over training tasks: which prompts the sampler asks for next.

    choose(count)   unseen tasks first (a seeded order, so every task gets an EMA), then a
                    weighted draw without replacement over the seen, non-skipped tasks
                    (hard buckets weigh more), then skipped tasks only if too few remain
    update(...)     each scored group: the task's reward EMA, and a skip of `skip_steps`
                    choose() calls when the group carried no advantage (all rewards equal)

Buckets come from the valleys of a Gaussian KDE over the seen tasks' EMAs
(`difficulty_buckets`); bucket 0 is the hardest (lowest EMA). A group whose rewards are
all equal gives GRPO nothing to learn from (every group advantage is 0), so its task
is rested for a while instead of being resampled at once.

Everything here is deterministic: the draw of the n-th choose() call uses a generator
seeded from (seed, n), and the whole state is a few arrays and a counter, so
`from_state(state_dict())` makes exactly the future choices an uninterrupted run makes.
numpy/scipy only: no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Sequence

import numpy as np

from dualvllm.common.errors import InvalidInputError

# Below this many seen tasks a KDE's valleys are noise: one bucket.
MIN_TASKS_FOR_KDE = 5
# EMAs spread over less than this (relative to their magnitude) are "all equal": the KDE's
# covariance would be singular.
EQUAL_RTOL = 1e-9
# A dip in log density shallower than this (about 5% in density) is float or sampling noise,
# not a valley: cutting there would change sampling weights on noise.
VALLEY_MIN_DEPTH = 0.05
# Group rewards spread over no more than this carry no advantage (float noise only).
ZERO_ADVANTAGE_ATOL = 1e-12
# SeedSequence streams, so the task order and the per-call draws never share random numbers.
ORDER_STREAM, DRAW_STREAM = 0, 1


def ema_update(ema: np.ndarray, means: np.ndarray, decay: float) -> np.ndarray:
    """decay * ema + (1 - decay) * mean, or the mean itself where ema is NaN (first group) -> [n]."""
    return np.where(np.isnan(ema), means, decay * ema + (1.0 - decay) * means)


def emas_to_json(ema: np.ndarray) -> list[float | None]:
    """Per-task EMAs for a checkpoint's JSON: strict JSON has no NaN, so unseen tasks are None."""
    return [None if math.isnan(x) else x for x in ema.tolist()]


def emas_from_json(values: Sequence[float | None]) -> np.ndarray:
    """`emas_to_json`'s inverse -> float64 [n], NaN where unseen."""
    return np.array([np.nan if x is None else x for x in values], dtype=np.float64)


def difficulty_buckets(emas: np.ndarray, grid: int = 256, min_depth: float = VALLEY_MIN_DEPTH) -> np.ndarray:
    """Bucket id per task, 0 = hardest (lowest EMA); emas [n] -> int64 [n] with ids 0..K-1, none empty.

    Method: a Gaussian KDE (scipy.stats.gaussian_kde, Scott's bandwidth n^(-1/5) * std) over
    the EMAs; its log density on `grid` evenly spaced points from min(emas) to max(emas);
    the valleys are the interior local minima of that curve that lie at least `min_depth`
    (in log density) below the lower of the two modes around them (their topographic
    prominence, scipy.signal.find_peaks on the negated curve). Each valley is a cut; a task's
    bucket is the number of cuts below its EMA, renumbered so that no bucket is empty.

    One bucket (all zeros) when there are fewer than MIN_TASKS_FOR_KDE EMAs or they are all
    equal up to EQUAL_RTOL: the KDE's covariance would be singular.
    """
    emas = np.asarray(emas, dtype=np.float64)  # [n]
    if emas.ndim != 1 or not np.all(np.isfinite(emas)):
        raise InvalidInputError(f"difficulty_buckets needs a 1-d array of finite EMAs, got shape {emas.shape}")
    if grid < 3:
        raise InvalidInputError(f"difficulty_buckets needs grid >= 3 points to find a valley, got {grid}")
    one_bucket = np.zeros(emas.shape, dtype=np.int64)
    if emas.size < MIN_TASKS_FOR_KDE:
        return one_bucket
    lo, hi = float(emas.min()), float(emas.max())
    if hi - lo <= EQUAL_RTOL * max(1.0, abs(lo), abs(hi)):
        return one_bucket
    xs = np.linspace(lo, hi, grid)  # [grid]
    from scipy.signal import find_peaks  # here, not at the top: the training config imports this module
    from scipy.stats import gaussian_kde

    log_density = gaussian_kde(emas).logpdf(xs)  # [grid], log space: far from the data the density underflows
    valleys, _ = find_peaks(-log_density, prominence=min_depth)
    cuts = xs[valleys]  # [K-1], ascending
    ids = np.searchsorted(cuts, emas, side="right")  # [n]
    return np.unique(ids, return_inverse=True)[1].astype(np.int64)


def bucket_weights(n_buckets: int, hard_weight: float) -> np.ndarray:
    """Sampling weight per bucket, hardest first: linear from `hard_weight` down to 1 -> [n_buckets]."""
    if n_buckets == 1:
        return np.ones(1)
    return np.linspace(hard_weight, 1.0, n_buckets)


def weighted_draw(weights: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
    """`count` distinct positions of positive `weights` [n], drawn one after another with
    probability proportional to weight among those left -> int64 [min(count, n)].

    Efraimidis & Spirakis (2006), "Weighted random sampling with a reservoir": the `count`
    smallest keys E_i / w_i with E_i ~ Exp(1) (equivalently the largest u_i^(1/w_i)).
    """
    assert np.all(weights > 0), "weighted_draw needs positive weights"
    keys = rng.exponential(size=weights.shape) / weights  # [n]
    return np.argsort(keys, kind="stable")[:count]


@dataclass(eq=False)
class Curriculum:
    """Per-task EMA of reward; difficulty buckets from the valleys of a Gaussian KDE over those
    EMAs; hard buckets sampled more; tasks whose groups were all-correct or all-wrong skipped
    for a while."""

    n_tasks: int  # tasks are 0..n_tasks-1, indices into the training set
    seed: int  # seeds the order of unseen tasks and every draw
    ema_decay: float = 0.7  # ema <- decay * ema + (1 - decay) * group mean reward
    skip_steps: int = 20  # a task whose last group had zero advantage sits out this many choose() calls
    hard_weight: float = 3.0  # sampling weight of the hardest bucket relative to the easiest (linear in between)
    _ema: np.ndarray = field(init=False, repr=False)  # [n_tasks] float64, NaN until the task's first group
    _skip_left: np.ndarray = field(init=False, repr=False)  # [n_tasks] int64, choose() calls left to sit out
    _offered: np.ndarray = field(init=False, repr=False)  # [n_tasks] bool, returned by choose() at least once
    _calls: int = field(init=False, repr=False, default=0)  # choose() calls so far: keys the draw

    def __post_init__(self) -> None:
        if self.n_tasks < 1:
            raise InvalidInputError(f"a curriculum needs at least one task, got n_tasks={self.n_tasks}")
        if not 0.0 <= self.ema_decay < 1.0:
            raise InvalidInputError(f"ema_decay must be in [0, 1) (1 would never move the EMA), got {self.ema_decay}")
        if self.skip_steps < 0:
            raise InvalidInputError(f"skip_steps must be >= 0 (0 never skips), got {self.skip_steps}")
        if not (math.isfinite(self.hard_weight) and self.hard_weight > 0):
            raise InvalidInputError(
                f"hard_weight must be a positive number (1 = no preference), got {self.hard_weight}"
            )
        self._ema = np.full(self.n_tasks, np.nan)
        self._skip_left = np.zeros(self.n_tasks, dtype=np.int64)
        self._offered = np.zeros(self.n_tasks, dtype=bool)
        self._calls = 0

    def choose(self, count: int) -> list[int]:
        """Task indices for the next batch: unseen tasks first (in a seeded order, so every task
        gets an EMA), then a weighted draw without replacement over the non-skipped seen tasks by
        bucket weight; falls back to skipped tasks only if too few remain. Deterministic given
        the seed and the history of update() calls.

        Never repeats a task within a call, so `count` may not exceed n_tasks. Each call counts
        down every task's skip by one.
        """
        if not 0 <= count <= self.n_tasks:
            raise InvalidInputError(
                f"choose({count}): a batch holds 0..{self.n_tasks} distinct tasks; "
                "lower prompts_per_step or add training tasks"
            )
        rng = np.random.default_rng([self._entropy, DRAW_STREAM, self._calls])
        seen = ~np.isnan(self._ema)  # [n_tasks]
        order = self._unseen_order()
        picked = order[~self._offered[order] & ~seen[order]][:count]
        free = np.ones(self.n_tasks, dtype=bool)
        free[picked] = False
        pool = np.flatnonzero(free & seen & (self._skip_left == 0))
        drawn = pool[weighted_draw(self._task_weights()[pool], count - picked.size, rng)]
        free[drawn] = False
        # Too few eligible tasks: the ones closest to eligible (never-scored tasks count as 0 left).
        rest = np.flatnonzero(free)
        soonest = rest[np.lexsort((rng.random(rest.size), self._skip_left[rest]))]
        chosen = np.concatenate([picked, drawn, soonest[: count - picked.size - drawn.size]])
        self._offered[chosen] = True
        self._skip_left = np.maximum(self._skip_left - 1, 0)
        self._calls += 1
        return [int(i) for i in chosen]

    def update(self, task_indices: Sequence[int], group_rewards: Sequence[Sequence[float]]) -> None:
        """Record one batch's groups (rewards of each task's rollouts): `group_rewards[i]` are the
        rewards of task `task_indices[i]`. Checks everything before changing anything."""
        if len(task_indices) != len(group_rewards):
            raise InvalidInputError(
                f"curriculum update got {len(task_indices)} task indices but "
                f"{len(group_rewards)} reward groups; pass one group of rewards per task"
            )
        tasks = np.asarray(task_indices)
        if tasks.ndim != 1 or (tasks.size and not np.issubdtype(tasks.dtype, np.integer)):
            raise InvalidInputError(
                f"curriculum task indices must be a flat sequence of integers, got {list(task_indices)[:5]}"
            )
        tasks = tasks.astype(np.int64)  # [B]
        outside = tasks[(tasks < 0) | (tasks >= self.n_tasks)]
        if outside.size:
            raise InvalidInputError(
                f"curriculum task index {int(outside[0])} is outside 0..{self.n_tasks - 1}; "
                "pass indices into the training set the curriculum was built for"
            )
        unique, counts = np.unique(tasks, return_counts=True)
        if np.any(counts > 1):
            raise InvalidInputError(
                f"task {int(unique[counts > 1][0])} has more than one group in one update; "
                "merge its rewards into one group"
            )
        groups = [np.asarray(g, dtype=np.float64) for g in group_rewards]
        for task, rewards in zip(tasks, groups):
            if rewards.ndim != 1 or rewards.size == 0 or not np.all(np.isfinite(rewards)):
                raise InvalidInputError(
                    f"task {int(task)}'s group needs one or more finite rewards, got "
                    f"{rewards.tolist()}; leave out groups with no scored rollout"
                )
        means = np.array([g.mean() for g in groups], dtype=np.float64)  # [B]
        spreads = np.array([np.ptp(g) for g in groups], dtype=np.float64)  # [B]
        self._ema[tasks] = ema_update(self._ema[tasks], means, self.ema_decay)
        self._skip_left[tasks] = np.where(spreads <= ZERO_ADVANTAGE_ATOL, self.skip_steps, 0)

    def observe(self, task_indices: Sequence[int], groups: Sequence[Sequence[Any]]) -> None:
        """`update` with the rewards of each group's rollouts (dualvllm.training.rollouts.Chooser)."""
        self.update(task_indices, [[r.reward for r in group] for group in groups])

    def buckets(self) -> list[list[int]]:
        """Seen tasks grouped by difficulty (hardest first), split at the KDE's density minima
        (valleys) between the EMAs; one bucket when there are too few seen tasks (< 5) or the
        EMAs are (nearly) all equal; no bucket when no task has been seen."""
        seen = np.flatnonzero(~np.isnan(self._ema))
        if not seen.size:
            return []
        ids = difficulty_buckets(self._ema[seen])
        return [seen[ids == b].tolist() for b in range(int(ids.max()) + 1)]

    def stats(self) -> dict[str, float]:
        """For metrics.jsonl: curriculum/bucket_0 (hardest) ... sizes, curriculum/buckets,
        curriculum/skipped (sitting out now), curriculum/seen, curriculum/mean_ema (NaN if none seen)."""
        buckets = self.buckets()
        seen = ~np.isnan(self._ema)
        out = {f"curriculum/bucket_{i}": float(len(b)) for i, b in enumerate(buckets)}
        out["curriculum/buckets"] = float(len(buckets))
        out["curriculum/skipped"] = float(np.count_nonzero(self._skip_left))
        out["curriculum/seen"] = float(np.count_nonzero(seen))
        out["curriculum/mean_ema"] = float(self._ema[seen].mean()) if seen.any() else float("nan")
        return out

    def state_dict(self) -> dict[str, Any]:
        """JSON-serializable (strict JSON: unseen EMAs are None), for checkpoints."""
        return {
            "n_tasks": self.n_tasks,
            "seed": self.seed,
            "ema_decay": self.ema_decay,
            "skip_steps": self.skip_steps,
            "hard_weight": self.hard_weight,
            "calls": self._calls,
            "ema": emas_to_json(self._ema),
            "skip_left": self._skip_left.tolist(),
            "offered": self._offered.tolist(),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Curriculum:
        """The curriculum `state_dict()` was taken from: resumed, it makes identical future choices."""
        try:
            curriculum = cls(
                n_tasks=state["n_tasks"],
                seed=state["seed"],
                ema_decay=state["ema_decay"],
                skip_steps=state["skip_steps"],
                hard_weight=state["hard_weight"],
            )
            ema = emas_from_json(state["ema"])
            skip_left = np.array(state["skip_left"], dtype=np.int64)
            offered = np.array(state["offered"], dtype=bool)
            calls = int(state["calls"])
        except KeyError as exc:
            raise InvalidInputError(f"curriculum state lacks {exc}; pass a dict from Curriculum.state_dict()") from exc
        for name, array in (("ema", ema), ("skip_left", skip_left), ("offered", offered)):
            if array.shape != (curriculum.n_tasks,):
                raise InvalidInputError(
                    f"curriculum state holds {array.size} '{name}' entries for "
                    f"n_tasks={curriculum.n_tasks}; the state belongs to another training set"
                )
        curriculum._ema, curriculum._skip_left, curriculum._offered, curriculum._calls = ema, skip_left, offered, calls
        return curriculum

    @property
    def _entropy(self) -> int:
        return self.seed % 2**64  # SeedSequence takes non-negative ints; the config allows any seed

    def _unseen_order(self) -> np.ndarray:
        return np.random.default_rng([self._entropy, ORDER_STREAM]).permutation(self.n_tasks)

    def _task_weights(self) -> np.ndarray:
        """Each seen task's bucket weight, 0 for unseen tasks -> [n_tasks]."""
        seen = np.flatnonzero(~np.isnan(self._ema))
        weights = np.zeros(self.n_tasks)
        if seen.size:
            ids = difficulty_buckets(self._ema[seen])
            weights[seen] = bucket_weights(int(ids.max()) + 1, self.hard_weight)[ids]
        return weights
