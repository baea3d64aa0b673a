"""Per-token diagnostics of q* against both models, and their per-sequence summary.

With p = pi_theta, r = pi_t and q = q* over the candidate set:

- kl_theta = KL(q || p), kl_t = KL(q || r), kl_diff = kl_theta - kl_t (≈ 0 at alpha*)
- ess_theta = 1 / sum(p² / q): the effective sample size fraction of importance
  weights p/q, i.e. how well samples from q stand in for samples from p (1 = perfectly);
  for q = q_a it equals 1 / (Z(a) · Z(-a)). Likewise ess_t = 1 / sum(r² / q) = 1 / (Z(a) · Z(2-a)).
- ess_ratio = ess_theta / ess_t
- entropy_q = -sum q log q
- coverage_theta, coverage_t: the probability mass each model's reported top-k holds;
  small values mean k is too small for the candidate set to stand for the distribution.
"""

from __future__ import annotations

import numpy as np

from dualvllm.theory.mixture import log_normalize, masked

DIAGNOSTIC_KEYS = (
    "kl_theta",
    "kl_t",
    "kl_diff",
    "ess_theta",
    "ess_t",
    "ess_ratio",
    "entropy_q",
    "coverage_theta",
    "coverage_t",
)


def token_diagnostics(
    logp_theta: np.ndarray,
    logp_t: np.ndarray,
    logq: np.ndarray,
    mask: np.ndarray,
    coverage_theta: np.ndarray,
    coverage_t: np.ndarray,
) -> dict[str, np.ndarray]:
    """Every key of DIAGNOSTIC_KEYS -> float64 [B], from [B, n] logprobs over the candidates."""
    lp = masked(log_normalize(logp_theta, mask), mask)
    lr = masked(log_normalize(logp_t, mask), mask)
    lq = masked(log_normalize(logq, mask), mask)
    q = masked(np.exp(lq), mask)  # [B, n]
    kl_theta = np.sum(q * (lq - lp), axis=-1)
    kl_t = np.sum(q * (lq - lr), axis=-1)
    # sum p²/q = sum exp(2 log p - log q): computed in log space, q can be tiny where p is not.
    ess_theta = 1.0 / np.sum(masked(np.exp(2.0 * lp - lq), mask), axis=-1)
    ess_t = 1.0 / np.sum(masked(np.exp(2.0 * lr - lq), mask), axis=-1)
    return {
        "kl_theta": kl_theta,
        "kl_t": kl_t,
        "kl_diff": kl_theta - kl_t,
        "ess_theta": ess_theta,
        "ess_t": ess_t,
        "ess_ratio": ess_theta / ess_t,
        "entropy_q": -np.sum(q * lq, axis=-1),
        "coverage_theta": np.asarray(coverage_theta, dtype=np.float64),
        "coverage_t": np.asarray(coverage_t, dtype=np.float64),
    }


def summarize(per_token: dict[str, np.ndarray]) -> dict[str, dict[str, float]]:
    """key -> {mean, std, min, max} over a sequence's tokens (keys with no values are left out)."""
    return {
        key: {"mean": float(np.mean(v)), "std": float(np.std(v)), "min": float(np.min(v)), "max": float(np.max(v))}
        for key, v in per_token.items()
        if np.size(v)
    }
