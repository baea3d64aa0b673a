"""Speculative q* sampling: several tokens per round trip, distributed as per-token q* sampling.

Opt-in with `CoordinatorConfig.speculative_gamma` = gamma > 0. Each round, for every
active sequence:

1. the drafter D (the base by default: alpha* is usually below 1/2, so q* is closer to it)
   proposes up to gamma tokens natively, with its top-k per position. With
   `speculative_proposal="sample"` it samples them from its own top-k at the sampling
   temperature: one seeded request per sequence, all concurrent (vLLM seeds every prompt
   of a batched request alike, which would draw identical drafts for identical contexts).
   With "argmax" it proposes its greedy continuation: one batched request per draft
   length for all sequences, the randomness staying in the coordinator's accept draws;
2. the scorer S returns its top-k before every drafted token: one batched next-token
   request with a prompt per drafted token (context + draft[:j]), split at
   `max_prompts_per_request`; not prompt_logprobs, whose cost grows with the context;
3. per position, the two top-k lists are merged and q* is solved exactly as in the
   per-token step (same fill rule, temperature, alpha* solver); the drafted tokens are
   kept up to the first one the speculative rule rejects, which is replaced by a draw
   from the residual (dualvllm.theory.speculative). A round yields 1 to gamma tokens.

Exact: every kept token is distributed as q* over the merged candidates, the very
distribution per-token mode samples from (the top-k approximation is the same), for any
drafter, because D's proposal distribution is known exactly (its top-k at temperature T,
renormalized, with vLLM `top_k` = k; or a point mass on its argmax). The records (alpha,
log q*, log pi_theta, log pi_t) are those per-token mode would write. Approximate, as in
per-token mode: q* is over the union of the two top-k lists with filled values. Not
bit-identical to per-token mode: the samples differ (the same distribution, other draws),
and D's logprobs come from its generation rather than from next-token requests (float
rounding). See theory/THEORY.md, section 7.

Stops are the coordinator's own: drafts run past EOS, and a sequence keeps the round's
tokens only up to the one that ends it (EOS, stop token, stop string, max_tokens, context
limit). A failed draft request fails the sequences it carried (one, when sampling); a failed
scoring request the sequences it carried.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from dualvllm.coordinator.scheduler import Scheduler
from dualvllm.coordinator.sequence import SamplingParams, SequenceState
from dualvllm.coordinator import kernel
from dualvllm.coordinator.step import Target, solve_target
from dualvllm.common.errors import DualVLLMError, InvalidInputError
from dualvllm.engines.protocol import Draft, SpeculativeEngine, TopKBatch
from dualvllm.theory.diagnostics import token_diagnostics
from dualvllm.theory.speculative import (
    NOT_A_CANDIDATE,
    RoundDecision,
    decide_round,
    draft_logprobs,
    point_mass_logprobs,
)

log = logging.getLogger("dualvllm.coordinator")
# vLLM takes a seed in [-2^63, 2^63).
SEED_BOUND = 2**63


@dataclass
class AcceptanceStats:
    """Counters of the speculative rule, summed over rounds and sequences."""

    rounds: int = 0  # sequence-rounds (one draft each)
    drafted: int = 0  # tokens drafted
    judged: int = 0  # drafted tokens the rule looked at (up to and including the first rejection)
    accepted: int = 0  # of those, kept
    emitted: int = 0  # tokens appended to sequences (kept drafts and replacements, after stops)

    def summary(self) -> dict[str, float]:
        return {
            "speculative_rounds": self.rounds,
            "speculative_drafted_tokens": self.drafted,
            "speculative_acceptance_rate": self.accepted / self.judged if self.judged else float("nan"),
            "speculative_tokens_per_round": self.emitted / self.rounds if self.rounds else float("nan"),
        }


@dataclass
class TokenRecord:
    """One emitted token and what per-token mode would record for it."""

    token: int
    alpha: float
    logprob_q: float
    logprob_theta: float
    logprob_t: float
    coverage_theta: float
    coverage_t: float
    diagnostics: dict[str, float] = field(default_factory=dict)


def speculative_scheduler(theta: object, t: object) -> type[Scheduler]:
    """SpeculativeScheduler, once both engines are known to support speculative rounds."""
    for engine in (theta, t):
        if not isinstance(engine, SpeculativeEngine):
            raise InvalidInputError(
                f"speculative_gamma > 0 needs engines that draft and score continuations (the vLLM "
                f"client, TransformersEngine); {type(engine).__name__} does not. Set speculative_gamma=0."
            )
    return SpeculativeScheduler


class SpeculativeScheduler(Scheduler):
    """The continuous batch of `Scheduler`, advanced by speculative rounds instead of steps."""

    mode = "speculative"

    def __init__(self, theta: SpeculativeEngine, t: SpeculativeEngine, **kwargs) -> None:
        super().__init__(theta, t, **kwargs)
        self._drafter_is_theta = self._config.speculative_drafter == "theta"
        self._drafter, self._scorer = (theta, t) if self._drafter_is_theta else (t, theta)
        self._argmax = self._config.speculative_proposal == "argmax"
        self.acceptance = AcceptanceStats()

    def statistics(self) -> dict[str, float]:
        return self.acceptance.summary()

    def check(self, params: SamplingParams) -> None:
        # A round's draft and its acceptance use the config's top_k and no cap on alpha.
        if params.top_k is not None or params.top_logprobs or params.record_topk or params.max_alpha is not None:
            raise InvalidInputError(
                "a per-call top_k, top_logprobs, record_topk and max_alpha are not available in "
                "speculative mode; use per-token or lockstep mode (speculative_gamma=0)"
            )

    def _draft_context(self, seq: SequenceState) -> list[int]:
        return seq.theta_context() if self._drafter_is_theta else seq.t_context()

    def _score_context(self, seq: SequenceState) -> list[int]:
        return seq.t_context() if self._drafter_is_theta else seq.theta_context()

    def _draft_length(self, seq: SequenceState) -> int:
        """gamma, cut so the round cannot pass max_tokens or the servers' context limit."""
        room = self._max_len - max(len(seq.theta_prompt_ids), len(seq.t_prompt_ids)) - len(seq.tokens)
        return max(1, min(self._config.speculative_gamma, seq.params.max_tokens - len(seq.tokens), room))

    async def _step(self, active: list[SequenceState]) -> None:
        started = time.perf_counter()
        drafted = await (self._draft_argmax(active) if self._argmax else self._draft_sampled(active))
        kept = _answered(active, drafted, f"{self._drafter.name} server, draft")
        sequences = [active[i] for i in kept]
        drafts: list[Draft] = [drafted[i] for i in kept]  # type: ignore[misc]
        scored = await self._score(sequences, drafts)
        kept = _answered(sequences, scored, f"{self._scorer.name} server")
        if not kept:
            return
        sequences, drafts = [sequences[i] for i in kept], [drafts[i] for i in kept]
        records = self._judge(sequences, drafts, [scored[i] for i in kept])  # type: ignore[misc]
        counts = await asyncio.gather(*(self._emit(seq, recs) for seq, recs in zip(sequences, records)))
        emitted = [rec for recs, n in zip(records, counts) for rec in recs[:n]]
        self.acceptance.emitted += len(emitted)
        self._stats.record_step(
            len(emitted),
            sum(r.alpha for r in emitted),
            time.perf_counter() - started,
            sum(r.coverage_theta for r in emitted),
            sum(r.coverage_t for r in emitted),
        )
        self._warn_if_k_is_too_small()

    async def _draft_sampled(self, active: list[SequenceState]) -> list[Draft | BaseException]:
        """One seeded request per sequence, all concurrent -> a Draft or the error, per sequence."""
        k = self._config.top_k
        seeds = [int(seq.rng.integers(SEED_BOUND)) for seq in active]
        return await asyncio.gather(
            *(
                self._drafter.draft(
                    self._draft_context(seq),
                    max_tokens=self._draft_length(seq),
                    k=k,
                    temperature=seq.params.temperature,
                    seed=seed,
                )
                for seq, seed in zip(active, seeds)
            ),
            return_exceptions=True,
        )

    async def _draft_argmax(self, active: list[SequenceState]) -> list[Draft | BaseException]:
        """Batched greedy requests, one per draft length (vLLM takes one max_tokens per request)
        and per max_prompts_per_request sequences, all concurrent."""
        by_length: dict[int, list[int]] = {}
        for i, seq in enumerate(active):
            by_length.setdefault(self._draft_length(seq), []).append(i)
        limit = self._config.max_prompts_per_request
        requests = [
            (length, members[start : start + limit])
            for length, members in by_length.items()
            for start in range(0, len(members), limit)
        ]
        answers = await asyncio.gather(
            *(
                self._drafter.draft_argmax(
                    [self._draft_context(active[i]) for i in members], max_tokens=length, k=self._config.top_k
                )
                for length, members in requests
            ),
            return_exceptions=True,
        )
        return _per_item([members for _, members in requests], answers, len(active))

    async def _score(self, sequences: list[SequenceState], drafts: list[Draft]) -> list[TopKBatch | BaseException]:
        """The scorer's top-k before every drafted token: one request per max_prompts_per_request
        drafted tokens (the scorer gets one prompt per token), all concurrent."""
        chunks = _chunks([d.token_ids.shape[0] for d in drafts], self._config.max_prompts_per_request)
        answers = await asyncio.gather(
            *(
                self._scorer.score_continuations(
                    [self._score_context(sequences[i]) for i in chunk],
                    [drafts[i].token_ids.tolist() for i in chunk],
                    self._config.top_k,
                )
                for chunk in chunks
            ),
            return_exceptions=True,
        )
        return _per_item(chunks, answers, len(sequences))

    def _judge(
        self, sequences: list[SequenceState], drafts: list[Draft], scored: list[TopKBatch]
    ) -> list[list[TokenRecord]]:
        """q* at every drafted position and the speculative rule -> the tokens each sequence may keep."""
        lengths = np.array([d.token_ids.shape[0] for d in drafts], dtype=np.int64)  # [S]
        drafted = TopKBatch.concat([d.topk for d in drafts])
        scoring = TopKBatch.concat(scored)
        theta, t = (drafted, scoring) if self._drafter_is_theta else (scoring, drafted)
        params = [s.params for s in sequences]
        temperature = np.repeat([p.temperature for p in params], lengths)  # [R]
        fixed = np.repeat([np.nan if p.fixed_alpha is None else p.fixed_alpha for p in params], lengths)
        cfg = self._config
        merged = kernel.merge(
            theta.token_ids, theta.logprobs, t.token_ids, t.logprobs, fill=cfg.fill_rule, vocab_size=self._vocab_size
        )
        target = solve_target(merged, temperature, fixed, alpha_tol=cfg.alpha_tol, alpha_max_iter=cfg.alpha_max_iter)
        tokens = np.concatenate([d.token_ids for d in drafts])  # [R]
        hit = merged.token_ids == tokens[:, None]  # [R, n]
        draft_index = np.where(hit.any(axis=1), hit.argmax(axis=1), NOT_A_CANDIDATE)
        greedy = temperature == 0.0
        if self._argmax:
            logp = point_mass_logprobs(draft_index, merged.token_ids.shape[1])
        else:
            reported, raw = (
                (merged.reported_theta, merged.logp_theta)
                if self._drafter_is_theta
                else (merged.reported_t, merged.logp_t)
            )
            logp = draft_logprobs(raw, reported, np.where(greedy, 1.0, temperature))
        accept_u = np.concatenate([s.rng.random(n) for s, n in zip(sequences, lengths)])
        residual_u = np.concatenate([s.rng.random(n) for s, n in zip(sequences, lengths)])
        decision = decide_round(target.logq, logp, merged.mask, draft_index, lengths, greedy, accept_u, residual_u)
        diagnostics = None
        if any(p.return_diagnostics for p in params):
            diagnostics = token_diagnostics(
                target.logp_theta, target.logp_t, target.logq, merged.mask, merged.coverage_theta, merged.coverage_t
            )
        self._count(decision, lengths)
        return _records(target, decision, draft_index, lengths, diagnostics)

    def _count(self, decision: RoundDecision, lengths: np.ndarray) -> None:
        stats = self.acceptance
        stats.rounds += int(lengths.shape[0])
        stats.drafted += int(lengths.sum())
        stats.judged += int(np.minimum(decision.accepted + 1, lengths).sum())
        stats.accepted += int(decision.accepted.sum())

    async def _emit(self, seq: SequenceState, records: list[TokenRecord]) -> int:
        """Append the round's tokens, stopping where per-token mode would have stopped -> how many."""
        before = len(seq.tokens)
        for record in records:
            self._append(seq, record)
            if seq.finish_reason is not None:
                break
        if seq.params.stop and seq.error is None:
            text = await self._delivery.text(seq)
            if text is not None and any(stop in text for stop in seq.params.stop):
                await self._replay_until_stop_string(seq, records, before)
            elif text is not None:
                seq.check_stop_strings(text)
        seq.publish()
        return len(seq.tokens) - before

    async def _replay_until_stop_string(self, seq: SequenceState, records: list[TokenRecord], before: int) -> None:
        """Per-token mode checks stop strings after every token: end at the token that made one."""
        seq.truncate(before)
        for record in records:
            self._append(seq, record)
            text = await self._delivery.text(seq)
            if text is None:
                return
            seq.check_stop_strings(text)
            if seq.finish_reason is not None:
                return

    def _append(self, seq: SequenceState, record: TokenRecord) -> None:
        seq.append(
            record.token,
            record.alpha,
            record.logprob_q,
            record.logprob_theta,
            record.logprob_t,
            record.diagnostics,
            self._eos_ids,
            self._max_len,
        )


def _chunks(sizes: list[int], limit: int) -> list[list[int]]:
    """Consecutive index groups whose sizes sum to at most `limit` (an item larger than it alone)."""
    chunks: list[list[int]] = []
    total = limit + 1
    for i, size in enumerate(sizes):
        if total + size > limit:
            chunks.append([])
            total = 0
        chunks[-1].append(i)
        total += size
    return chunks


def _per_item(groups: list[list[int]], answers: list, count: int) -> list:
    """Each item's element of its group's answer, or the group's exception -> list of `count`."""
    out: list = [None] * count
    for members, answer in zip(groups, answers):
        for j, i in enumerate(members):
            out[i] = answer if isinstance(answer, BaseException) else answer[j]
    return out


def _answered(sequences: list[SequenceState], results: list, what: str) -> list[int]:
    """Indices of the sequences whose request answered; the others fail with its error (a
    failed request fails only the sequences it carried). Non-server errors propagate."""
    kept, failed = [], 0
    for i, (seq, result) in enumerate(zip(sequences, results)):
        if isinstance(result, DualVLLMError):
            seq.fail(f"{what}: {result}")
            failed += 1
        elif isinstance(result, BaseException):
            raise result
        else:
            kept.append(i)
    if failed:
        log.warning(
            "%s: request failed for %d sequences: %s",
            what,
            failed,
            next(r for r in results if isinstance(r, DualVLLMError)),
        )
    return kept


def _records(
    target: Target,
    decision: RoundDecision,
    draft_index: np.ndarray,
    lengths: np.ndarray,
    diagnostics: dict[str, np.ndarray] | None,
) -> list[list[TokenRecord]]:
    """Per sequence: its kept drafted tokens, then the replacement if one was drawn."""
    merged = target.merged
    out = []
    offset = 0
    for s, length in enumerate(lengths.tolist()):
        kept = int(decision.accepted[s])
        picks = [(offset + j, int(draft_index[offset + j])) for j in range(kept)]
        if decision.replacement[s] >= 0:
            picks.append((offset + kept, int(decision.replacement[s])))
        out.append(
            [
                TokenRecord(
                    token=int(merged.token_ids[r, j]),
                    alpha=float(target.alpha[r]),
                    logprob_q=float(target.logq[r, j]),
                    logprob_theta=float(merged.logp_theta[r, j]),
                    logprob_t=float(merged.logp_t[r, j]),
                    coverage_theta=float(merged.coverage_theta[r]),
                    coverage_t=float(merged.coverage_t[r]),
                    diagnostics={key: float(v[r]) for key, v in diagnostics.items()} if diagnostics else {},
                )
                for r, j in picks
            ]
        )
        offset += length
    return out
