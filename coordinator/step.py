"""One coordinator step's math: merge both top-k lists, solve alpha*, sample from q*.

Pure, no I/O, so it is tested without servers and benchmarked on its own. The three phases
run compiled (coordinator/kernel.py, equal to theory/'s numpy reference); every scheduler
(per-token, lockstep, speculative) goes through here, so all sample from the same q*.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from dualvllm.engines.protocol import PAD_TOKEN_ID, TopKBatch
from dualvllm.coordinator import kernel
from dualvllm.theory.diagnostics import token_diagnostics
from dualvllm.theory.merge import FillRule, MergedTopK


@dataclass(frozen=True)
class StepResult:
    token_ids: np.ndarray  # int64 [B], the sampled tokens
    alpha: np.ndarray  # float64 [B], the alpha used per row
    logprob_q: np.ndarray  # float64 [B], log q*(token) at the row's temperature
    logprob_theta: np.ndarray  # float64 [B], raw server logprob of the token (or its fill)
    logprob_t: np.ndarray  # float64 [B]
    coverage_theta: np.ndarray  # float64 [B], probability mass of the base's reported top-k
    coverage_t: np.ndarray  # float64 [B]
    diagnostics: dict[str, np.ndarray] | None  # key -> [B], when asked for
    candidates: np.ndarray  # int64 [B, n], the merged candidates q* is over (PAD_TOKEN_ID in padding)
    candidate_logq: np.ndarray  # float64 [B, n], log q* of each candidate (-inf in padding)
    # Seconds spent merging, solving alpha* (with temperature and q*), sampling: read by the
    # scheduler's per-step timing; three clock reads per step cost nothing next to the math.
    phase_s: tuple[float, float, float] = (0.0, 0.0, 0.0)


@dataclass(frozen=True)
class Target:
    """q* over the merged candidates of every row, with what it was built from."""

    merged: MergedTopK
    logp_theta: np.ndarray  # float64 [B, n], tempered and renormalized over the candidates
    logp_t: np.ndarray  # float64 [B, n]
    alpha: np.ndarray  # float64 [B]
    logq: np.ndarray  # float64 [B, n]


def solve_target(
    merged: MergedTopK,
    temperature: np.ndarray,
    fixed_alpha: np.ndarray,
    *,
    alpha_tol: float,
    alpha_max_iter: int,
    max_alpha: np.ndarray | None = None,
) -> Target:
    """Temperature, alpha* (where fixed_alpha is NaN, capped at `max_alpha` [B] when given)
    and q* of merged rows -> Target.

    `temperature` [B], 0 = greedy: such rows still need a q* to take the argmax of, so they
    use temperature 1. Shared by the per-token step and speculative rounds, so both sample
    from the very same q*.
    """
    logp_theta, logp_t, alpha, logq = kernel.target(
        merged, temperature, fixed_alpha, max_alpha, tol=alpha_tol, max_iter=alpha_max_iter
    )
    return Target(merged, logp_theta, logp_t, alpha, logq)


def mix_and_sample(
    theta: TopKBatch,
    t: TopKBatch,
    *,
    temperature: np.ndarray,  # float64 [B]; 0 = greedy
    fixed_alpha: np.ndarray,  # float64 [B]; NaN = solve alpha* for that row
    uniforms: np.ndarray,  # float64 [B] in [0, 1), one draw per row from its own sampler
    fill: FillRule,
    alpha_tol: float,
    alpha_max_iter: int,
    vocab_size: int | None = None,
    with_diagnostics: bool = False,
    max_alpha: np.ndarray | None = None,  # float64 [B]: cap on alpha* (1 = none); None = no cap anywhere
    threads: int = 1,  # numba threads for the compiled step (CoordinatorConfig.step_threads)
) -> StepResult:
    started = time.perf_counter()
    if not with_diagnostics:  # the usual case: one compiled call (coordinator/kernel.py)
        out = kernel.step(
            theta.token_ids,
            theta.logprobs,
            t.token_ids,
            t.logprobs,
            temperature=temperature,
            fixed_alpha=fixed_alpha,
            max_alpha=max_alpha,
            uniforms=uniforms,
            fill=fill,
            vocab_size=vocab_size,
            tol=alpha_tol,
            max_iter=alpha_max_iter,
            threads=threads,
        )
        return StepResult(
            token_ids=out.token_ids,
            alpha=out.alpha,
            logprob_q=out.logprob_q,
            logprob_theta=out.logprob_theta,
            logprob_t=out.logprob_t,
            coverage_theta=out.coverage_theta,
            coverage_t=out.coverage_t,
            diagnostics=None,
            candidates=out.candidates,
            candidate_logq=out.candidate_logq,
            phase_s=(0.0, time.perf_counter() - started, 0.0),
        )
    merged = kernel.merge(theta.token_ids, theta.logprobs, t.token_ids, t.logprobs, fill=fill, vocab_size=vocab_size)
    mask = merged.mask
    merged_at = time.perf_counter()
    target = solve_target(
        merged, temperature, fixed_alpha, alpha_tol=alpha_tol, alpha_max_iter=alpha_max_iter, max_alpha=max_alpha
    )
    solved_at = time.perf_counter()
    logq = target.logq  # [B, n]
    index = kernel.sample(logq, mask, uniforms, greedy=temperature == 0.0)  # [B]
    rows = np.arange(index.shape[0])
    diagnostics = token_diagnostics(
        target.logp_theta, target.logp_t, logq, mask, merged.coverage_theta, merged.coverage_t
    )
    return StepResult(
        token_ids=merged.token_ids[rows, index],
        alpha=target.alpha,
        logprob_q=logq[rows, index],
        logprob_theta=merged.logp_theta[rows, index],
        logprob_t=merged.logp_t[rows, index],
        coverage_theta=merged.coverage_theta,
        coverage_t=merged.coverage_t,
        diagnostics=diagnostics,
        candidates=merged.token_ids,
        candidate_logq=logq,
        phase_s=(merged_at - started, solved_at - merged_at, time.perf_counter() - solved_at),
    )


def keep_top(batch: TopKBatch, ks: np.ndarray) -> TopKBatch:
    """Each row cut to its `ks[row]` most likely entries (int64 [B]); the rest becomes padding.

    How one call mixes fewer candidates than the coordinator fetches for the whole batch.
    Rows need not be sorted: an entry is kept when fewer than ks[row] entries rank above it.
    """
    order = np.argsort(-batch.logprobs, axis=1, kind="stable")  # [B, w]; padding (-inf) last
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(order.shape[1])[None, :], axis=1)  # [B, w]
    keep = rank < ks[:, None]
    return TopKBatch(
        token_ids=np.where(keep, batch.token_ids, PAD_TOKEN_ID), logprobs=np.where(keep, batch.logprobs, -np.inf)
    )


def top_candidates(token_ids: np.ndarray, logq: np.ndarray, n: int) -> list[dict[int, float]]:
    """The `n` most likely candidates of each row, {token id: log q*}, most likely first.

    `token_ids`, `logq`: [R, w] rows of StepResult.candidates / candidate_logq; padding is skipped.
    """
    n = min(n, logq.shape[1])
    best = np.argsort(-logq, axis=1, kind="stable")[:, :n]  # [R, n]
    ids = np.take_along_axis(token_ids, best, axis=1).tolist()
    values = np.take_along_axis(logq, best, axis=1).tolist()
    return [
        {i: v for i, v in zip(row_ids, row_values) if i != PAD_TOKEN_ID} for row_ids, row_values in zip(ids, values)
    ]
