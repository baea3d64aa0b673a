"""Exact q* from two full next-token distributions, and a chi-square check of samples.

Independent of `theory` on purpose (Brent's method, plain numpy), so tests that use it
check the coordinator's math rather than repeat it.
"""

from __future__ import annotations

import numpy as np
from scipy import stats
from scipy.optimize import brentq

# Chi-square wants expected counts of at least this; rarer tokens are pooled into one bin.
MIN_EXPECTED_COUNT = 5


def exact_q_star(lp: np.ndarray, lr: np.ndarray, temperature: float = 1.0) -> tuple[np.ndarray, float]:
    """(q* over the whole vocabulary, alpha*) for two full log-distributions at a temperature."""
    lp = lp / temperature - np.logaddexp.reduce(lp / temperature)
    lr = lr / temperature - np.logaddexp.reduce(lr / temperature)
    l = lr - lp

    def q_of(a: float) -> np.ndarray:
        x = lp + a * l
        return np.exp(x - np.logaddexp.reduce(x))

    alpha = brentq(lambda a: float(q_of(a) @ l), 0.0, 1.0, xtol=1e-12)
    return q_of(alpha), alpha


def chi_square_pvalue(samples: np.ndarray, q: np.ndarray, min_bins: int = 2) -> float:
    """p-value of the hypothesis that `samples` (token ids) were drawn from `q`."""
    draws = len(samples)
    observed = np.bincount(samples, minlength=q.shape[0])
    keep = q * draws >= MIN_EXPECTED_COUNT
    assert keep.sum() >= min_bins, "the distribution should leave several plausible tokens"
    expected = np.append(q[keep], q[~keep].sum()) * draws
    counts = np.append(observed[keep], observed[~keep].sum())
    if expected[-1] < MIN_EXPECTED_COUNT:  # the pooled bin is still too rare: merge it into the last kept one
        expected = np.append(expected[:-2], expected[-2:].sum())
        counts = np.append(counts[:-2], counts[-2:].sum())
    return stats.chisquare(counts, expected * counts.sum() / expected.sum()).pvalue


def two_sample_pvalue(a: np.ndarray, b: np.ndarray) -> float:
    """p-value of the hypothesis that two samples of category ids come from one distribution.

    Categories with fewer than MIN_EXPECTED_COUNT expected draws in either sample are pooled.
    """
    categories, inverse = np.unique(np.concatenate([a, b]), return_inverse=True)
    counts = np.stack([np.bincount(inverse[:len(a)], minlength=len(categories)),
                       np.bincount(inverse[len(a):], minlength=len(categories))])  # [2, C]
    share = np.array([len(a), len(b)]) / (len(a) + len(b))
    keep = counts.sum(axis=0) * share.min() >= MIN_EXPECTED_COUNT
    assert keep.sum() >= 2, "the samples should share several frequent categories"
    table = np.column_stack([counts[:, keep], counts[:, ~keep].sum(axis=1)])
    table = table[:, table.sum(axis=0) > 0]
    return stats.chi2_contingency(table).pvalue
