"""q* log-probabilities, temperature, sampling and the per-token diagnostics."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from scipy.stats import chisquare

from tests.unit.theory.strategies import distribution_pairs
from dualvllm.theory import (
    DIAGNOSTIC_KEYS,
    apply_temperature,
    greedy_indices,
    log_partition,
    mixture_logprobs,
    sample_indices,
    solve_alpha,
    summarize,
    token_diagnostics,
)

LP = np.log(np.array([[0.7, 0.2, 0.1]]))
LR = np.log(np.array([[0.1, 0.3, 0.6]]))
ALL = np.ones((1, 3), bool)


def test_endpoints_are_the_two_models():
    np.testing.assert_allclose(mixture_logprobs(LP, LR, 0.0, ALL), LP, atol=1e-12)
    np.testing.assert_allclose(mixture_logprobs(LP, LR, 1.0, ALL), LR, atol=1e-12)


def test_mixture_by_hand_at_one_half():
    # q_1/2 ∝ sqrt(p r) = (sqrt(.07), sqrt(.06), sqrt(.06)).
    unnorm = np.sqrt(np.array([0.07, 0.06, 0.06]))
    np.testing.assert_allclose(np.exp(mixture_logprobs(LP, LR, 0.5, ALL))[0], unnorm / unnorm.sum())
    assert log_partition(LP, LR, 0.5, ALL)[0] == pytest.approx(np.log(unnorm.sum()))


def test_temperature_by_hand_and_per_row():
    lp = np.log(np.array([[0.8, 0.2], [0.8, 0.2]]))
    out = apply_temperature(lp, np.array([1.0, 2.0]), np.ones((2, 2), bool))
    np.testing.assert_allclose(np.exp(out[0]), [0.8, 0.2])
    np.testing.assert_allclose(np.exp(out[1]), np.sqrt([0.8, 0.2]) / np.sqrt([0.8, 0.2]).sum())
    with pytest.raises(ValueError, match="temperature must be > 0"):
        apply_temperature(lp, 0.0, np.ones((2, 2), bool))


def test_masked_entries_stay_out():
    lp = np.array([[np.log(0.5), np.log(0.5), -np.inf]])
    mask = np.array([[True, True, False]])
    logq = mixture_logprobs(lp, lp, 0.3, mask)
    assert np.isneginf(logq[0, 2])
    np.testing.assert_allclose(np.exp(logq[0, :2]), [0.5, 0.5])
    assert greedy_indices(np.array([[-1.0, -2.0, 5.0]]), mask)[0] == 0


def test_inverse_cdf_picks_by_hand():
    logq = np.array([[-np.inf, np.log(0.25), np.log(0.75)], [np.log(0.5), np.log(0.5), -np.inf]])
    mask = np.ones((2, 3), bool)
    # u = 0 never lands on a zero-probability candidate; u just below 1 takes the last positive one.
    np.testing.assert_array_equal(sample_indices(logq, mask, np.array([0.0, 0.0])), [1, 0])
    np.testing.assert_array_equal(sample_indices(logq, mask, np.array([0.2499, 0.5])), [1, 1])
    np.testing.assert_array_equal(sample_indices(logq, mask, np.array([0.25, 0.999999])), [2, 1])


def test_sampling_matches_q_chi_square():
    logq = mixture_logprobs(LP, LR, 0.4, ALL)
    q = np.exp(logq[0])
    rng = np.random.default_rng(1234)
    draws = 20_000
    batch = np.repeat(logq, draws, axis=0)
    counts = np.bincount(sample_indices(batch, np.ones_like(batch, bool), rng.random(draws)), minlength=3)
    assert chisquare(counts, q * draws).pvalue > 1e-3


@settings(max_examples=200, deadline=None)
@given(distribution_pairs())
def test_ess_closed_forms_for_the_geometric_family(pair):
    # For q = q_a: sum p²/q = Z(-a) Z(a) and sum r²/q = Z(2-a) Z(a).
    lp, lr = pair
    mask = np.ones(lp.shape, bool)
    for a in (0.0, 0.3, 0.5, 0.9):
        logq = mixture_logprobs(lp, lr, a, mask)
        diag = token_diagnostics(lp, lr, logq, mask, np.ones(lp.shape[0]), np.ones(lp.shape[0]))
        log_z = log_partition(lp, lr, a, mask)
        np.testing.assert_allclose(np.log(diag["ess_theta"]),
                                   -(log_z + log_partition(lp, lr, -a, mask)), rtol=1e-7, atol=1e-9)
        np.testing.assert_allclose(np.log(diag["ess_t"]),
                                   -(log_z + log_partition(lp, lr, 2 - a, mask)), rtol=1e-7, atol=1e-9)
        assert np.all((diag["ess_theta"] <= 1 + 1e-9) & (diag["ess_t"] <= 1 + 1e-9))


@settings(max_examples=200, deadline=None)
@given(distribution_pairs())
def test_diagnostics_at_alpha_star(pair):
    lp, lr = pair
    mask = np.ones(lp.shape, bool)
    alpha = solve_alpha(lp, lr, tol=1e-10, max_iter=100)
    logq = mixture_logprobs(lp, lr, alpha, mask)
    diag = token_diagnostics(lp, lr, logq, mask, np.full(lp.shape[0], 0.9), np.full(lp.shape[0], 0.8))
    assert set(diag) == set(DIAGNOSTIC_KEYS)
    interior = (alpha > 1e-9) & (alpha < 1 - 1e-9)
    scale = 1e-6 * (1 + diag["kl_theta"] + diag["kl_t"])
    assert np.all(np.abs(diag["kl_diff"][interior]) <= scale[interior])
    np.testing.assert_allclose(diag["ess_ratio"], diag["ess_theta"] / diag["ess_t"])
    q = np.exp(logq)
    np.testing.assert_allclose(diag["entropy_q"], -np.sum(q * logq, axis=1), atol=1e-9)
    assert np.all(diag["entropy_q"] >= -1e-12)
    assert np.all(diag["entropy_q"] <= np.log(lp.shape[1]) + 1e-9)
    np.testing.assert_array_equal(diag["coverage_theta"], 0.9)


def test_diagnostics_by_hand_when_q_is_p():
    diag = token_diagnostics(LP, LR, LP, ALL, np.array([1.0]), np.array([1.0]))
    p, r = np.exp(LP[0]), np.exp(LR[0])
    assert diag["kl_theta"][0] == pytest.approx(0.0, abs=1e-12)
    assert diag["kl_t"][0] == pytest.approx(np.sum(p * np.log(p / r)))
    assert diag["ess_theta"][0] == pytest.approx(1.0)
    assert diag["ess_t"][0] == pytest.approx(1.0 / np.sum(r**2 / p))
    assert diag["entropy_q"][0] == pytest.approx(-np.sum(p * np.log(p)))


def test_summarize():
    out = summarize({"kl_t": np.array([1.0, 3.0]), "empty": np.array([])})
    assert out == {"kl_t": {"mean": 2.0, "std": 1.0, "min": 1.0, "max": 3.0}}


@settings(max_examples=200, deadline=None)
@given(distribution_pairs(max_n=60))
def test_mass_outside_the_candidate_set_obeys_the_holder_bound(pair):
    # THEORY.md section 5: q_a(V \\ S) <= (1 - p(S))^(1-a) (1 - r(S))^a / Z(a) for any set S.
    lp, lr = pair
    mask = np.ones(lp.shape, bool)
    k = max(1, lp.shape[1] // 4)
    rows = np.arange(lp.shape[0])[:, None]
    in_s = np.zeros(lp.shape, bool)
    in_s[rows, np.argsort(-lp, axis=1)[:, :k]] = True  # S = union of both top-k lists
    in_s[rows, np.argsort(-lr, axis=1)[:, :k]] = True
    for a in (0.2, 0.5, 0.8):
        q = np.exp(mixture_logprobs(lp, lr, a, mask))
        outside = np.sum(np.where(in_s, 0.0, q), axis=1)
        # Summed outside S, not as 1 - p(S): that difference cancels catastrophically.
        uncovered_p = np.sum(np.where(in_s, 0.0, np.exp(lp)), axis=1)
        uncovered_r = np.sum(np.where(in_s, 0.0, np.exp(lr)), axis=1)
        bound = uncovered_p ** (1 - a) * uncovered_r ** a / np.exp(log_partition(lp, lr, a, mask))
        assert np.all(outside <= bound * (1 + 1e-9) + 1e-12)
