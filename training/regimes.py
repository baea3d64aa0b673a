"""Each prompt's regime, from its own on-policy pass rate: what the adaptive recipe gives it.

    never      the student has not solved it lately: guided states (the teacher's or q*'s)
               with the dense teacher objective, plus a few on-policy probes to notice when
               it starts to solve it
    sometimes  GRPO on the student's own rollouts: its groups carry an advantage
    always     solved every time lately: drawn rarely (`solved_weight`), on-policy

A prompt's pass rate is an EMA over the batches it was in, of the share of its on-policy
rollouts that succeeded (guided rollouts say what the teacher can do, not the student), kept
across epochs. Regimes switch with hysteresis, so that one lucky probe does not flip a prompt
back and forth: never -> sometimes once the EMA reaches `never_exit`, sometimes -> never once
it falls below `never_enter`; sometimes -> always at `always_enter`, always -> sometimes below
`always_exit`. An unseen prompt starts in `never`: its first group teaches it (guided rollouts)
and measures it (the probes), so the first pass over a dataset, often the only one, already
guides where the base fails; starting in `sometimes` would spend that pass on on-policy groups
that carry no signal where the base never succeeds.

`choose(count)` draws a batch: prompts never chosen first (a seeded order), then a weighted draw
without replacement over the rest (weight 1, `solved_weight` for `always`). Deterministic given
the seed and the updates; `state_dict()` / `from_state()` resume it exactly. numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from collections.abc import Sequence

import numpy as np

from dualvllm.common.errors import InvalidInputError
from dualvllm.training.curriculum import ema_update, emas_from_json, emas_to_json, weighted_draw

NEVER, SOMETIMES, ALWAYS = 0, 1, 2
REGIME_NAMES = ("never", "sometimes", "always")
# SeedSequence streams: the unseen order and the per-call draws never share random numbers.
ORDER_STREAM, DRAW_STREAM = 0, 1


@dataclass(eq=False)
class Regimes:
    """Per-prompt on-policy pass-rate EMA and the regime it puts the prompt in (module docstring)."""

    n_tasks: int
    seed: int
    decay: float = 0.5  # ema <- decay * ema + (1 - decay) * share of on-policy successes in the batch
    never_enter: float = 0.05
    never_exit: float = 0.1
    always_enter: float = 0.95
    always_exit: float = 0.85
    solved_weight: float = 0.1  # draw weight of an `always` prompt against 1 for the others
    _ema: np.ndarray = field(init=False, repr=False)  # [n_tasks] float64, NaN until first measured
    _regime: np.ndarray = field(init=False, repr=False)  # [n_tasks] int64
    _offered: np.ndarray = field(init=False, repr=False)  # [n_tasks] bool, chosen at least once
    _calls: int = field(init=False, repr=False, default=0)

    def __post_init__(self) -> None:
        if self.n_tasks < 1:
            raise InvalidInputError(f"the adaptive recipe needs at least one training prompt, got {self.n_tasks}")
        if not 0.0 <= self.decay < 1.0:
            raise InvalidInputError(f"the pass-rate EMA's decay must be in [0, 1), got {self.decay}")
        if not 0.0 <= self.never_enter <= self.never_exit <= self.always_exit <= self.always_enter <= 1.0:
            raise InvalidInputError(
                "the regime thresholds must satisfy 0 <= never_enter <= never_exit <= always_exit <= always_enter "
                f"<= 1 (a band between each pair is the hysteresis), got {self.never_enter}, {self.never_exit}, "
                f"{self.always_exit}, {self.always_enter}"
            )
        if not 0.0 < self.solved_weight <= 1.0:
            raise InvalidInputError(
                f"solved_weight must be in (0, 1] (1 = drawn as often as the rest), got {self.solved_weight}"
            )
        self._ema = np.full(self.n_tasks, np.nan)
        self._regime = np.full(self.n_tasks, NEVER, dtype=np.int64)
        self._offered = np.zeros(self.n_tasks, dtype=bool)

    def regimes(self, task_indices: Sequence[int]) -> list[int]:
        """The regime of each task now (NEVER, SOMETIMES or ALWAYS)."""
        return [int(r) for r in self._regime[np.asarray(task_indices, dtype=np.int64)]]

    def choose(self, count: int) -> list[int]:
        """`count` distinct task indices for the next batch (module docstring)."""
        if not 0 <= count <= self.n_tasks:
            raise InvalidInputError(
                f"a batch holds 0..{self.n_tasks} distinct prompts, asked for {count}; lower "
                "prompts_per_step or add training prompts"
            )
        seed = self.seed % 2**64
        order = np.random.default_rng([seed, ORDER_STREAM]).permutation(self.n_tasks)
        unseen = order[~self._offered[order] & np.isnan(self._ema[order])][:count]
        rest = np.setdiff1d(np.arange(self.n_tasks), unseen)
        weights = np.where(self._regime[rest] == ALWAYS, self.solved_weight, 1.0)
        rng = np.random.default_rng([seed, DRAW_STREAM, self._calls])
        drawn = rest[weighted_draw(weights, count - unseen.size, rng)]
        chosen = np.concatenate([unseen, drawn])
        self._offered[chosen] = True
        self._calls += 1
        return [int(i) for i in chosen]

    def update(self, task_indices: Sequence[int], on_policy_successes: Sequence[Sequence[bool]]) -> None:
        """Record one batch: `on_policy_successes[i]` says which on-policy rollouts of task
        `task_indices[i]` succeeded; a task with none measured keeps its EMA and regime."""
        if len(task_indices) != len(on_policy_successes):
            raise InvalidInputError(
                f"regime update got {len(task_indices)} tasks and {len(on_policy_successes)} "
                "groups of outcomes; pass one per task"
            )
        measured = [
            (int(t), np.asarray(s, dtype=np.float64)) for t, s in zip(task_indices, on_policy_successes) if len(s)
        ]
        if not measured:
            return
        tasks = np.array([t for t, _ in measured], dtype=np.int64)  # [B]
        if tasks.min() < 0 or tasks.max() >= self.n_tasks or np.unique(tasks).size != tasks.size:
            raise InvalidInputError(
                f"regime update: task indices must be distinct and in 0..{self.n_tasks - 1}, got {tasks.tolist()[:8]}"
            )
        ema = ema_update(self._ema[tasks], np.array([s.mean() for _, s in measured]), self.decay)  # [B]
        regime = self._regime[tasks]  # [B]
        regime = np.where((regime == NEVER) & (ema >= self.never_exit), SOMETIMES, regime)
        regime = np.where((regime == ALWAYS) & (ema < self.always_exit), SOMETIMES, regime)
        was_sometimes = self._regime[tasks] == SOMETIMES
        regime = np.where(was_sometimes & (ema < self.never_enter), NEVER, regime)
        regime = np.where(was_sometimes & (ema >= self.always_enter), ALWAYS, regime)
        self._ema[tasks], self._regime[tasks] = ema, regime

    def observe(self, task_indices: Sequence[int], groups: Sequence[Sequence[Any]], success: float = 1.0) -> None:
        """`update` from each group's on-policy rollouts: a success is a reward of at least
        `success` (an exact answer, every test passed), as the evaluation counts it."""
        self.update(task_indices, [[r.reward >= success for r in group if r.on_policy] for group in groups])

    def stats(self) -> dict[str, float]:
        """For metrics.jsonl: how many prompts are in each regime (regime/<name>), and how many were measured."""
        seen = ~np.isnan(self._ema)
        counts = {
            f"regime/{name}": float(np.count_nonzero(seen & (self._regime == code)))
            for code, name in enumerate(REGIME_NAMES)
        }
        return counts | {"regime/unseen": float(np.count_nonzero(~seen))}

    def state_dict(self) -> dict[str, Any]:
        """JSON-serializable (unseen EMAs are None), for checkpoints."""
        return {
            "n_tasks": self.n_tasks,
            "seed": self.seed,
            "decay": self.decay,
            "never_enter": self.never_enter,
            "never_exit": self.never_exit,
            "always_enter": self.always_enter,
            "always_exit": self.always_exit,
            "solved_weight": self.solved_weight,
            "calls": self._calls,
            "ema": emas_to_json(self._ema),
            "regime": self._regime.tolist(),
            "offered": self._offered.tolist(),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Regimes:
        """The Regimes `state_dict()` was taken from: resumed, it makes the same future choices."""
        try:
            settings = {
                name: state[name]
                for name in (
                    "n_tasks",
                    "seed",
                    "decay",
                    "never_enter",
                    "never_exit",
                    "always_enter",
                    "always_exit",
                    "solved_weight",
                )
            }
            ema = emas_from_json(state["ema"])
            regime = np.array(state["regime"], dtype=np.int64)
            offered = np.array(state["offered"], dtype=bool)
            calls = int(state["calls"])
        except KeyError as exc:
            raise InvalidInputError(f"regime state lacks {exc}; pass a dict from Regimes.state_dict()") from exc
        regimes = cls(**settings)
        if not ema.shape == regime.shape == offered.shape == (regimes.n_tasks,):
            raise InvalidInputError(
                f"the regime state covers {ema.size} prompts and the dataset has "
                f"{regimes.n_tasks}; resume with the dataset of the first run"
            )
        regimes._ema, regimes._regime, regimes._offered, regimes._calls = ema, regime, offered, calls
        return regimes
