"""The compiled step (coordinator/kernel.py) against theory/'s numpy reference, phase by phase,
on random top-k rows (servers reporting fewer than k, disjoint and identical lists, peaked and
near-uniform rows, every fill rule, temperatures, fixed and capped alpha)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualvllm.coordinator import kernel
from dualvllm.theory.alpha import solve_alpha
from dualvllm.theory.merge import merge_topk
from dualvllm.theory.mixture import apply_temperature, greedy_indices, mixture_logprobs, sample_indices
from tests.unit.theory.test_merge import topk_pairs


@settings(max_examples=300, deadline=None)
@given(topk_pairs(), st.sampled_from([None, 1000]))
def test_merge_equals_the_reference(case, vocab_size):
    (ids_theta, lp_theta, ids_t, lp_t), rule = case
    expected = merge_topk(ids_theta, lp_theta, ids_t, lp_t, fill=rule, vocab_size=vocab_size)
    got = kernel.merge(ids_theta, lp_theta, ids_t, lp_t, fill=rule, vocab_size=vocab_size)
    for field in ("token_ids", "mask", "reported_theta", "reported_t"):
        np.testing.assert_array_equal(getattr(got, field), getattr(expected, field), err_msg=field)
    for field in ("coverage_theta", "coverage_t"):
        np.testing.assert_allclose(getattr(got, field), getattr(expected, field), rtol=1e-12, err_msg=field)
    for field, reported, coverage in (("logp_theta", expected.reported_theta, expected.coverage_theta),
                                      ("logp_t", expected.reported_t, expected.coverage_t)):
        have, want = getattr(got, field), getattr(expected, field)
        np.testing.assert_array_equal(have[reported], want[reported], err_msg=field)  # copied, not computed
        # A "spread" fill takes log(1 - coverage): both sum the coverage, in different orders (numpy
        # pairwise; up to 64 terms, each off by an ulp), and the subtraction scales that by 1 / (1 - coverage).
        slack = 1e-12 + (64 * 2.2e-16 / np.maximum(1.0 - coverage, 1e-300) if rule == "spread" else np.zeros_like(coverage))
        gap = np.abs(np.where(expected.mask, have, 0.0) - np.where(expected.mask, want, 0.0))  # [B, n]
        assert np.all(gap <= slack[:, None]), f"{field}: fill values differ by {gap.max():.3g}"
        assert np.all(np.isneginf(have[~expected.mask])), f"{field}: padding must be -inf"


@st.composite
def steps(draw):
    """Top-k rows and, per row, a temperature (0 = greedy), a fixed alpha or NaN, a cap, a uniform."""
    (ids_theta, lp_theta, ids_t, lp_t), rule = draw(topk_pairs())
    rows = ids_theta.shape[0]
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    temperature = rng.choice([0.0, 0.3, 1.0, 1.7], rows)
    fixed = np.where(rng.random(rows) < 0.3, rng.random(rows), np.nan)
    caps = draw(st.sampled_from([None, rng.uniform(0.0, 1.0, rows)]))
    return (ids_theta, lp_theta, ids_t, lp_t), rule, temperature, fixed, caps, rng.random(rows)


def reference_target(merged, temperature, fixed, caps, tol=1e-6, max_iter=20):
    """dualvllm.coordinator.step.solve_target as it was before the kernel: theory/ calls, vectorized."""
    mask = merged.mask
    temps = np.where(temperature == 0.0, 1.0, temperature)
    lp_theta = apply_temperature(merged.logp_theta, temps, mask)
    lp_t = apply_temperature(merged.logp_t, temps, mask)
    alpha = fixed.copy()
    solve = np.isnan(alpha)
    if solve.any():
        alpha[solve] = solve_alpha(lp_theta[solve], lp_t[solve], mask[solve], tol=tol, max_iter=max_iter)
    if caps is not None:
        alpha = np.where(solve, np.minimum(alpha, caps), alpha)
    return lp_theta, lp_t, alpha, mixture_logprobs(lp_theta, lp_t, alpha, mask)


@settings(max_examples=300, deadline=None)
@given(steps())
def test_alpha_q_and_the_draw_equal_the_reference(case):
    lists, rule, temperature, fixed, caps, uniforms = case
    merged = merge_topk(*lists, fill=rule)
    mask = merged.mask
    expected = reference_target(merged, temperature, fixed, caps)
    got = kernel.target(merged, temperature, fixed, caps, tol=1e-6, max_iter=20)
    for name, want, have in zip(("logp_theta", "logp_t", "alpha", "logq"), expected, got):
        np.testing.assert_allclose(np.where(mask, have, 0.0) if have.ndim == 2 else have,
                                   np.where(mask, want, 0.0) if want.ndim == 2 else want,
                                   rtol=1e-9, atol=1e-9, err_msg=name)
        if have.ndim == 2:
            assert np.all(np.isneginf(have[~mask])), f"{name}: padding must be -inf"
    # The same draw from the same uniform, unless it falls on a CDF boundary within rounding.
    logq = expected[3]
    greedy = temperature == 0.0
    want = np.where(greedy, greedy_indices(logq, mask), sample_indices(logq, mask, uniforms))
    have = kernel.sample(got[3], mask, uniforms, greedy)
    cdf = np.cumsum(np.where(mask, np.exp(np.where(mask, logq, -np.inf)), 0.0), axis=1)
    on_edge = np.any(np.abs(cdf - uniforms[:, None] * cdf[:, -1:]) < 1e-9, axis=1)
    tied = np.sort(np.where(mask, logq, -np.inf), axis=1)
    tied = np.isclose(tied[:, -1], tied[:, -2], rtol=0, atol=1e-9) if logq.shape[1] > 1 else np.zeros(len(logq), bool)
    certain = ~np.where(greedy, tied, on_edge)
    np.testing.assert_array_equal(have[certain], want[certain])


def test_alpha_star_equalizes_the_two_kls_by_hand():
    """Two candidates, base (0.9, 0.1), teacher (0.1, 0.9): symmetric, so alpha* = 1/2 and q* is uniform."""
    ids = np.array([[3, 7]])
    merged = kernel.merge(ids, np.log([[0.9, 0.1]]), ids, np.log([[0.1, 0.9]]))
    _, _, alpha, logq = kernel.target(merged, np.ones(1), np.full(1, np.nan), None, tol=1e-10, max_iter=50)
    assert alpha[0] == pytest.approx(0.5, abs=1e-9)
    np.testing.assert_allclose(np.exp(logq), [[0.5, 0.5]], atol=1e-9)


def test_a_row_without_candidates_is_refused():
    merged = kernel.merge(np.array([[-1]]), np.array([[-np.inf]]), np.array([[-1]]), np.array([[-np.inf]]))
    with pytest.raises(ValueError, match="no candidates"):
        kernel.target(merged, np.ones(1), np.full(1, np.nan), None, tol=1e-6, max_iter=20)


@settings(max_examples=200, deadline=None)
@given(steps())
def test_the_fused_step_equals_its_three_phases(case):
    lists, rule, temperature, fixed, caps, uniforms = case
    merged = kernel.merge(*lists, fill=rule, vocab_size=1000)
    _, _, alpha, logq = kernel.target(merged, temperature, fixed, caps, tol=1e-6, max_iter=20)
    index = kernel.sample(logq, merged.mask, uniforms, temperature == 0.0)
    out = kernel.step(*lists, temperature=temperature, fixed_alpha=fixed, max_alpha=caps, uniforms=uniforms,
                      fill=rule, vocab_size=1000, tol=1e-6, max_iter=20)
    rows = np.arange(len(index))
    np.testing.assert_array_equal(out.candidates, merged.token_ids)
    np.testing.assert_array_equal(out.token_ids, merged.token_ids[rows, index])
    for have, want in ((out.alpha, alpha), (out.candidate_logq, logq), (out.logprob_q, logq[rows, index]),
                       (out.logprob_theta, merged.logp_theta[rows, index]), (out.logprob_t, merged.logp_t[rows, index]),
                       (out.coverage_theta, merged.coverage_theta), (out.coverage_t, merged.coverage_t)):
        np.testing.assert_array_equal(have, want)  # the same compiled code: bit for bit


@settings(max_examples=50, deadline=None)
@given(steps())
def test_the_threaded_step_equals_the_serial_one_bit_for_bit(case):
    """Rows split among numba's threads (CoordinatorConfig.step_threads) give what one thread gives."""
    lists, rule, temperature, fixed, caps, uniforms = case
    kwargs = dict(temperature=temperature, fixed_alpha=fixed, max_alpha=caps, uniforms=uniforms, fill=rule,
                  vocab_size=1000, tol=1e-6, max_iter=20)
    serial = kernel.step(*lists, **kwargs, threads=1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernel, "THREADED_MIN_ROWS", 1)  # every batch here is small: thread it anyway
        threaded = kernel.step(*lists, **kwargs, threads=4)
    for have, want in zip(threaded, serial):
        np.testing.assert_array_equal(have, want)


def test_a_small_step_stays_on_one_thread():
    assert kernel.usable_threads(8, kernel.THREADED_MIN_ROWS - 1) == 1
    assert kernel.usable_threads(1, 4096) == 1
    assert 1 <= kernel.usable_threads(8, 4096) <= 8
