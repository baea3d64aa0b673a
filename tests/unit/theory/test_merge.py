"""Merging two top-k lists: union by token id, fill rules, coverage, padding."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualvllm.theory import merge_topk

LN = np.log


def test_union_with_min_fill_by_hand():
    # theta reported {3: .5, 1: .3}, teacher reported {2: .4, 3: .2, 5: .1}.
    merged = merge_topk(np.array([[3, 1, -1]]), np.array([[LN(.5), LN(.3), -np.inf]]),
                        np.array([[2, 3, 5]]), np.array([[LN(.4), LN(.2), LN(.1)]]))
    np.testing.assert_array_equal(merged.token_ids, [[1, 2, 3, 5]])
    np.testing.assert_array_equal(merged.mask, [[True] * 4])
    # Missing for theta: ids 2 and 5 get theta's smallest reported logprob, log .3.
    np.testing.assert_allclose(merged.logp_theta, [[LN(.3), LN(.3), LN(.5), LN(.3)]])
    np.testing.assert_allclose(merged.logp_t, [[LN(.1), LN(.4), LN(.2), LN(.1)]])
    np.testing.assert_array_equal(merged.reported_theta, [[True, False, True, False]])
    np.testing.assert_array_equal(merged.reported_t, [[False, True, True, True]])
    np.testing.assert_allclose(merged.coverage_theta, [0.8])
    np.testing.assert_allclose(merged.coverage_t, [0.7])


def test_floor_fill_uses_the_fixed_floor():
    merged = merge_topk(np.array([[1]]), np.array([[LN(.9)]]), np.array([[2]]), np.array([[LN(.8)]]),
                        fill="floor", floor=-50.0)
    np.testing.assert_allclose(merged.logp_theta, [[LN(.9), -50.0]])
    np.testing.assert_allclose(merged.logp_t, [[-50.0, LN(.8)]])


def test_spread_fill_splits_uncovered_mass_capped_at_min():
    # theta covers .6 with {1: .5, 2: .1}; teacher adds ids 3 and 4 -> each gets .4/2 = .2,
    # capped at theta's smallest reported .1. Teacher covers .99 with {3: .9, 4: .09}: its
    # two missing ids share .01 -> .005 each, below its min .09, so not capped.
    merged = merge_topk(np.array([[1, 2]]), np.array([[LN(.5), LN(.1)]]),
                        np.array([[3, 4]]), np.array([[LN(.9), LN(.09)]]), fill="spread")
    np.testing.assert_allclose(merged.logp_theta, [[LN(.5), LN(.1), LN(.1), LN(.1)]])
    np.testing.assert_allclose(merged.logp_t, [[LN(.005), LN(.005), LN(.9), LN(.09)]])


def test_rows_have_their_own_candidate_counts():
    ids_theta = np.array([[1, 2], [7, 8]])
    ids_t = np.array([[1, 2], [9, 10]])
    lp = np.log(np.array([[.6, .4], [.6, .4]]))
    merged = merge_topk(ids_theta, lp, ids_t, lp)
    np.testing.assert_array_equal(merged.token_ids, [[1, 2, -1, -1], [7, 8, 9, 10]])
    np.testing.assert_array_equal(merged.mask, [[True, True, False, False], [True] * 4])
    assert np.all(np.isneginf(merged.logp_theta[0, 2:]))


def test_unknown_rule_and_bad_shapes_are_refused():
    ids, lp = np.array([[1]]), np.array([[0.0]])
    with pytest.raises(ValueError, match="unknown fill rule"):
        merge_topk(ids, lp, ids, lp, fill="zero")
    with pytest.raises(ValueError, match="shapes disagree"):
        merge_topk(ids, lp, np.array([[1, 2]]), lp)


@st.composite
def topk_pairs(draw):
    rows, vocab = draw(st.integers(1, 5)), draw(st.integers(2, 60))
    k = draw(st.integers(1, vocab))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    lists = []
    for _ in range(2):
        ids = np.full((rows, k), -1)
        lps = np.full((rows, k), -np.inf)
        for r in range(rows):
            p = rng.dirichlet(np.ones(vocab) * 0.5)
            kk = int(rng.integers(1, k + 1))  # servers may report fewer than k
            top = np.argsort(-p)[:kk]
            ids[r, :kk], lps[r, :kk] = top, np.log(p[top])
        lists += [ids, lps]
    return lists, draw(st.sampled_from(["min", "floor", "spread"]))


@settings(max_examples=200, deadline=None)
@given(topk_pairs())
def test_merge_matches_a_per_row_dictionary_union(case):
    (ids_theta, lp_theta, ids_t, lp_t), rule = case
    merged = merge_topk(ids_theta, lp_theta, ids_t, lp_t, fill=rule)
    for r in range(ids_theta.shape[0]):
        theta = {int(i): v for i, v in zip(ids_theta[r], lp_theta[r]) if i >= 0}
        t = {int(i): v for i, v in zip(ids_t[r], lp_t[r]) if i >= 0}
        union = sorted(theta.keys() | t.keys())
        n = len(union)
        assert merged.token_ids[r, :n].tolist() == union
        assert merged.mask[r].sum() == n
        for j, tok in enumerate(union):
            for reported, logp, smallest in ((theta, merged.logp_theta, min(theta.values())),
                                             (t, merged.logp_t, min(t.values()))):
                if tok in reported:
                    assert logp[r, j] == reported[tok]
                else:
                    # Every fill rule stays at or below the "min" upper bound, and finite.
                    assert np.isfinite(logp[r, j]) and logp[r, j] <= smallest


def test_spread_over_the_vocabulary_uses_the_unreported_token_count():
    # Vocabulary 12: theta reported 2 tokens covering .6, so 10 unreported tokens share .4.
    merged = merge_topk(np.array([[1, 2]]), np.array([[LN(.5), LN(.1)]]),
                        np.array([[3, 4]]), np.array([[LN(.9), LN(.09)]]), fill="spread", vocab_size=12)
    np.testing.assert_allclose(merged.logp_theta, [[LN(.5), LN(.1), LN(.04), LN(.04)]])
    np.testing.assert_allclose(merged.logp_t, [[LN(.001), LN(.001), LN(.9), LN(.09)]])
