"""Per-prompt regimes of the adaptive recipe: pass-rate EMAs, switching with hysteresis, draws, resume."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualvllm.common.errors import InvalidInputError
from dualvllm.training.regimes import ALWAYS, NEVER, SOMETIMES, Regimes


def test_a_prompt_moves_between_regimes_with_hysteresis():
    regimes = Regimes(n_tasks=3, seed=0, decay=0.5)
    assert regimes.regimes([0, 1, 2]) == [NEVER] * 3  # unseen prompts start guided, with probes
    regimes.update([0, 1, 2], [[False] * 2, [True, False], [True] * 2])  # their probes
    assert regimes.regimes([0, 1, 2]) == [NEVER, SOMETIMES, SOMETIMES]
    regimes.update([2], [[True] * 4])  # EMA 1.0
    assert regimes.regimes([0, 1, 2]) == [NEVER, SOMETIMES, ALWAYS]
    regimes.update([0], [[True, False]])  # one success of two probes: EMA 0.25 >= never_exit
    assert regimes.regimes([0]) == [SOMETIMES]
    regimes.update([2], [[True] * 3 + [False]])  # EMA 0.875: above always_exit, stays
    assert regimes.regimes([2]) == [ALWAYS]
    regimes.update([2], [[False] * 4])  # EMA 0.4375: back to sometimes
    assert regimes.regimes([2]) == [SOMETIMES]
    regimes.update([1], [[]])  # nothing measured: unchanged
    assert regimes.stats() == {"regime/never": 0.0, "regime/sometimes": 3.0, "regime/always": 0.0,
                               "regime/unseen": 0.0}


def test_in_the_band_a_prompt_keeps_its_regime():
    regimes = Regimes(n_tasks=2, seed=0, decay=0.0, never_enter=0.1, never_exit=0.3)
    regimes.update([0, 1], [[False] * 10, [True] * 4 + [False] * 6])  # EMAs 0.0 and 0.4
    regimes.update([1], [[True] + [False] * 9])  # 0.1: in the band, stays
    assert regimes.regimes([0, 1]) == [NEVER, SOMETIMES]
    regimes.update([0, 1], [[True, False, False, False, False], [False] * 10])  # 0.2 (in the band), 0.0
    assert regimes.regimes([0, 1]) == [NEVER, NEVER]


def test_unseen_prompts_come_first_and_solved_ones_are_drawn_rarely():
    regimes = Regimes(n_tasks=20, seed=3, solved_weight=0.05)
    first = regimes.choose(10) + regimes.choose(10)
    assert sorted(first) == list(range(20))  # every prompt once before any repeats
    regimes.update(list(range(20)), [[True] * 4 if i < 10 else [True, False] for i in range(20)])
    regimes.update(list(range(10)), [[True] * 4] * 10)  # never -> sometimes -> always
    drawn = [i for _ in range(200) for i in regimes.choose(5)]
    solved = sum(i < 10 for i in drawn) / len(drawn)
    assert solved < 0.1  # 10 of 20 prompts, at 1/20 of the weight


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.booleans(), max_size=6), min_size=8, max_size=8), st.integers(0, 2**40))
def test_a_resumed_state_makes_the_same_choices(outcomes, seed):
    regimes = Regimes(n_tasks=8, seed=seed)
    regimes.update(list(range(8)), outcomes)
    regimes.choose(3)
    resumed = Regimes.from_state(json.loads(json.dumps(regimes.state_dict())))
    assert [regimes.choose(4) for _ in range(3)] == [resumed.choose(4) for _ in range(3)]
    assert regimes.regimes(range(8)) == resumed.regimes(range(8))


@pytest.mark.parametrize(("values", "message"), [
    ({"never_enter": 0.2, "never_exit": 0.1}, "never_enter <= never_exit"),
    ({"decay": 1.0}, "decay must be in"),
    ({"solved_weight": 0.0}, "solved_weight must be in"),
])
def test_bad_settings_are_refused_with_the_rule(values, message):
    with pytest.raises(InvalidInputError, match=message):
        Regimes(n_tasks=4, seed=0, **values)


def test_bad_updates_are_refused():
    regimes = Regimes(n_tasks=4, seed=0)
    with pytest.raises(InvalidInputError, match="distinct and in 0..3"):
        regimes.update([1, 1], [[True], [False]])
    with pytest.raises(InvalidInputError, match="one per task"):
        regimes.update([1], [[True], [False]])
    with pytest.raises(InvalidInputError, match="resume with the dataset of the first run"):
        Regimes.from_state({**regimes.state_dict(), "ema": [None] * 5})
