"""pass@k against hand values, the binomial formula, and its meaning."""

from __future__ import annotations

from math import comb

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dualvllm.theory.passk import pass_at_k


def test_hand_values():
    # n=4, c=1, k=1: 1/4. n=4, c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6 = 1/2.
    # n=4, c=2, k=2: 1 - C(2,2)/C(4,2) = 1 - 1/6. n=4, c=3, k=2: n-c < k, so 1. c=0: 0.
    got = pass_at_k([4, 4, 4, 4, 4], [1, 1, 2, 3, 0], 2)
    np.testing.assert_allclose(got, [0.5, 0.5, 5 / 6, 1.0, 0.0])
    np.testing.assert_allclose(pass_at_k([4, 8], [1, 2], 1), [0.25, 0.25])  # pass@1 = c / n


@given(st.integers(1, 60).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_equals_the_binomial_formula(case):
    n, c, k = case
    expected = 1.0 - comb(n - c, k) / comb(n, k)
    assert pass_at_k([n], [c], k)[0] == pytest.approx(expected, abs=1e-12)


def test_is_the_chance_that_k_drawn_samples_hold_a_correct_one():
    rng = np.random.default_rng(0)
    n, c, k = 10, 3, 4
    samples = np.array([1] * c + [0] * (n - c))
    draws = np.array([rng.choice(samples, size=k, replace=False).any() for _ in range(20_000)])
    assert draws.mean() == pytest.approx(pass_at_k([n], [c], k)[0], abs=0.01)


@pytest.mark.parametrize("n, c, k", [([3], [1], 4), ([4], [5], 1), ([4], [-1], 1), ([4], [1], 0)])
def test_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="needs 1 <= k <= n"):
        pass_at_k(n, c, k)
