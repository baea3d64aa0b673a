"""Concurrent prompt-scoring requests merged into one server call (issue 44: scoring at server speed).

An lm-eval run or a TRL trainer scores many prompts at once, each request on its own: one
prompt-logprobs call per request per server kept the service at ~11 requests/s while the
servers were mostly waiting on HTTP round trips. A `Batcher` sends the first request's
prompts at once and, while that call is in flight, gathers every request that arrives; when
the call answers, all those gathered go out as the next call (natural batching: no timer,
no added latency when idle). A call carries at most `max_tokens` prompt tokens.

A call the server refuses (HTTP 4xx: one bad prompt, e.g. too long for the model) is split
and each request sent alone, so only the bad request fails; any other failure fails the
requests the call carried, and no other.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Generic, TypeVar
from collections.abc import Awaitable, Callable, Sequence

from dualvllm.common.errors import LifecycleError, ServerRejectedError
from dualvllm.engines.protocol import PromptScoringEngine, TopKBatch

R = TypeVar("R")
Prompts = Sequence[Sequence[int]]

# Prompt tokens per merged call: large enough to amortize a call's fixed cost, small enough
# that one call does not hold a server for long (vLLM scores prompt tokens at prefill speed).
MAX_CALL_TOKENS = 16_384


@dataclass
class _Waiting(Generic[R]):
    prompts: Prompts
    answer: asyncio.Future[list[R]] = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    def __post_init__(self) -> None:
        # a caller that left (a disconnect) never reads its answer: mark a failure as seen
        self.answer.add_done_callback(lambda f: f.cancelled() or f.exception())

    @property
    def tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


class Batcher(Generic[R]):
    """Merges concurrent `score(prompts, key)` calls with the same key (the top-k or the number of
    logprobs asked for) into calls of `send(prompts, key) -> one answer per prompt`."""

    def __init__(self, send: Callable[[Prompts, int], Awaitable[list[R]]], max_tokens: int = MAX_CALL_TOKENS) -> None:
        self._send = send
        self._max_tokens = max_tokens
        self._queues: dict[int, list[_Waiting[R]]] = {}
        self._senders: dict[int, asyncio.Task[None]] = {}
        self.calls = 0  # server calls made (for tests and metrics)

    async def score(self, prompts: Prompts, key: int) -> list[R]:
        waiting: _Waiting[R] = _Waiting(prompts)
        self._queues.setdefault(key, []).append(waiting)
        if key not in self._senders:
            self._senders[key] = asyncio.create_task(self._drain(key))
        # shield: a caller that leaves (its client disconnected) must not cancel a call others share
        return await asyncio.shield(waiting.answer)

    async def _drain(self, key: int) -> None:
        """Send what is queued under `key`, call after call, until the queue is empty."""
        try:
            while self._queues.get(key):
                batch = self._take(key)
                await self._call(batch, key)
        finally:  # normally the queue is empty here; after a cancel (shutdown) nobody would send the rest
            del self._senders[key]
            for waiting in self._queues.pop(key, []):
                _fail(waiting, LifecycleError("the service stopped before this prompt was scored"))

    def _take(self, key: int) -> list[_Waiting[R]]:
        queue = self._queues[key]
        batch: list[_Waiting[R]] = []
        tokens = 0
        while queue and (not batch or tokens + queue[0].tokens <= self._max_tokens):
            tokens += queue[0].tokens
            batch.append(queue.pop(0))
        return batch

    async def _call(self, batch: list[_Waiting[R]], key: int) -> None:
        prompts = [p for w in batch for p in w.prompts]
        self.calls += 1
        try:
            answers = await self._send(prompts, key)
        except ServerRejectedError as err:
            if len(batch) == 1:
                _fail(batch[0], err)
            else:  # one request's prompt may be the bad one: each alone, so only it fails
                for waiting in batch:
                    await self._call([waiting], key)
            return
        except Exception as err:  # noqa: BLE001 - handed to exactly the requests this call carried
            for waiting in batch:
                _fail(waiting, err)
            return
        start = 0
        for waiting in batch:
            end = start + len(waiting.prompts)
            if not waiting.answer.done():
                waiting.answer.set_result(answers[start:end])
            start = end


def _fail(waiting: _Waiting, err: BaseException) -> None:
    if not waiting.answer.done():
        waiting.answer.set_exception(err)


class BatchedScoring:
    """An engine's two prompt-scoring calls (dualvllm.engines.protocol.PromptScoringEngine), each through
    a Batcher: what the service scores prompts with."""

    def __init__(self, engine: PromptScoringEngine, max_tokens: int = MAX_CALL_TOKENS) -> None:
        self.name = engine.name
        self._topk: Batcher[TopKBatch] = Batcher(lambda prompts, k: engine.prompt_topk(prompts, k), max_tokens)
        self._logprobs: Batcher[list] = Batcher(lambda prompts, k: engine.prompt_logprobs(prompts, k), max_tokens)

    async def prompt_topk(self, prompts: Prompts, k: int) -> list[TopKBatch]:
        return await self._topk.score(prompts, k)

    async def prompt_logprobs(self, prompts: Prompts, k: int) -> list[list]:
        return await self._logprobs.score(prompts, k)

    @property
    def calls(self) -> int:
        """Server calls made for every request scored so far."""
        return self._topk.calls + self._logprobs.calls
