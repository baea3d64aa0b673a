"""Hypothesis strategies for pairs of distributions, shared by the theory tests."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


@st.composite
def distribution_pairs(draw, max_rows: int = 4, max_n: int = 40):
    """(logp_theta, logp_t) [B, n]: generic, near-identical and near-disjoint pairs."""
    rows = draw(st.integers(1, max_rows))
    n = draw(st.integers(2, max_n))
    seed = draw(st.integers(0, 2**32 - 1))
    kind = draw(st.sampled_from(["generic", "near_identical", "near_disjoint", "peaked"]))
    rng = np.random.default_rng(seed)
    scale = draw(st.floats(0.1, 8.0))
    a = rng.normal(0, scale, (rows, n))
    if kind == "generic":
        b = rng.normal(0, scale, (rows, n))
    elif kind == "near_identical":
        b = a + rng.normal(0, draw(st.floats(1e-6, 1e-3)), (rows, n))
    elif kind == "near_disjoint":
        # Each model puts almost all mass on its own half of the candidates.
        half = np.arange(n) < n // 2
        gap = draw(st.floats(10.0, 40.0))
        a = a + np.where(half, gap, 0.0)
        b = rng.normal(0, scale, (rows, n)) + np.where(half, 0.0, gap)
    else:
        b = rng.normal(0, scale, (rows, n))
        a[:, 0] += draw(st.floats(5.0, 30.0))
    return _log_softmax(a), _log_softmax(b)
