"""Merge two models' top-k next-token lists into one candidate set per row.

Each server reports only its own top-k, so a candidate one model ranked highly may be
missing from the other model's list. The candidate set is the union of both lists (at
the token-id level), and a missing logprob gets a fill value chosen by a `FillRule`:

- "min" (default): the model's smallest reported logprob in that row. Every unreported
  token ranks below every reported one, so this is an upper bound on its true logprob:
  it never makes the other model's favourite look more impossible than it is.
- "floor": a fixed floor (default -100): what the reference implementation did. It
  treats unreported tokens as impossible, which pushes alpha* towards the model that
  reported them; kept for comparison.
- "spread": the model's uncovered mass (1 - sum of its reported probabilities) split
  evenly over every token it did not report (vocab_size - reported; over the missing
  candidates when the vocabulary size is not given), capped at the "min" upper bound:
  the average probability of an unreported token.

How much each rule moves alpha* and q* against the exact full-vocabulary computation is
measured in benchmarks/topk_error.py.

Everything is vectorized: inputs are padded [B, w] arrays (id -1 / logprob -inf for
padding), outputs padded [B, n] arrays with a mask, n = the largest union in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

FillRule = Literal["min", "floor", "spread"]
FILL_RULES: tuple[FillRule, ...] = ("min", "floor", "spread")
DEFAULT_FLOOR = -100.0
PAD_ID = -1
PAD_KEY = np.iinfo(np.int64).max  # sort key of padding: after every real candidate


@dataclass(frozen=True)
class MergedTopK:
    """The union of both top-k lists per row; entries past a row's count are masked."""

    token_ids: np.ndarray  # int64 [B, n], PAD_ID where masked
    logp_theta: np.ndarray  # float64 [B, n], reported or filled; -inf where masked
    logp_t: np.ndarray  # float64 [B, n]
    mask: np.ndarray  # bool [B, n]
    reported_theta: np.ndarray  # bool [B, n], the base model reported this candidate
    reported_t: np.ndarray  # bool [B, n], the teacher reported it
    coverage_theta: np.ndarray  # float64 [B], probability mass of the base's reported tokens
    coverage_t: np.ndarray  # float64 [B]


def merge_topk(
    ids_theta: np.ndarray,
    logp_theta: np.ndarray,
    ids_t: np.ndarray,
    logp_t: np.ndarray,
    *,
    fill: FillRule = "min",
    floor: float = DEFAULT_FLOOR,
    vocab_size: int | None = None,
) -> MergedTopK:
    """Union of the two lists per row, with missing logprobs filled by `fill` (see module doc).

    `ids_*`: int [B, w] token ids, PAD_ID for padding; `logp_*`: float [B, w] raw logprobs.
    A token id must appear at most once per row in each list. `vocab_size` is used by
    the "spread" rule only.
    """
    if fill not in FILL_RULES:
        raise ValueError(f"unknown fill rule {fill!r}; choose one of {FILL_RULES}")
    ids_theta, ids_t = np.asarray(ids_theta, dtype=np.int64), np.asarray(ids_t, dtype=np.int64)
    logp_theta, logp_t = np.asarray(logp_theta, dtype=np.float64), np.asarray(logp_t, dtype=np.float64)
    batch, w_theta = ids_theta.shape
    if ids_t.shape[0] != batch or logp_theta.shape != ids_theta.shape or logp_t.shape != ids_t.shape:
        raise ValueError(
            f"merge_topk shapes disagree: ids_theta {ids_theta.shape}, logp_theta "
            f"{logp_theta.shape}, ids_t {ids_t.shape}, logp_t {logp_t.shape}"
        )

    # Pool both lists and sort each row by token id. The sort key packs the column into
    # the low bits (ids are unique per list, so keys are unique and one plain sort does it);
    # a token both reported then sits in two adjacent slots, the base's first (lower column).
    ids = np.concatenate([ids_theta, ids_t], axis=1)  # [B, w1 + w2]
    col_bits = max((ids.shape[1] - 1).bit_length(), 1)
    if ids.size and int(ids.max()) >= 1 << (62 - col_bits):
        raise ValueError(f"token id {int(ids.max())} is too large to merge (the limit is 2**{62 - col_bits})")
    keys = np.where(ids != PAD_ID, (ids << col_bits) | np.arange(ids.shape[1]), PAD_KEY)
    keys.sort(axis=1)
    valid = keys != PAD_KEY
    col = np.where(valid, keys & ((1 << col_bits) - 1), 0)  # [B, w1 + w2], source column
    ids = np.where(valid, keys >> col_bits, PAD_ID)
    vals = np.take_along_axis(np.concatenate([logp_theta, logp_t], axis=1), col, 1)
    from_theta = col < w_theta

    same_as_next = np.zeros_like(valid)
    same_as_next[:, :-1] = valid[:, 1:] & (ids[:, :-1] == ids[:, 1:])
    first = valid.copy()
    first[:, 1:] &= ~same_as_next[:, :-1]
    nxt = np.concatenate([vals[:, 1:], np.full((batch, 1), np.nan)], axis=1)
    val_theta = np.where(from_theta, vals, np.nan)
    val_t = np.where(from_theta, np.where(same_as_next, nxt, np.nan), vals)

    # Compact the kept slots to the front of each row (in order, so ids stay sorted).
    counts = first.sum(axis=1)  # [B]
    width = max(int(counts.max(initial=0)), 1)
    mask = np.arange(width) < counts[:, None]  # [B, n]
    token_ids = np.full((batch, width), PAD_ID, dtype=np.int64)
    raw_theta = np.full((batch, width), np.nan)
    raw_t = np.full((batch, width), np.nan)
    token_ids[mask], raw_theta[mask], raw_t[mask] = ids[first], val_theta[first], val_t[first]
    reported_theta, reported_t = mask & ~np.isnan(raw_theta), mask & ~np.isnan(raw_t)

    coverage_theta = _coverage(logp_theta, ids_theta != PAD_ID)
    coverage_t = _coverage(logp_t, ids_t != PAD_ID)
    filled_theta = _fill(raw_theta, reported_theta, mask, coverage_theta, fill, floor, vocab_size)
    filled_t = _fill(raw_t, reported_t, mask, coverage_t, fill, floor, vocab_size)
    return MergedTopK(token_ids, filled_theta, filled_t, mask, reported_theta, reported_t, coverage_theta, coverage_t)


def _coverage(logp: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Probability mass of the reported tokens per row, capped at 1 against rounding."""
    return np.minimum(np.sum(np.where(valid, np.exp(np.where(valid, logp, -np.inf)), 0.0), axis=1), 1.0)


def _fill(
    raw: np.ndarray,
    reported: np.ndarray,
    mask: np.ndarray,
    coverage: np.ndarray,
    rule: FillRule,
    floor: float,
    vocab_size: int | None,
) -> np.ndarray:
    """Reported values where present, the rule's fill value for missing candidates, -inf on padding."""
    # A row where this model reported nothing has no min: fall back to the floor.
    smallest = np.min(np.where(reported, raw, np.inf), axis=1)  # [B]
    upper = np.where(np.isfinite(smallest), smallest, floor)  # [B]
    if rule == "min":
        value = upper
    elif rule == "floor":
        value = np.minimum(np.full_like(upper, floor), upper)
    else:
        missing = (
            vocab_size - np.sum(reported, axis=1) if vocab_size is not None else np.sum(mask & ~reported, axis=1)
        )  # [B]
        with np.errstate(divide="ignore"):
            spread = np.log(np.maximum(1.0 - coverage, 0.0)) - np.log(np.maximum(missing, 1))
        value = np.minimum(np.maximum(spread, floor), upper)
    return np.where(reported, raw, np.where(mask, value[:, None], -np.inf))
