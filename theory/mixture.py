"""The geometric mixture q_a ∝ pi_theta^(1-a) · pi_t^a over a padded candidate set.

Every function takes log-probabilities of shape [B, n] and a boolean mask [B, n] of
the entries that exist (rows have different candidate counts); masked entries are
ignored on input and come back as -inf. Inputs need not be normalized over the
candidates: each function renormalizes where the formula needs it.
"""

from __future__ import annotations

import numpy as np

NEG_INF = -np.inf


def masked(values: np.ndarray, mask: np.ndarray, fill: float = 0.0) -> np.ndarray:
    """`values` with masked entries replaced by `fill`, so arithmetic on them stays finite."""
    return np.where(mask, values, fill)


def all_candidates(logp: np.ndarray) -> np.ndarray:
    """The mask of a batch without padding: every entry is a candidate."""
    return np.ones(np.shape(logp), dtype=bool)


def logsumexp(logp: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """log sum_j exp(logp[:, j]) over the unmasked entries of each row -> [B]."""
    shift = np.max(masked(logp, mask, NEG_INF), axis=-1, keepdims=True)  # [B, 1]
    shift = np.where(np.isfinite(shift), shift, 0.0)
    total = np.sum(masked(np.exp(masked(logp, mask, NEG_INF) - shift), mask), axis=-1)  # [B]
    with np.errstate(divide="ignore"):
        return np.log(total) + shift[..., 0]


def log_normalize(logp: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Renormalize each row over its candidates: logp - logsumexp(logp)."""
    return masked(logp - logsumexp(logp, mask)[..., None], mask, NEG_INF)


def apply_temperature(logp: np.ndarray, temperature: float | np.ndarray, mask: np.ndarray) -> np.ndarray:
    """pi^(1/T), renormalized over the candidates; `temperature` is a scalar or one per row.

    vLLM reports raw logprobs (before its own temperature), so the coordinator applies the
    temperature to both models itself, before alpha* is solved: q* is then the mixture of
    the two tempered distributions, which is what the user asked to sample from.
    """
    temperature = np.asarray(temperature, dtype=np.float64)
    if np.any(temperature <= 0):
        raise ValueError(f"temperature must be > 0 (greedy decoding takes the argmax instead), got {temperature}")
    scaled = masked(logp, mask) / (temperature[..., None] if temperature.ndim else temperature)
    return log_normalize(scaled, mask)


def mixture_logits(
    logp_theta: np.ndarray, logp_t: np.ndarray, alpha: float | np.ndarray, mask: np.ndarray
) -> np.ndarray:
    """(1-a)·log p + a·log r with p, r normalized over the candidates: log q_a + log Z(a)."""
    alpha = np.asarray(alpha, dtype=np.float64)
    a = alpha[..., None] if alpha.ndim else alpha
    lp = masked(log_normalize(logp_theta, mask), mask)
    lr = masked(log_normalize(logp_t, mask), mask)
    return masked((1.0 - a) * lp + a * lr, mask, NEG_INF)


def log_partition(
    logp_theta: np.ndarray, logp_t: np.ndarray, alpha: float | np.ndarray, mask: np.ndarray | None = None
) -> np.ndarray:
    """log Z(a) = log sum_y p(y)^(1-a) r(y)^a -> [B]; Z(0) = Z(1) = 1 and log Z <= 0 on [0, 1]."""
    mask = all_candidates(logp_theta) if mask is None else mask
    return logsumexp(mixture_logits(logp_theta, logp_t, alpha, mask), mask)


def mixture_logprobs(
    logp_theta: np.ndarray, logp_t: np.ndarray, alpha: float | np.ndarray, mask: np.ndarray | None = None
) -> np.ndarray:
    """log q_a(y) = (1-a)·log p(y) + a·log r(y) - log Z(a) -> [B, n]; alpha is scalar or [B]."""
    mask = all_candidates(logp_theta) if mask is None else mask
    return log_normalize(mixture_logits(logp_theta, logp_t, alpha, mask), mask)


def sample_indices(logq: np.ndarray, mask: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
    """Inverse-CDF sampling: one candidate index per row from q, given one uniform in [0, 1) per row.

    Taking the uniforms as input keeps this pure; the caller owns the random streams (one
    per sequence, so a sequence's tokens do not depend on what else is in the batch).
    The chosen index is the first j with cdf[j] > u·total, so it always has q[j] > 0.
    """
    probs = masked(np.exp(masked(logq, mask, NEG_INF)), mask)  # [B, n]
    cdf = np.cumsum(probs, axis=-1)  # [B, n]
    threshold = uniforms * cdf[:, -1]  # [B]
    return np.sum(cdf <= threshold[:, None], axis=-1).astype(np.int64)


def greedy_indices(logq: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The most likely candidate per row (ties: the first) -> int64 [B]."""
    return np.argmax(masked(logq, mask, NEG_INF), axis=-1).astype(np.int64)
