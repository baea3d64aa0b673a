"""alpha*: hand-derived values, the KL-symmetry and Chernoff identities, and agreement
with a high-precision root finder on generic, near-identical and near-disjoint pairs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from scipy.optimize import brentq

from tests.unit.theory.strategies import distribution_pairs
from dualvllm.theory import alpha_kls, log_partition, solve_alpha, symmetry_gap


def exact_alpha(lp: np.ndarray, lr: np.ndarray) -> float:
    """Root of f(a) = E_{q_a}[log r - log p] on [0, 1] by Brent's method at 1e-14."""
    def f(a: float) -> float:
        return float(symmetry_gap(lp[None], lr[None], a)[0][0])

    lo, hi = f(0.0), f(1.0)
    if lo == 0 == hi:
        return 0.5
    if lo >= 0:
        return 0.0
    if hi <= 0:
        return 1.0
    return brentq(f, 0.0, 1.0, xtol=1e-14, rtol=1e-14, maxiter=500)


def test_mirror_pair_gives_one_half():
    # r is p with its support reversed: by symmetry the two KLs meet at a = 1/2.
    lp = np.log(np.array([[0.7, 0.2, 0.1]]))
    lr = lp[:, ::-1].copy()
    assert solve_alpha(lp, lr)[0] == pytest.approx(0.5, abs=1e-9)


def test_identical_distributions_give_one_half():
    lp = np.log(np.array([[0.5, 0.25, 0.25], [0.9, 0.05, 0.05]]))
    np.testing.assert_array_equal(solve_alpha(lp, lp.copy()), [0.5, 0.5])


def test_two_point_hand_value():
    # p = (1/2, 1/2), r = (e/(1+e), 1/(1+e)): l = (log 2e/(1+e), log 2/(1+e)), l1 - l2 = 1.
    # q_a ∝ (e^a, 1), so f(a) = (e^a l1 + l2) / (e^a + 1) = 0 at e^a = -l2/l1.
    lp = np.log(np.array([[0.5, 0.5]]))
    r = np.array([np.e, 1.0]) / (1 + np.e)
    lr = np.log(r)[None]
    l1, l2 = np.log(2 * np.e / (1 + np.e)), np.log(2 / (1 + np.e))
    assert solve_alpha(lp, lr)[0] == pytest.approx(np.log(-l2 / l1), abs=1e-9)


def test_unnormalized_inputs_and_mask_are_respected():
    lp = np.array([[np.log(0.6), np.log(0.3), np.log(0.1), -np.inf]])
    lr = np.array([[np.log(0.1), np.log(0.3), np.log(0.6), -np.inf]])
    mask = np.array([[True, True, True, False]])
    padded = solve_alpha(lp, lr, mask)
    scaled = solve_alpha(lp[:, :3] + 3.0, lr[:, :3] - 7.0)
    assert padded[0] == pytest.approx(scaled[0], abs=1e-12)
    assert padded[0] == pytest.approx(0.5, abs=1e-9)


def test_rows_of_different_lengths_solve_independently():
    rng = np.random.default_rng(3)
    lp1, lr1 = np.log(rng.dirichlet(np.ones(3))), np.log(rng.dirichlet(np.ones(3)))
    lp2, lr2 = np.log(rng.dirichlet(np.ones(6))), np.log(rng.dirichlet(np.ones(6)))
    mask = np.zeros((2, 6), bool)
    mask[0, :3], mask[1] = True, True
    lp = np.full((2, 6), -np.inf)
    lr = np.full((2, 6), -np.inf)
    lp[0, :3], lr[0, :3], lp[1], lr[1] = lp1, lr1, lp2, lr2
    batch = solve_alpha(lp, lr, mask)
    assert batch[0] == pytest.approx(solve_alpha(lp1[None], lr1[None])[0], abs=1e-12)
    assert batch[1] == pytest.approx(solve_alpha(lp2[None], lr2[None])[0], abs=1e-12)


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match="same shape"):
        solve_alpha(np.zeros((1, 3)), np.zeros((1, 4)))


@settings(max_examples=300, deadline=None)
@given(distribution_pairs())
def test_agrees_with_brent_to_1e5(pair):
    lp, lr = pair
    alpha = solve_alpha(lp, lr)
    assert np.all((alpha >= 0) & (alpha <= 1))
    expected = np.array([exact_alpha(lp[i], lr[i]) for i in range(lp.shape[0])])
    np.testing.assert_allclose(alpha, expected, atol=1e-5)


@settings(max_examples=200, deadline=None)
@given(distribution_pairs())
def test_gap_is_increasing_from_minus_kl_to_kl(pair):
    lp, lr = pair
    p, r = np.exp(lp), np.exp(lr)
    kl_pr = np.sum(p * (lp - lr), axis=1)
    kl_rp = np.sum(r * (lr - lp), axis=1)
    f0, _ = symmetry_gap(lp, lr, 0.0)
    f1, _ = symmetry_gap(lp, lr, 1.0)
    np.testing.assert_allclose(f0, -kl_pr, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(f1, kl_rp, rtol=1e-9, atol=1e-9)
    grid = np.linspace(0, 1, 11)
    values = np.stack([symmetry_gap(lp, lr, a)[0] for a in grid], axis=1)  # [B, 11]
    assert np.all(np.diff(values, axis=1) >= -1e-9 * (1 + np.abs(values[:, 1:])))


@settings(max_examples=200, deadline=None)
@given(distribution_pairs())
def test_derivative_is_the_variance(pair):
    lp, lr = pair
    a, h = 0.37, 1e-6
    f_plus, _ = symmetry_gap(lp, lr, a + h)
    f_minus, _ = symmetry_gap(lp, lr, a - h)
    _, var = symmetry_gap(lp, lr, a)
    np.testing.assert_allclose((f_plus - f_minus) / (2 * h), var, rtol=1e-4, atol=1e-6)


@settings(max_examples=200, deadline=None)
@given(distribution_pairs())
def test_kls_are_equal_at_alpha_star_and_equal_minus_log_z(pair):
    # The Chernoff point: at the root both KLs equal -log Z(alpha*).
    lp, lr = pair
    alpha = solve_alpha(lp, lr, tol=1e-10, max_iter=100)
    kl_theta, kl_t = alpha_kls(lp, lr, alpha)
    interior = (alpha > 1e-9) & (alpha < 1 - 1e-9)
    scale = 1e-6 * (1 + kl_theta + kl_t)
    assert np.all(np.abs(kl_theta - kl_t)[interior] <= scale[interior])
    neg_log_z = -log_partition(lp, lr, alpha, np.ones(lp.shape, bool))
    np.testing.assert_allclose(kl_theta[interior], neg_log_z[interior], rtol=1e-6, atol=1e-9)
