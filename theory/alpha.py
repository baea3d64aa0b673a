"""alpha*: the mixing weight at which q_a is equally far (in KL) from both models.

With l = log pi_t - log pi_theta and q_a ∝ pi_theta · exp(a·l):

    f(a) = KL(q_a || pi_theta) - KL(q_a || pi_t) = E_{q_a}[l]
    f'(a) = Var_{q_a}(l) >= 0

so f increases from f(0) = -KL(pi_theta || pi_t) <= 0 to f(1) = KL(pi_t || pi_theta) >= 0
and has exactly one root on [0, 1] unless the two distributions are equal (then f = 0
everywhere and we return 0.5, the symmetric choice). At the root both KLs equal
-log Z(alpha*): the Chernoff point of the two distributions.

The solver keeps a bracket [lo, hi] with f(lo) <= 0 <= f(hi) per row and takes Newton
steps (the derivative is the variance, free once q_a is known), falling back to
bisection when a Newton step would leave the bracket or is not shrinking the error fast
enough (the `rtsafe` safeguard). All rows advance together, vectorized; converged rows
are frozen.
"""

from __future__ import annotations

import numpy as np

from dualvllm.theory.mixture import all_candidates, log_normalize, masked, mixture_logprobs

# |l| below this on every candidate means the two rows are the same distribution.
IDENTICAL_ATOL = 1e-12


def log_ratio(logp_theta: np.ndarray, logp_t: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """l = log r - log p with both normalized over the candidates; 0 on masked entries -> [B, n]."""
    return masked(log_normalize(logp_t, mask), mask) - masked(log_normalize(logp_theta, mask), mask)


def symmetry_gap(
    logp_theta: np.ndarray, logp_t: np.ndarray, alpha: float | np.ndarray, mask: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(f(a), f'(a)) = (E_{q_a}[l], Var_{q_a}(l)) per row -> two [B] arrays."""
    mask = all_candidates(logp_theta) if mask is None else mask
    l = log_ratio(logp_theta, logp_t, mask)  # [B, n]
    return _moments(logp_theta, l, np.asarray(alpha, dtype=np.float64), mask)


def _moments(
    logp_theta: np.ndarray, l: np.ndarray, alpha: np.ndarray, mask: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    # q_a ∝ p · exp(a·l): mixture of p and r = p·exp(l), written in the form that keeps l exact.
    a = alpha[..., None] if alpha.ndim else alpha
    q = masked(np.exp(log_normalize(masked(logp_theta, mask) + a * l, mask)), mask)  # [B, n]
    mean = np.sum(q * l, axis=-1)  # [B]
    var = np.sum(q * (l - mean[..., None]) ** 2, axis=-1)  # [B]
    return mean, var


def solve_alpha(
    logp_theta: np.ndarray, logp_t: np.ndarray, mask: np.ndarray | None = None, tol: float = 1e-6, max_iter: int = 20
) -> np.ndarray:
    """alpha* in [0, 1] per row such that KL(q* || pi_theta) = KL(q* || pi_t) -> float64 [B].

    `logp_theta`, `logp_t`: [B, n] log-probabilities over the same candidates (normalized
    or not); `mask`: [B, n] of the candidates that exist (default: all). Stops a row when
    its bracket is narrower than `tol` or its Newton step is smaller than `tol`.
    """
    logp_theta = np.asarray(logp_theta, dtype=np.float64)
    logp_t = np.asarray(logp_t, dtype=np.float64)
    if logp_theta.shape != logp_t.shape or logp_theta.ndim != 2:
        raise ValueError(
            f"solve_alpha wants two [B, n] arrays of the same shape, got {logp_theta.shape} and {logp_t.shape}"
        )
    mask = all_candidates(logp_theta) if mask is None else np.asarray(mask, dtype=bool)
    batch = logp_theta.shape[0]
    # Normalize once: every iteration then needs only q_a ∝ exp(lp + a·l), with lp = -inf
    # and l = 0 on masked entries so they drop out without masking.
    lp = log_normalize(logp_theta, mask)  # [B, n], -inf where masked
    l = masked(log_normalize(logp_t, mask), mask) - masked(lp, mask)  # [B, n]

    alpha = np.full(batch, 0.5)
    lo, hi = np.zeros(batch), np.ones(batch)
    step_before = np.ones(batch)  # the step before last, for the rtsafe progress test
    step = np.ones(batch)
    active = np.max(np.abs(l), axis=-1, initial=0.0) > IDENTICAL_ATOL  # [B]; equal rows keep 0.5
    rows = np.flatnonzero(active)
    for _ in range(max_iter):
        if rows.size == 0:
            break
        # Only the rows still searching; no copy while that is all of them.
        lp_rows, l_rows = (lp, l) if rows.size == batch else (lp[rows], l[rows])
        f, df = _normalized_moments(lp_rows, l_rows, alpha[rows])
        a, low, high = alpha[rows], lo[rows], hi[rows]
        low = np.where(f < 0, a, low)
        high = np.where(f > 0, a, high)
        with np.errstate(divide="ignore", invalid="ignore"):
            newton = a - f / df
        # Bisect when Newton leaves the bracket, has no slope, or did not halve the error
        # compared with the step before last (slow creep on a flat-then-steep f).
        use_bisect = (
            ~np.isfinite(newton)
            | (newton <= low)
            | (newton >= high)
            | (np.abs(2.0 * f) > np.abs(step_before[rows] * df))
        )
        new_alpha = np.where(use_bisect, 0.5 * (low + high), newton)
        step_before[rows] = step[rows]
        step[rows] = np.abs(new_alpha - a)
        done = (f == 0) | (high - low < tol) | (step[rows] < tol)
        alpha[rows] = np.where(f == 0, a, new_alpha)
        lo[rows], hi[rows] = low, high
        rows = rows[~done]
    return np.clip(alpha, 0.0, 1.0)


def _normalized_moments(lp: np.ndarray, l: np.ndarray, alpha: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(E_{q_a}[l], Var_{q_a}(l)) per row for normalized lp (-inf where masked) and l (0 there)."""
    z = lp + alpha[:, None] * l  # [B, n]; log q_a + log Z(a)
    q = np.exp(z - np.max(z, axis=-1, keepdims=True))  # [B, n], unnormalized
    total = np.sum(q, axis=-1)  # [B]
    mean = np.sum(q * l, axis=-1) / total
    var = np.sum(q * (l - mean[:, None]) ** 2, axis=-1) / total
    return mean, var


def alpha_kls(
    logp_theta: np.ndarray, logp_t: np.ndarray, alpha: np.ndarray, mask: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(KL(q_a || pi_theta), KL(q_a || pi_t)) per row, over the candidates -> two [B] arrays."""
    mask = all_candidates(logp_theta) if mask is None else mask
    logq = mixture_logprobs(logp_theta, logp_t, alpha, mask)
    q = masked(np.exp(logq), mask)
    lq = masked(logq, mask)
    kl_theta = np.sum(q * (lq - masked(log_normalize(logp_theta, mask), mask)), axis=-1)
    kl_t = np.sum(q * (lq - masked(log_normalize(logp_t, mask), mask)), axis=-1)
    return kl_theta, kl_t
