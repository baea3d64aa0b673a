"""Continuous batching of sequences over the two engines.

One background task runs steps while there is work. Each step sends ONE batched
request per server for all active sequences, to both servers concurrently, samples one
token per sequence, and retires finished sequences; waiting sequences take their places.
A request that fails after its retries fails only the sequences it carried.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import operator
import time
from collections import deque
from types import MappingProxyType
from typing import AsyncContextManager, Protocol, TypeVar
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence

import numpy as np

from dualvllm.coordinator.config import CoordinatorConfig
from dualvllm.coordinator.delivery import Delivery
from dualvllm.coordinator.sequence import SamplingParams, SequenceState
from dualvllm.coordinator.stats import Statistics, StepTiming
from dualvllm.coordinator.step import StepResult, keep_top, mix_and_sample, top_candidates
from dualvllm.common.errors import DualVLLMError
from dualvllm.common.tasks import stop
from dualvllm.engines.protocol import PAD_TOKEN_ID, Engine, TopKBatch

log = logging.getLogger("dualvllm.coordinator")
# Tokens to average over before judging top-k coverage: the first few can be unusual.
COVERAGE_WARNING_MIN_TOKENS = 64
# A cancelled step ends at its next await (its HTTP requests are cancelled); the bound turns a bug into an error.
STOP_S = 30.0
T = TypeVar("T")


class Scheduling(Protocol):
    """What the coordinator asks of a scheduler, whichever mode it runs (per-token, speculative,
    lockstep): the coordinator never branches on the scheduler's type."""

    mode: str  # "per_token", "speculative" or "lockstep"

    @property
    def max_len(self) -> int: ...

    @property
    def capacity(self) -> int:
        """Sequences generated at once; more wait in the queue."""
        ...

    def submit(self, sequences: list[SequenceState]) -> None: ...

    async def close(self) -> None: ...

    def paused(self) -> AsyncContextManager[None]:
        """Hold generation while the caller changes a server (see DualVLLMCoordinator.paused)."""
        ...

    def statistics(self) -> dict[str, float]:
        """The mode's own counters, merged into DualVLLMCoordinator.get_statistics."""
        ...

    def check(self, params: SamplingParams) -> None:
        """Raise InvalidInputError if this mode cannot honour `params` (before anything starts)."""
        ...


class Scheduler:
    """Per-token mode: one batched request per server per step."""

    mode = "per_token"

    def __init__(
        self,
        theta: Engine,
        t: Engine,
        *,
        config: CoordinatorConfig,
        eos_ids: frozenset[int],
        max_len: int,
        stats: Statistics,
        vocab_size: int | None = None,
    ) -> None:
        """`vocab_size` (None = unknown) lets the "spread" fill rule spread over the vocabulary."""
        self._theta, self._t = theta, t
        self._config = config
        self._eos_ids = eos_ids
        self._max_len = max_len
        self._stats = stats
        self._vocab_size = vocab_size
        self._coverage_warned = False
        self._waiting: deque[SequenceState] = deque()
        self._active: list[SequenceState] = []
        self._work = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._delivery = Delivery(theta, stats)

    @property
    def max_len(self) -> int:
        return self._max_len

    @property
    def capacity(self) -> int:
        return self._config.max_batch_size

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        # Every step is its own request, which the server's /pause already fences: nothing to hold.
        yield

    def statistics(self) -> dict[str, float]:
        return {}

    def check(self, params: SamplingParams) -> None:
        return None  # every per-token setting is available

    def submit(self, sequences: list[SequenceState]) -> None:
        self._waiting.extend(sequences)
        self._work.set()
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="dualvllm-scheduler")

    async def close(self) -> None:
        """Stop stepping; every unfinished sequence is returned with an error."""
        await stop(self._task, what="the per-token scheduler", timeout_s=STOP_S)
        self._task = None
        for seq in [*self._active, *self._waiting]:
            seq.fail("the coordinator was closed before this sequence finished")
            self._delivery.deliver(seq, text="")
        self._active.clear()
        self._waiting.clear()
        await self._delivery.aclose()

    async def _run(self) -> None:
        while True:
            if not self._active and not self._waiting:
                self._work.clear()
                await self._work.wait()
            self._admit()
            if not self._active:
                continue
            try:
                await self._step(self._active)
            except Exception as exc:  # a bug must not hang the callers or every later call
                log.exception("coordinator step failed")
                for seq in self._active:
                    seq.fail(f"internal error in the coordinator step: {exc!r}")
            still_active = []
            for seq in self._active:
                if seq.finish_reason is None:
                    still_active.append(seq)
                else:
                    self._delivery.retire(seq)
            self._active = still_active

    def _admit(self) -> None:
        self._active = [s for s in self._active if not s.cancelled]
        while self._waiting and len(self._active) < self._config.max_batch_size:
            seq = self._waiting.popleft()
            if not seq.cancelled:
                self._active.append(seq)

    async def _step(self, active: list[SequenceState]) -> None:
        started = time.perf_counter()
        k = self._config.top_k
        keys = [s.key for s in active]
        (theta_result, theta_s), (t_result, t_s) = await asyncio.gather(
            _timed(self._theta.next_token_topk([s.theta_context() for s in active], k, keys)),
            _timed(self._t.next_token_topk([s.t_context() for s in active], k, keys)),
        )
        answered = time.perf_counter()
        for engine, result in ((self._theta, theta_result), (self._t, t_result)):
            if isinstance(result, DualVLLMError):
                log.warning("%s request for %d sequences failed: %s", engine.name, len(active), result)
                for seq in active:
                    seq.fail(f"{engine.name} server: {result}")
                return
            if isinstance(result, BaseException):
                raise result
        assert isinstance(theta_result, TopKBatch) and isinstance(t_result, TopKBatch)

        step = sample_rows(active, theta_result, t_result, self._config, self._vocab_size)
        record_rows(active, step, self._eos_ids, self._max_len, theta_result, t_result)
        await self._delivery.check_stop_strings([s for s in active if s.params.stop and s.error is None])
        finished = time.perf_counter()
        merge_s, alpha_s, sample_s = step.phase_s
        timing = StepTiming(
            batch=len(active),
            theta_s=theta_s,
            t_s=t_s,
            servers_s=answered - started,
            merge_s=merge_s,
            alpha_s=alpha_s,
            sample_s=sample_s,
            # what _sample spent outside the three phases (building its inputs) counts here too
            bookkeeping_s=(finished - answered) - (merge_s + alpha_s + sample_s),
            total_s=finished - started,
        )
        self._stats.record_step(
            len(active),
            float(step.alpha.sum()),
            finished - started,
            float(step.coverage_theta.sum()),
            float(step.coverage_t.sum()),
            timing,
        )
        self._warn_if_k_is_too_small()

    def _warn_if_k_is_too_small(self) -> None:
        """Once per coordinator: the top-k lists hold too little of the models' mass."""
        stats, threshold = self._stats, self._config.min_coverage_warning
        if self._coverage_warned or stats.tokens < COVERAGE_WARNING_MIN_TOKENS:
            return
        means = {"base": stats.coverage_theta_sum / stats.tokens, "teacher": stats.coverage_t_sum / stats.tokens}
        low = {name: mean for name, mean in means.items() if mean < threshold}
        if low:
            self._coverage_warned = True
            described = ", ".join(f"{name} {mean:.3f}" for name, mean in low.items())
            log.warning(
                "top_k=%d covers little of the models' probability mass (mean over %d tokens: %s; "
                "warning below %.2f): q* and alpha* are then approximate. Raise top_k (and the "
                "servers' --max-logprobs); see theory/THEORY.md for the measured error.",
                self._config.top_k,
                stats.tokens,
                described,
                threshold,
            )


def sample_rows(
    sequences: list[SequenceState], theta: TopKBatch, t: TopKBatch, config: CoordinatorConfig, vocab_size: int | None
) -> StepResult:
    """One token for each sequence from both servers' top-k rows (in sequence order), each
    drawn with the sequence's own sampler and settings: the step of every per-token mode."""
    n = len(sequences)
    params = [s.params for s in sequences]
    if _one_object(params):  # a step's sequences usually come from one call: its settings, read once
        params = params[:1]

    def per_row(values: list[float]) -> np.ndarray:
        return np.full(n, values[0], dtype=np.float64) if len(values) == 1 else np.array(values, dtype=np.float64)

    if any(p.top_k is not None for p in params):
        ks = per_row([config.top_k if p.top_k is None else p.top_k for p in params]).astype(np.int64)
        theta, t = keep_top(theta, ks), keep_top(t, ks)
    return mix_and_sample(
        theta,
        t,
        temperature=per_row([p.temperature for p in params]),
        fixed_alpha=per_row([np.nan if p.fixed_alpha is None else p.fixed_alpha for p in params]),
        uniforms=np.fromiter(map(SequenceState.uniform, sequences), np.float64, n),
        fill=config.fill_rule,
        vocab_size=vocab_size,
        alpha_tol=config.alpha_tol,
        alpha_max_iter=config.alpha_max_iter,
        with_diagnostics=any(p.return_diagnostics for p in params),
        max_alpha=(
            per_row([1.0 if p.max_alpha is None else p.max_alpha for p in params])
            if any(p.max_alpha is not None for p in params)
            else None
        ),
        threads=config.step_threads,
    )


def record_rows(
    sequences: list[SequenceState],
    step: StepResult,
    eos_ids: frozenset[int],
    max_len: int,
    theta: TopKBatch,
    t: TopKBatch,
) -> None:
    """Append each sequence's sampled token and its per-token values (and apply the stop rules),
    with q*'s top candidates and both models' top-k (`theta`, `t`: the step's rows, in
    sequence order) for the sequences that ask for them."""
    # Python lists: indexing them per row is far cheaper than indexing numpy arrays.
    tokens = step.token_ids.tolist()
    alphas, lq = step.alpha.tolist(), step.logprob_q.tolist()
    lth, lt = step.logprob_theta.tolist(), step.logprob_t.tolist()
    if step.diagnostics:
        diagnostics = {key: values.tolist() for key, values in step.diagnostics.items()}
        for row, seq in enumerate(sequences):
            seq.append(
                tokens[row],
                alphas[row],
                lq[row],
                lth[row],
                lt[row],
                {key: values[row] for key, values in diagnostics.items()},
                eos_ids,
                max_len,
            )
    else:  # the usual step: one zip, no dict per row (the rules as array operations over the step
        # measured slower at batch 64-256: numpy's cost per call outweighed theirs per row)
        for seq, token, alpha, q, theta_lp, t_lp in zip(sequences, tokens, alphas, lq, lth, lt):
            seq.append(token, alpha, q, theta_lp, t_lp, NO_DIAGNOSTICS, eos_ids, max_len)
    first = sequences[0].params
    if not (first.top_logprobs or first.record_topk) and _one_object([seq.params for seq in sequences]):
        wanting, recording = [], []  # one call's sequences, recording nothing more: the usual step
    else:
        wanting = [row for row, seq in enumerate(sequences) if seq.params.top_logprobs]
        recording = [row for row, seq in enumerate(sequences) if seq.params.record_topk]
    if wanting:
        n = max(sequences[row].params.top_logprobs for row in wanting)
        tops = top_candidates(step.candidates[wanting], step.candidate_logq[wanting], n)
        for row, top in zip(wanting, tops):
            keep = sequences[row].params.top_logprobs
            sequences[row].top_logprobs.append(dict(list(top.items())[:keep]))
    if recording:
        k = max(sequences[row].params.record_topk for row in recording)
        ids, logprobs = best_first(theta, t, np.array(recording), k)  # [R, 2, k] each
        for i, row in enumerate(recording):
            keep = sequences[row].params.record_topk
            sequences[row].topk_ids.append(ids[i, :, :keep])
            sequences[row].topk_logprobs.append(logprobs[i, :, :keep])
    if any(map(_LISTENER, sequences)):  # streamed calls (the service's server-sent events)
        for seq in sequences:
            if seq.listener is not None:
                seq.publish()


_LISTENER = operator.attrgetter("listener")
NO_DIAGNOSTICS: Mapping[str, float] = MappingProxyType({})


def _one_object(values: Sequence[object]) -> bool:
    """Whether `values` hold one object (by identity, not equality: no __eq__ per row), in C loops
    where all() over a generator runs a Python frame per row."""
    return len(set(map(id, values))) == 1


def best_first(theta: TopKBatch, t: TopKBatch, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Both models' `k` most likely entries of `rows`, best first: int64 ids and float64 raw
    logprobs, [R, 2, k] each (model 0 the base, 1 the teacher); PAD and -inf beyond a row's entries."""
    ids = np.full((len(rows), 2, k), PAD_TOKEN_ID, dtype=np.int64)
    logprobs = np.full((len(rows), 2, k), -np.inf)
    for model, batch in enumerate((theta, t)):
        width = min(k, batch.logprobs.shape[1])
        order = np.argsort(-batch.logprobs[rows], axis=1, kind="stable")[:, :width]  # [R, width]
        ids[:, model, :width] = np.take_along_axis(batch.token_ids[rows], order, axis=1)
        logprobs[:, model, :width] = np.take_along_axis(batch.logprobs[rows], order, axis=1)
    return ids, logprobs


async def _timed(call: Awaitable[T]) -> tuple[T | BaseException, float]:
    """(result or the exception it raised, wall seconds): one server call of a step."""
    started = time.perf_counter()
    try:
        result: T | BaseException = await call
    except Exception as exc:  # noqa: BLE001 - handed to the step, which decides what fails
        result = exc
    return result, time.perf_counter() - started
