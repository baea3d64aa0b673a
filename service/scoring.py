"""Log q* of a given text: what `echo` with `logprobs` returns (lm-eval's loglikelihood requests).

For every prompt token y_j after the first, both servers report their top-k before it in
one prompt-logprobs request each (dualvllm.engines.protocol.PromptScoringEngine), always with y_j's
own logprob among them. The rows then go through the same math as a sampling step:
merge_topk with the coordinator's fill rule, then dualvllm.coordinator.step.solve_target (alpha*
per position, or the request's fixed alpha; temperature 1), and log q*(y_j) is read off
the merged candidates. Since both servers report y_j, it is always a candidate with its
exact logprobs, even where it is outside both top-k lists (sampling would never draw
it there, and would give it log q* = -inf). q* is normalized over the candidates, as
when sampling, so at alpha 0 a token's log q* is the base's logprob renormalized over
them: above the raw value by -log(the candidates' mass). On the bundled models at k = 20
the echoed q*(y) is within 5e-4 of the exact full-vocabulary value on average
(benchmarks/lm_eval_loglikelihood.py, docs/service.md).

Pure math (`score_rows`) apart from the two server calls (`score_prompts`).
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Protocol
from collections.abc import Mapping, Sequence

import numpy as np

from dualvllm.coordinator.step import solve_target, top_candidates
from dualvllm.engines.protocol import Engine, PromptScoringEngine, TopKBatch
from dualvllm.service.errors import RequestError
from dualvllm.theory.merge import FillRule, merge_topk


@dataclass(frozen=True)
class ScoringSettings:
    """How prompt tokens are scored: the sampling settings that shape q*."""

    top_k: int  # candidates asked of each server per position
    fill: FillRule
    vocab_size: int | None  # for the "spread" fill rule
    alpha_tol: float
    alpha_max_iter: int
    fixed_alpha: float | None  # None = solve alpha* per position
    top_n: int  # q*'s most likely candidates returned per position (OpenAI's `logprobs`)


@dataclass(frozen=True)
class RowScores:
    """Per scored position (row): the token's log q* and what it was built from."""

    alpha: np.ndarray  # float64 [R]
    logprob_q: np.ndarray  # float64 [R], log q*(token) over the merged candidates
    logprob_theta: np.ndarray  # float64 [R], the base's raw logprob of the token
    logprob_t: np.ndarray  # float64 [R]
    top: list[dict[int, float]]  # per row, q*'s top_n candidates {id: log q*}, most likely first
    rank: np.ndarray  # int64 [R], the token's rank under q* among the merged candidates (1 = likeliest)


@dataclass(frozen=True)
class PromptScores:
    """One prompt, position by position; position 0 has no distribution (None), as in OpenAI's echo."""

    token_ids: list[int]
    alpha: list[float | None]
    logprob_q: list[float | None]
    logprob_theta: list[float | None]
    logprob_t: list[float | None]
    top: list[dict[int, float] | None]
    rank: list[int | None]  # the token's rank under q* (1 = likeliest)


def score_rows(theta: TopKBatch, t: TopKBatch, tokens: np.ndarray, settings: ScoringSettings) -> RowScores:
    """log q* of `tokens` (int64 [R]) under the rows' top-k (both [R, w], each row holding its token)."""
    merged = merge_topk(
        theta.token_ids, theta.logprobs, t.token_ids, t.logprobs, fill=settings.fill, vocab_size=settings.vocab_size
    )
    rows = tokens.shape[0]
    fixed = np.full(rows, np.nan if settings.fixed_alpha is None else settings.fixed_alpha)
    target = solve_target(
        merged, np.ones(rows), fixed, alpha_tol=settings.alpha_tol, alpha_max_iter=settings.alpha_max_iter
    )
    hits = merged.token_ids == tokens[:, None]  # [R, n]; merged ids are unique per row
    assert bool(np.all(hits.sum(axis=1) == 1)), "every scored token must be one of its row's candidates"
    column = np.argmax(hits, axis=1)  # [R]
    at = np.arange(rows)
    logprob_q = target.logq[at, column]
    return RowScores(
        alpha=target.alpha,
        logprob_q=logprob_q,
        logprob_theta=merged.logp_theta[at, column],
        logprob_t=merged.logp_t[at, column],
        top=top_candidates(merged.token_ids, target.logq, settings.top_n),
        rank=1 + (target.logq > logprob_q[:, None]).sum(axis=1),
    )


class PromptScorer(Protocol):
    """What scoring needs of each model: PromptScoringEngine's prompt_topk (an engine, or the
    service's batched front of one, dualvllm.service.batching)."""

    async def prompt_topk(self, prompts: Sequence[Sequence[int]], k: int) -> list[TopKBatch]: ...


def scoring_engine(engine: Engine, param: str) -> PromptScoringEngine:
    """`engine`, checked to score prompts (vLLM's prompt logprobs), else a 400 naming `param`."""
    if not isinstance(engine, PromptScoringEngine):
        raise RequestError(
            f"{param} needs model servers that score prompts (vLLM); the {engine.name} engine cannot",
            code="unsupported_parameter",
            param=param,
        )
    return engine


async def score_prompts(
    theta: PromptScorer, t: PromptScorer, prompts: Sequence[Sequence[int]], settings: ScoringSettings
) -> list[PromptScores]:
    """Every prompt token's log q*: one prompt-logprobs request per server for all prompts."""
    theta_rows, t_rows = await asyncio.gather(
        theta.prompt_topk(prompts, settings.top_k), t.prompt_topk(prompts, settings.top_k)
    )
    tokens = np.fromiter((tok for p in prompts for tok in p[1:]), np.int64)  # [R], every prompt's rows in turn
    scores = score_rows(TopKBatch.concat(theta_rows), TopKBatch.concat(t_rows), tokens, settings)
    answers, start = [], 0
    for prompt in prompts:
        end = start + len(prompt) - 1
        answers.append(
            PromptScores(
                token_ids=list(prompt),
                alpha=[None, *scores.alpha[start:end].tolist()],
                logprob_q=[None, *_finite(scores.logprob_q[start:end])],
                logprob_theta=[None, *_finite(scores.logprob_theta[start:end])],
                logprob_t=[None, *_finite(scores.logprob_t[start:end])],
                top=[None, *scores.top[start:end]],
                rank=[None, *scores.rank[start:end].tolist()],
            )
        )
        start = end
    return answers


def vllm_prompt_logprobs(scores: PromptScores, texts: Mapping[int, str]) -> list[dict[str, dict] | None]:
    """One scored prompt in vLLM's `prompt_logprobs` shape: None at position 0, then per position
    {"<id>": {"logprob", "rank", "decoded_token"}} over q*'s top candidates (ranks 1, 2, ...)
    and the position's own token at its rank under q*. `texts`: every id's text."""
    rows: list[dict[str, dict] | None] = [None]
    for token, value, rank, top in zip(scores.token_ids[1:], scores.logprob_q[1:], scores.rank[1:], scores.top[1:]):
        assert top is not None and value is not None and rank is not None, "positions after the first are scored"
        row = {str(i): {"logprob": v, "rank": r, "decoded_token": texts[i]} for r, (i, v) in enumerate(top.items(), 1)}
        row[str(token)] = {"logprob": value, "rank": rank, "decoded_token": texts[token]}
        rows.append(row)
    return rows


# What JSON carries for a token a model gives probability 0 (vLLM's and OpenAI's value for -inf).
NEG_INF_LOGPROB = -9999.0


def _finite(values: np.ndarray) -> list[float]:
    return [v if math.isfinite(v) else NEG_INF_LOGPROB for v in values.tolist()]
