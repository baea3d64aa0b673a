"""Speculative sampling of q*: accept or reject drafted tokens so that what is kept follows q*.

A drafter D samples x from p (its own top-k at the sampling temperature); with the target
q = q* at the same position (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding"; Chen et al. 2023, "Accelerating LLM Decoding with Speculative
Sampling"):

    accept x with probability  min(1, q(x) / p(x))
    on rejection, sample from  r(y) = max(0, q(y) - p(y)) / sum_z max(0, q(z) - p(z))

Then P(y) = min(p(y), q(y)) + (1 - sum_z min(p(z), q(z))) · r(y) = q(y), because
sum_z max(0, q - p) = 1 - sum_z min(p, q) when p and q each sum to 1. It needs p(y) exactly
wherever q(y) > 0: the drafter samples from its reported top-k only (vLLM `top_k` = k), so
p(y) = exp(lp(y)/T) / sum_{z in top-k} exp(lp(z)/T) on its top-k and 0 elsewhere, all
known. The expected acceptance per position is sum_z min(p(z), q(z)) = 1 - TV(p, q).

The rule holds for any proposal whose p is known, including a point mass: an argmax draft
(D's most likely token x, p = 1 on x) is kept with probability q(x) and otherwise replaced
by a draw from q without x, r(y) = q(y) / (1 - q(x)) for y != x; again P = q exactly. Such
drafts need no sampling on the server, so one batched, unseeded request serves every
sequence, and the expected acceptance is q(x) instead of 1 - TV(p, q).

Greedy rows (temperature 0) draft the drafter's argmax and keep it iff it is q*'s argmax;
otherwise q*'s argmax replaces it, exactly what greedy per-token decoding would emit.

Rows are positions: a round's positions of every sequence stacked into [R, n] arrays over
the merged candidate set, sequence s owning `lengths[s]` consecutive rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dualvllm.theory.mixture import apply_temperature, greedy_indices, masked, sample_indices

NOT_A_CANDIDATE = -1  # draft_index of a drafted token outside the candidate set


def draft_logprobs(logp_raw: np.ndarray, reported: np.ndarray, temperature: np.ndarray) -> np.ndarray:
    """log p(y) = lp(y)/T - log sum_{z reported} exp(lp(z)/T) on the drafter's reported top-k,
    -inf elsewhere -> [R, n]. `temperature` [R] > 0 (pass 1 for greedy rows)."""
    return apply_temperature(logp_raw, temperature, reported)


def point_mass_logprobs(draft_index: np.ndarray, width: int) -> np.ndarray:
    """log p of an argmax draft: 0 at the drafted candidate, -inf elsewhere -> [R, width]."""
    logp = np.full((draft_index.shape[0], width), -np.inf)
    rows = np.flatnonzero(draft_index != NOT_A_CANDIDATE)
    logp[rows, draft_index[rows]] = 0.0
    return logp


def acceptance_probabilities(logq: np.ndarray, logp: np.ndarray, draft_index: np.ndarray) -> np.ndarray:
    """min(1, q(x)/p(x)) of each row's drafted candidate x -> [R].

    A drafted token p does not cover (outside the candidate set, or not in the drafter's
    reported top-k: only a tie at the k-th logprob lets vLLM sample one) is rejected.
    """
    rows = np.arange(draft_index.shape[0])
    index = np.maximum(draft_index, 0)
    covered = (draft_index != NOT_A_CANDIDATE) & np.isfinite(logp[rows, index])  # [R]
    log_ratio = np.where(covered, logq[rows, index] - np.where(covered, logp[rows, index], 0.0), -np.inf)
    return np.exp(np.minimum(log_ratio, 0.0))


def residual_logprobs(logq: np.ndarray, logp: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """log r(y), r ∝ max(0, q(y) - p(y)) over the candidates -> [R, n].

    Where q <= p everywhere (q = p up to rounding) a rejection has probability 0 and r is
    undefined; such rows get q itself, so a rejection that rounding lets through still
    samples from the target.
    """
    excess = masked(
        np.maximum(np.exp(masked(logq, mask, -np.inf)) - np.exp(masked(logp, mask, -np.inf)), 0.0), mask
    )  # [R, n]
    total = excess.sum(axis=-1, keepdims=True)  # [R, 1]
    with np.errstate(divide="ignore"):
        return np.where(total > 0, masked(np.log(excess) - np.log(np.maximum(total, 1e-300)), mask, -np.inf), logq)


@dataclass(frozen=True)
class RoundDecision:
    """What a round keeps of each sequence's draft."""

    accepted: np.ndarray  # int64 [S], drafted tokens kept (a prefix of the draft)
    replacement: np.ndarray  # int64 [S], candidate index emitted at row offset+accepted; -1 if all kept


def decide_round(
    logq: np.ndarray,
    logp: np.ndarray,
    mask: np.ndarray,
    draft_index: np.ndarray,
    lengths: np.ndarray,
    greedy: np.ndarray,
    accept_uniforms: np.ndarray,
    residual_uniforms: np.ndarray,
) -> RoundDecision:
    """Keep each draft up to its first rejection, then one token from the residual.

    `logq`, `logp`: [R, n] log q* and log p over the candidates; `draft_index`: [R] the
    drafted token's candidate index (NOT_A_CANDIDATE if absent); `lengths`: [S] rows per
    sequence (>= 1); `greedy`: [R]; `accept_uniforms`, `residual_uniforms`: [R] in [0, 1)
    from each sequence's own sampler. Sequence s yields accepted[s] drafted tokens plus,
    unless all were kept, the replacement: between 1 and lengths[s] tokens.
    """
    best = greedy_indices(logq, mask)  # [R]
    probability = np.where(
        greedy, (draft_index == best).astype(np.float64), acceptance_probabilities(logq, logp, draft_index)
    )
    kept = accept_uniforms < probability  # [R]; u in [0, 1) keeps probability-1 rows always
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)  # [S]
    owner = np.repeat(np.arange(lengths.shape[0]), lengths)  # [R]
    position = np.arange(kept.shape[0]) - offsets[owner]  # [R], index within its draft
    # First rejected position per sequence (its length when none is rejected).
    accepted = np.minimum.reduceat(np.where(kept, lengths[owner], position), offsets).astype(np.int64)
    resampled = sample_indices(residual_logprobs(logq, logp, mask), mask, residual_uniforms)  # [R]
    resampled = np.where(greedy, best, resampled)
    full = accepted == lengths
    at = offsets + np.minimum(accepted, lengths - 1)
    replacement = np.where(full, -1, resampled[at]).astype(np.int64)
    return RoundDecision(accepted=accepted, replacement=replacement)
