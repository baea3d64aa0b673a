"""The speculative acceptance rule: hand-computed cases, and that what it keeps follows q*."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.exact_q import chi_square_pvalue
from tests.unit.theory.strategies import distribution_pairs
from dualvllm.theory.speculative import (
    NOT_A_CANDIDATE,
    acceptance_probabilities,
    decide_round,
    draft_logprobs,
    point_mass_logprobs,
    residual_logprobs,
)

# Three candidates; the drafter reports (and samples from) all three.
Q = np.log(np.array([[0.5, 0.3, 0.2]]))
P = np.log(np.array([[0.2, 0.6, 0.2]]))
ALL = np.ones((1, 3), bool)


def one_round(logq, logp, draft_index, lengths, accept_u, residual_u=None, greedy=None):
    rows = len(draft_index)
    return decide_round(logq, logp, np.ones(logq.shape, bool), np.asarray(draft_index), np.asarray(lengths),
                        np.zeros(rows, bool) if greedy is None else np.asarray(greedy), np.asarray(accept_u),
                        np.zeros(rows) if residual_u is None else np.asarray(residual_u))


def test_acceptance_is_min_one_q_over_p_by_hand():
    # x = 0: q/p = 0.5/0.2 > 1 -> 1; x = 1: 0.3/0.6 = 0.5; x = 2: 0.2/0.2 = 1.
    probs = acceptance_probabilities(np.repeat(Q, 3, 0), np.repeat(P, 3, 0), np.array([0, 1, 2]))
    np.testing.assert_allclose(probs, [1.0, 0.5, 1.0])


def test_a_token_outside_the_candidates_or_the_drafters_top_k_is_rejected():
    logp = np.array([[np.log(0.5), np.log(0.5), -np.inf]])  # candidate 2 is not in the drafter's top-k
    probs = acceptance_probabilities(np.repeat(Q, 2, 0), np.repeat(logp, 2, 0), np.array([NOT_A_CANDIDATE, 2]))
    np.testing.assert_array_equal(probs, [0.0, 0.0])


def test_residual_by_hand():
    # max(0, q - p) = (0.3, 0, 0): a rejection always emits candidate 0.
    np.testing.assert_allclose(np.exp(residual_logprobs(Q, P, ALL)), [[1.0, 0.0, 0.0]])
    # p = (0.1, 0.1, 0.8): max(0, q - p) = (0.4, 0.2, 0), normalized (2/3, 1/3, 0).
    np.testing.assert_allclose(np.exp(residual_logprobs(Q, np.log([[0.1, 0.1, 0.8]]), ALL)), [[2 / 3, 1 / 3, 0.0]])


def test_residual_of_equal_distributions_is_the_target():
    np.testing.assert_allclose(residual_logprobs(Q, Q, ALL), Q)


def test_draft_logprobs_are_the_top_k_at_the_temperature():
    raw = np.log(np.array([[0.6, 0.3, 0.1]]))
    reported = np.array([[True, True, False]])  # candidate 2 is a fill, not the drafter's
    # T = 0.5: p ∝ (0.36, 0.09) over the two reported -> (0.8, 0.2), 0 for the fill.
    np.testing.assert_allclose(np.exp(draft_logprobs(raw, reported, np.array([0.5]))), [[0.8, 0.2, 0.0]])


def test_a_round_keeps_the_prefix_up_to_the_first_rejection_and_replaces_it():
    logq, logp = np.repeat(Q, 3, 0), np.repeat(P, 3, 0)
    # Drafted candidates 0 (kept: prob 1), 1 (prob 0.5; u = 0.6 rejects), 0 (never looked at).
    decision = one_round(logq, logp, [0, 1, 0], [3], [0.99, 0.6, 0.0])
    assert decision.accepted.tolist() == [1] and decision.replacement.tolist() == [0]
    decision = one_round(logq, logp, [0, 1, 0], [3], [0.99, 0.4, 0.0])
    assert decision.accepted.tolist() == [3] and decision.replacement.tolist() == [-1]
    decision = one_round(logq, logp, [1, 0, 0], [3], [0.5, 0.0, 0.0])
    assert decision.accepted.tolist() == [0] and decision.replacement.tolist() == [0]


def test_sequences_of_a_round_are_judged_independently():
    logq = np.log(np.array([[0.5, 0.3, 0.2]] * 6))
    logp = np.log(np.array([[0.2, 0.6, 0.2]] * 6))
    # Three sequences with 1, 3 and 2 drafted tokens; the residual's draw picks (2/3, 1/3, 0)
    # in the third (p = (0.1, 0.1, 0.8) at its second position).
    logp[5] = np.log([0.1, 0.1, 0.8])
    decision = one_round(logq, logp, [1, 0, 2, 1, 0, 2], [1, 3, 2], [0.7, 0.0, 0.5, 0.0, 0.0, 0.3],
                         residual_u=[0, 0, 0, 0, 0, 0.9])
    # seq 0: 0.7 >= 0.5 rejects its only token; seq 1: all kept; seq 2: 0.3 >= 0.125 rejects x = 2
    # (q/p = 0.2/0.8), and u = 0.9 > 2/3 picks candidate 1 from the residual.
    assert decision.accepted.tolist() == [0, 3, 1]
    assert decision.replacement.tolist() == [0, -1, 1]


def test_greedy_rows_keep_only_q_stars_argmax():
    logq, logp = np.repeat(Q, 2, 0), np.repeat(P, 2, 0)
    decision = one_round(logq, logp, [0, 1], [2], [0.999, 0.0], greedy=[True, True])
    assert decision.accepted.tolist() == [1] and decision.replacement.tolist() == [0]


def emitted_distribution(logq: np.ndarray, logp: np.ndarray) -> np.ndarray:
    """Exact distribution of a one-token round's output: sum over drafts x of p(x) · P(out | x)."""
    q, p = np.exp(logq), np.exp(logp)
    residual = np.exp(residual_logprobs(logq[None], logp[None], np.ones((1, q.size), bool)))[0]
    accept = np.minimum(1.0, np.divide(q, p, out=np.zeros_like(q), where=p > 0))
    return p * accept + (1.0 - np.sum(p * accept)) * residual


@settings(max_examples=200, deadline=None)
@given(distribution_pairs(max_rows=1), st.integers(1, 40), st.floats(0.3, 3.0))
def test_the_rule_reproduces_q_exactly_for_any_top_k_draft(pair, k, temperature):
    """Property: the kept-or-replaced token follows q for a drafter that samples its top-k only."""
    logq, drafter = pair[0][0], pair[1][0]
    n = logq.shape[0]
    reported = np.zeros(n, bool)
    reported[np.argsort(-drafter)[:min(k, n)]] = True
    logp = draft_logprobs(drafter[None], reported[None], np.array([temperature]))[0]
    np.testing.assert_allclose(emitted_distribution(logq, logp), np.exp(logq), atol=1e-9)


def test_sampled_rounds_follow_q_chi_square():
    """Simulated drafts and uniforms through decide_round: the emitted tokens follow q."""
    rng = np.random.default_rng(7)
    n, draws = 12, 40_000
    logq = np.log(rng.dirichlet(np.ones(n)))
    drafter = rng.normal(0, 1.5, n)
    reported = np.zeros(n, bool)
    reported[np.argsort(-drafter)[:6]] = True  # the drafter samples its top 6 only
    logp = draft_logprobs(drafter[None], reported[None], np.array([0.7]))[0]
    drafts = rng.choice(n, size=draws, p=np.exp(logp))
    decision = one_round(np.tile(logq, (draws, 1)), np.tile(logp, (draws, 1)), drafts, np.ones(draws, np.int64),
                         rng.random(draws), rng.random(draws))
    emitted = np.where(decision.accepted == 1, drafts, decision.replacement)
    assert chi_square_pvalue(emitted, np.exp(logq), min_bins=6) > 1e-3
    # The acceptance rate is sum min(p, q) = 1 - TV(p, q).
    expected_rate = np.minimum(np.exp(logp), np.exp(logq)).sum()
    assert abs(decision.accepted.mean() - expected_rate) < 4 * np.sqrt(expected_rate / draws)


def test_an_argmax_draft_is_kept_with_probability_q_and_replaced_from_q_without_it():
    logp = point_mass_logprobs(np.array([1]), 3)  # the drafter's argmax is candidate 1
    np.testing.assert_array_equal(logp, [[-np.inf, 0.0, -np.inf]])
    assert acceptance_probabilities(Q, logp, np.array([1]))[0] == 0.3
    np.testing.assert_allclose(np.exp(residual_logprobs(Q, logp, ALL)), [[0.5 / 0.7, 0.0, 0.2 / 0.7]])
    np.testing.assert_allclose(emitted_distribution(Q[0], logp[0]), np.exp(Q[0]), atol=1e-12)


@settings(max_examples=100, deadline=None)
@given(distribution_pairs(max_rows=1), st.integers(0, 39))
def test_the_rule_reproduces_q_exactly_for_any_point_mass_draft(pair, drafted):
    """Property: proposing one fixed token (p = 1 there) and applying the rule emits q."""
    logq = pair[0][0]
    logp = point_mass_logprobs(np.array([drafted % logq.shape[0]]), logq.shape[0])[0]
    np.testing.assert_allclose(emitted_distribution(logq, logp), np.exp(logq), atol=1e-9)
