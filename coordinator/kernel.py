"""The coordinator's step, compiled: merge both top-k lists, solve alpha*, sample from q*.

theory/ holds the reference math, vectorized numpy over the batch, written to be read and
checked against the papers. At a few hundred rows of 20-40 candidates that form spends most
of its time in numpy's per-call overhead (dozens of calls per step on tiny arrays, and the
alpha* search repeats them per iteration): 30-50 µs of coordinator CPU per token in lockstep
(benchmarks/coordinator_capacity.py). Here the same math runs row by row in one compiled
pass per phase (numba), each row's loops over its own candidates only.

Every function computes exactly what its reference does, in the same order where it
matters for sampling (the cumulative sum the inverse-CDF draw reads is summed left to
right in both); tests/unit/coordinator/test_step_kernel.py holds them equal on random and adversarial
rows. Values may differ from the reference in the last bits of a logsumexp (numpy sums
pairwise); a draw would differ only if its uniform fell within that of a CDF boundary.

All functions write into arrays the caller allocates; nothing here allocates per row.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numba
import numpy as np

from dualvllm.theory.merge import DEFAULT_FLOOR, FILL_RULES, FillRule, MergedTopK

# theory/merge.py's rules, as the integer the compiled code branches on.
FILL_CODES = {"min": 0, "floor": 1, "spread": 2}
PAD = -1  # padding id of a top-k row (dualvllm.engines.protocol.PAD_TOKEN_ID, dualvllm.theory.merge.PAD_ID)
IDENTICAL_ATOL = 1e-12  # dualvllm.theory.alpha.IDENTICAL_ATOL: rows closer than this are one distribution
# Rows per thread below which a step runs on one thread: a row costs 2-4 µs here, waking
# numba's pool tens of µs.
THREADED_MIN_ROWS = 32

# error_model="numpy": a zero derivative gives inf/nan (then a bisection step), as in the
# reference, instead of raising ZeroDivisionError. cache=True: compiled once per machine.
_jit = numba.njit(cache=True, nogil=True, error_model="numpy")


@_jit
def merge_rows(
    ids_theta,
    lp_theta,
    ids_t,
    lp_t,
    fill,
    floor,
    vocab_size,
    token_ids,
    raw_theta,
    raw_t,
    rep_theta,
    rep_t,
    counts,
    cov_theta,
    cov_t,
    lo,
    hi,
):
    """dualvllm.theory.merge.merge_topk row by row, rows lo to hi. Inputs [B, w1] / [B, w2] (PAD
    padding); outputs [B, w1 + w2], candidates sorted by id in the first counts[b] slots of each
    row; `vocab_size` < 0: unknown."""
    w1 = ids_theta.shape[1]
    w2 = ids_t.shape[1]
    # Each model's entries sorted by id, then one pass pairs them: two sorts of k entries
    # cost about half of one sort of 2k (insertion sort's work grows with the square).
    keys_theta, vals_theta = np.empty(w1, np.int64), np.empty(w1, np.float64)
    keys_t, vals_t = np.empty(w2, np.int64), np.empty(w2, np.float64)
    for b in range(lo, hi):
        m1, mass_theta, smallest_theta = _sorted_entries(ids_theta[b], lp_theta[b], keys_theta, vals_theta)
        m2, mass_t, smallest_t = _sorted_entries(ids_t[b], lp_t[b], keys_t, vals_t)
        n, i, j = 0, 0, 0
        while i < m1 or j < m2:
            if j == m2 or (i < m1 and keys_theta[i] < keys_t[j]):  # the base's alone
                token_ids[b, n], raw_theta[b, n] = keys_theta[i], vals_theta[i]
                rep_theta[b, n], rep_t[b, n] = True, False
                i += 1
            elif i == m1 or keys_t[j] < keys_theta[i]:  # the teacher's alone
                token_ids[b, n], raw_t[b, n] = keys_t[j], vals_t[j]
                rep_theta[b, n], rep_t[b, n] = False, True
                j += 1
            else:  # both reported it
                token_ids[b, n], raw_theta[b, n], raw_t[b, n] = keys_theta[i], vals_theta[i], vals_t[j]
                rep_theta[b, n], rep_t[b, n] = True, True
                i += 1
                j += 1
            n += 1
        counts[b] = n
        cov_theta[b], cov_t[b] = min(mass_theta, 1.0), min(mass_t, 1.0)
        missing_theta = vocab_size - m1 if vocab_size >= 0 else n - m1
        missing_t = vocab_size - m2 if vocab_size >= 0 else n - m2
        value_theta = _fill_value(fill, floor, smallest_theta, cov_theta[b], missing_theta)
        value_t = _fill_value(fill, floor, smallest_t, cov_t[b], missing_t)
        for j in range(n):
            if not rep_theta[b, j]:
                raw_theta[b, j] = value_theta
            if not rep_t[b, j]:
                raw_t[b, j] = value_t
        for j in range(n, token_ids.shape[1]):
            token_ids[b, j], raw_theta[b, j], raw_t[b, j] = PAD, -np.inf, -np.inf
            rep_theta[b, j], rep_t[b, j] = False, False


@_jit
def _sorted_entries(ids, logprobs, keys, vals):
    """One model's reported entries of a row (PAD skipped) into keys/vals, sorted by id ->
    (how many, their probability mass, the smallest logprob). Insertion sort: a row holds
    at most k entries (k ~ 20), where it beats a general sort's set-up several times over."""
    m, mass, smallest = 0, 0.0, np.inf
    for j in range(ids.shape[0]):
        if ids[j] == PAD:
            continue
        key, val = ids[j], logprobs[j]
        mass += math.exp(val)
        smallest = min(smallest, val)
        i = m - 1
        while i >= 0 and keys[i] > key:
            keys[i + 1], vals[i + 1] = keys[i], vals[i]
            i -= 1
        keys[i + 1], vals[i + 1] = key, val
        m += 1
    return m, mass, smallest


@_jit
def _fill_value(fill, floor, smallest, coverage, missing):
    """dualvllm.theory.merge._fill's value for an unreported candidate."""
    upper = smallest if math.isfinite(smallest) else floor
    if fill == 0:
        return upper
    if fill == 1:
        return min(floor, upper)
    spread = np.log(max(1.0 - coverage, 0.0)) - np.log(max(missing, 1))
    return min(max(spread, floor), upper)


@_jit
def _log_normalize(values, n, temperature, out):
    """out[:n] = values[:n] / T - logsumexp(values[:n] / T); -inf past n. (Divided, not
    multiplied by 1/T: the reference divides, and the two round differently.) The scaled
    values are computed once into `out` (and not at all at T = 1, where x / 1 == x exactly):
    bit for bit what dividing in each of the three passes gives, at a third of the divisions."""
    if temperature == 1.0:
        for j in range(n):
            out[j] = values[j]
    else:
        for j in range(n):
            out[j] = values[j] / temperature
    top = -np.inf
    for j in range(n):
        top = max(top, out[j])
    shift = top if math.isfinite(top) else 0.0
    total = 0.0
    for j in range(n):
        total += math.exp(out[j] - shift)
    lse = np.log(total) + shift
    for j in range(n):
        out[j] = out[j] - lse
    for j in range(n, out.shape[0]):
        out[j] = -np.inf


@_jit
def target_rows(
    raw_theta, raw_t, counts, temperature, fixed_alpha, max_alpha, tol, max_iter, lp_theta, lp_t, alpha, logq, lo, hi
):
    """dualvllm.coordinator.step.solve_target row by row, rows lo to hi: temperature (0 = greedy rows
    use 1), alpha* where fixed_alpha is NaN (capped at max_alpha), and log q* over the candidates."""
    mixed = np.empty(raw_theta.shape[1], np.float64)
    # The alpha* search's scratch, allocated once per call instead of twice per row.
    diff, weights = np.empty(raw_theta.shape[1], np.float64), np.empty(raw_theta.shape[1], np.float64)
    for b in range(lo, hi):
        n = counts[b]
        temp = 1.0 if temperature[b] == 0.0 else temperature[b]
        _log_normalize(raw_theta[b], n, temp, lp_theta[b])
        _log_normalize(raw_t[b], n, temp, lp_t[b])
        a = fixed_alpha[b]
        if math.isnan(a):
            a = min(_solve_alpha(lp_theta[b], lp_t[b], n, tol, max_iter, diff, weights), max_alpha[b])
        alpha[b] = a
        for j in range(n):
            mixed[j] = (1.0 - a) * lp_theta[b, j] + a * lp_t[b, j]
        _log_normalize(mixed, n, 1.0, logq[b])


@_jit
def _solve_alpha(lp, lt, n, tol, max_iter, l, q):
    """dualvllm.theory.alpha.solve_alpha for one row of normalized log-probabilities: rtsafe, Newton
    steps on f(a) = E_qa[l] (f' = Var_qa(l)) inside a bisection bracket. `l`, `q`: scratch
    of at least n values."""
    largest = 0.0
    for j in range(n):
        l[j] = lt[j] - lp[j]
        largest = max(largest, abs(l[j]))
    if largest <= IDENTICAL_ATOL:
        return 0.5
    a, lo, hi, step_before, step = 0.5, 0.0, 1.0, 1.0, 1.0
    for _ in range(max_iter):
        top = -np.inf
        for j in range(n):
            q[j] = lp[j] + a * l[j]
            top = max(top, q[j])
        total, first = 0.0, 0.0
        for j in range(n):
            q[j] = math.exp(q[j] - top)
            total += q[j]
            first += q[j] * l[j]
        f = first / total
        second = 0.0
        for j in range(n):
            second += q[j] * (l[j] - f) ** 2
        df = second / total
        if f < 0:
            lo = a
        if f > 0:
            hi = a
        newton = a - f / df
        bisect = not math.isfinite(newton) or newton <= lo or newton >= hi or abs(2.0 * f) > abs(step_before * df)
        new = 0.5 * (lo + hi) if bisect else newton
        step_before, step = step, abs(new - a)
        done = f == 0 or hi - lo < tol or step < tol
        if f != 0:
            a = new
        if done:
            break
    return min(max(a, 0.0), 1.0)


@_jit
def sample_rows(logq, counts, uniforms, greedy, index, lo, hi):
    """dualvllm.theory.mixture.sample_indices (inverse CDF: the first j with cdf[j] > u * total) and, on
    greedy rows, greedy_indices (the first most likely candidate); rows lo to hi."""
    cdf = np.empty(logq.shape[1], np.float64)
    for b in range(lo, hi):
        n = counts[b]
        if greedy[b]:
            best = 0
            for j in range(1, n):
                if logq[b, j] > logq[b, best]:
                    best = j
            index[b] = best
            continue
        total = 0.0
        for j in range(n):
            total += math.exp(logq[b, j])
            cdf[j] = total
        threshold = uniforms[b] * total
        chosen = 0
        for j in range(n):
            chosen += cdf[j] <= threshold
        index[b] = chosen


@_jit
def step_rows(
    ids_theta,
    lp_theta,
    ids_t,
    lp_t,
    fill,
    floor,
    vocab_size,
    temperature,
    fixed_alpha,
    max_alpha,
    uniforms,
    greedy,
    tol,
    max_iter,
    token_ids,
    raw_theta,
    raw_t,
    rep_theta,
    rep_t,
    counts,
    cov_theta,
    cov_t,
    lp_tempered_theta,
    lp_tempered_t,
    alpha,
    logq,
    index,
    chosen,
    lo,
    hi,
):
    """The three phases in one call (one dispatch instead of three: at batch 1 the calls cost more
    than the math), and the chosen candidate's token id, log q*, raw logprobs -> chosen [4, B];
    rows lo to hi -> whether every row had a candidate."""
    merge_rows(
        ids_theta,
        lp_theta,
        ids_t,
        lp_t,
        fill,
        floor,
        vocab_size,
        token_ids,
        raw_theta,
        raw_t,
        rep_theta,
        rep_t,
        counts,
        cov_theta,
        cov_t,
        lo,
        hi,
    )
    for b in range(lo, hi):
        if counts[b] == 0:
            return False
    target_rows(
        raw_theta,
        raw_t,
        counts,
        temperature,
        fixed_alpha,
        max_alpha,
        tol,
        max_iter,
        lp_tempered_theta,
        lp_tempered_t,
        alpha,
        logq,
        lo,
        hi,
    )
    sample_rows(logq, counts, uniforms, greedy, index, lo, hi)
    for b in range(lo, hi):
        j = index[b]
        chosen[0, b], chosen[1, b] = token_ids[b, j], logq[b, j]
        chosen[2, b], chosen[3, b] = raw_theta[b, j], raw_t[b, j]
    return True


@numba.njit(cache=True, nogil=True, error_model="numpy", parallel=True)
def step_rows_threaded(chunks, *arrays):
    """step_rows over `chunks` blocks of rows on numba's threads (rows are independent: the same
    result as one call over all of them, bit for bit) -> whether every row had a candidate.
    `arrays`: step_rows' arguments but its row range."""
    batch = arrays[0].shape[0]
    complete = np.ones(chunks, np.bool_)
    for c in numba.prange(chunks):
        complete[c] = step_rows(*arrays, c * batch // chunks, (c + 1) * batch // chunks)
    return complete.all()


def usable_threads(threads: int, batch: int) -> int:
    """Threads a step of `batch` rows runs on: at most `threads` and numba's pool, and one below
    THREADED_MIN_ROWS rows a thread (there waking the pool costs more than the rows)."""
    return max(1, min(threads, numba.config.NUMBA_NUM_THREADS, batch // THREADED_MIN_ROWS))


# -- the array-level calls (allocate the outputs, check the inputs) ---------------------------


def merge(
    ids_theta: np.ndarray,
    logp_theta: np.ndarray,
    ids_t: np.ndarray,
    logp_t: np.ndarray,
    *,
    fill: FillRule = "min",
    floor: float = DEFAULT_FLOOR,
    vocab_size: int | None = None,
) -> MergedTopK:
    """dualvllm.theory.merge.merge_topk, compiled: the same arguments and result."""
    if fill not in FILL_RULES:
        raise ValueError(f"unknown fill rule {fill!r}; choose one of {FILL_RULES}")
    ids_theta, ids_t = np.ascontiguousarray(ids_theta, np.int64), np.ascontiguousarray(ids_t, np.int64)
    logp_theta, logp_t = np.ascontiguousarray(logp_theta, np.float64), np.ascontiguousarray(logp_t, np.float64)
    batch, w_theta = ids_theta.shape
    if ids_t.shape[0] != batch or logp_theta.shape != ids_theta.shape or logp_t.shape != ids_t.shape:
        raise ValueError(
            f"merge shapes disagree: ids_theta {ids_theta.shape}, logp_theta {logp_theta.shape}, "
            f"ids_t {ids_t.shape}, logp_t {logp_t.shape}"
        )
    width = w_theta + ids_t.shape[1]
    token_ids = np.empty((batch, width), np.int64)
    raw_theta, raw_t = np.empty((batch, width)), np.empty((batch, width))
    rep_theta, rep_t = np.empty((batch, width), np.bool_), np.empty((batch, width), np.bool_)
    counts = np.empty(batch, np.int64)
    coverage_theta, coverage_t = np.empty(batch), np.empty(batch)
    merge_rows(
        ids_theta,
        logp_theta,
        ids_t,
        logp_t,
        FILL_CODES[fill],
        float(floor),
        -1 if vocab_size is None else int(vocab_size),
        token_ids,
        raw_theta,
        raw_t,
        rep_theta,
        rep_t,
        counts,
        coverage_theta,
        coverage_t,
        0,
        batch,
    )
    n = max(int(counts.max(initial=0)), 1)
    mask = np.arange(n) < counts[:, None]  # [B, n]
    return MergedTopK(
        token_ids[:, :n],
        raw_theta[:, :n],
        raw_t[:, :n],
        mask,
        rep_theta[:, :n],
        rep_t[:, :n],
        coverage_theta,
        coverage_t,
    )


def target(
    merged: MergedTopK,
    temperature: np.ndarray,
    fixed_alpha: np.ndarray,
    max_alpha: np.ndarray | None,
    *,
    tol: float,
    max_iter: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(tempered logp_theta, logp_t [B, n], alpha [B], log q* [B, n]) of merged rows; see target_rows."""
    counts = merged.mask.sum(axis=1)
    if counts.size and counts.min() == 0:
        raise ValueError("a row has no candidates: both servers reported an empty top-k")
    shape = merged.token_ids.shape
    lp_theta, lp_t, logq = np.empty(shape), np.empty(shape), np.empty(shape)
    alpha = np.empty(shape[0])
    caps = np.ones(shape[0]) if max_alpha is None else np.ascontiguousarray(max_alpha, np.float64)
    target_rows(
        np.ascontiguousarray(merged.logp_theta),
        np.ascontiguousarray(merged.logp_t),
        counts,
        np.ascontiguousarray(temperature, np.float64),
        np.ascontiguousarray(fixed_alpha, np.float64),
        caps,
        float(tol),
        int(max_iter),
        lp_theta,
        lp_t,
        alpha,
        logq,
        0,
        shape[0],
    )
    return lp_theta, lp_t, alpha, logq


def sample(logq: np.ndarray, mask: np.ndarray, uniforms: np.ndarray, greedy: np.ndarray) -> np.ndarray:
    """One candidate index per row -> int64 [B]; see sample_rows."""
    index = np.empty(logq.shape[0], np.int64)
    sample_rows(
        np.ascontiguousarray(logq),
        mask.sum(axis=1),
        np.ascontiguousarray(uniforms, np.float64),
        np.ascontiguousarray(greedy, np.bool_),
        index,
        0,
        logq.shape[0],
    )
    return index


class Step(NamedTuple):
    token_ids: np.ndarray  # int64 [B]
    alpha: np.ndarray  # float64 [B]
    logprob_q: np.ndarray  # float64 [B]
    logprob_theta: np.ndarray  # float64 [B], raw (or filled) logprob of the token
    logprob_t: np.ndarray  # float64 [B]
    coverage_theta: np.ndarray  # float64 [B]
    coverage_t: np.ndarray  # float64 [B]
    candidates: np.ndarray  # int64 [B, n]
    candidate_logq: np.ndarray  # float64 [B, n]


def step(
    ids_theta: np.ndarray,
    logp_theta: np.ndarray,
    ids_t: np.ndarray,
    logp_t: np.ndarray,
    *,
    temperature: np.ndarray,
    fixed_alpha: np.ndarray,
    max_alpha: np.ndarray | None,
    uniforms: np.ndarray,
    fill: FillRule,
    vocab_size: int | None,
    tol: float,
    max_iter: int,
    floor: float = DEFAULT_FLOOR,
    threads: int = 1,
) -> Step:
    """merge, target and sample in one compiled call: what they return, for a step's records;
    on up to `threads` of numba's threads (usable_threads)."""
    if fill not in FILL_RULES:
        raise ValueError(f"unknown fill rule {fill!r}; choose one of {FILL_RULES}")
    ids_theta, ids_t = np.ascontiguousarray(ids_theta, np.int64), np.ascontiguousarray(ids_t, np.int64)
    logp_theta, logp_t = np.ascontiguousarray(logp_theta, np.float64), np.ascontiguousarray(logp_t, np.float64)
    batch = ids_theta.shape[0]
    if ids_t.shape[0] != batch or logp_theta.shape != ids_theta.shape or logp_t.shape != ids_t.shape:
        raise ValueError(
            f"merge shapes disagree: ids_theta {ids_theta.shape}, logp_theta {logp_theta.shape}, "
            f"ids_t {ids_t.shape}, logp_t {logp_t.shape}"
        )
    shape = (batch, ids_theta.shape[1] + ids_t.shape[1])
    token_ids = np.empty(shape, np.int64)
    raw_theta, raw_t, lp_theta, lp_t, logq = (np.empty(shape) for _ in range(5))
    rep_theta, rep_t = np.empty(shape, np.bool_), np.empty(shape, np.bool_)
    counts, index = np.empty(batch, np.int64), np.empty(batch, np.int64)
    coverage_theta, coverage_t, alpha = np.empty(batch), np.empty(batch), np.empty(batch)
    chosen = np.empty((4, batch))
    threads = usable_threads(threads, batch)
    arrays = (
        ids_theta,
        logp_theta,
        ids_t,
        logp_t,
        FILL_CODES[fill],
        float(floor),
        -1 if vocab_size is None else int(vocab_size),
        np.ascontiguousarray(temperature, np.float64),
        np.ascontiguousarray(fixed_alpha, np.float64),
        np.ones(batch) if max_alpha is None else np.ascontiguousarray(max_alpha, np.float64),
        np.ascontiguousarray(uniforms, np.float64),
        np.ascontiguousarray(temperature == 0.0),
        float(tol),
        int(max_iter),
        token_ids,
        raw_theta,
        raw_t,
        rep_theta,
        rep_t,
        counts,
        coverage_theta,
        coverage_t,
        lp_theta,
        lp_t,
        alpha,
        logq,
        index,
        chosen,
    )
    if threads == 1:
        complete = step_rows(*arrays, 0, batch)
    else:
        numba.set_num_threads(threads)
        complete = step_rows_threaded(threads, *arrays)
    if not complete:
        raise ValueError("a row has no candidates: both servers reported an empty top-k")
    n = max(int(counts.max(initial=0)), 1)
    return Step(
        chosen[0].astype(np.int64),
        alpha,
        chosen[1],
        chosen[2],
        chosen[3],
        coverage_theta,
        coverage_t,
        token_ids[:, :n],
        logq[:, :n],
    )


def warm_up(threads: int = 1) -> None:
    """Load the compiled step now (from numba's cache, or by compiling it), with the argument
    types every scheduler passes, so that no request waits for it; with `threads` > 1 the
    threaded step too, and numba's thread pool."""
    for rows, chosen in {(1, 1), (2 * THREADED_MIN_ROWS, threads)}:
        ids = np.tile(np.array([[1, 2]], np.int64), (rows, 1))
        logprobs = np.tile(np.log(np.array([[0.6, 0.3]])), (rows, 1))
        step(
            ids,
            logprobs,
            ids,
            logprobs,
            temperature=np.ones(rows),
            fixed_alpha=np.full(rows, np.nan),
            max_alpha=None,
            uniforms=np.full(rows, 0.5),
            fill="min",
            vocab_size=None,
            tol=1e-6,
            max_iter=20,
            threads=chosen,
        )
