"""Running a checked job (dualvllm.service.building): admitted to the coordinator's batch, its
sequences sampled (streamed or whole), its prompts scored for echo and prompt_logprobs, and the
response written in the job's format.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any, TypeVar
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence

from aiohttp import web

from dualvllm.common.errors import GenerationFailedError
from dualvllm.coordinator.core import DualVLLMCoordinator
from dualvllm.coordinator.outputs import GenerationOutput
from dualvllm.coordinator.sequence import TokenListener
from dualvllm.engines.protocol import Engine, PromptScoringEngine
from dualvllm.service import responses
from dualvllm.service.batching import BatchedScoring
from dualvllm.service.building import ALPHA_SUFFIX
from dualvllm.service.config import ServiceConfig
from dualvllm.service.errors import RequestError
from dualvllm.service.formats import TokenLogprobs
from dualvllm.service.jobs import Job, RequestQueue
from dualvllm.service.metrics import ServiceMetrics
from dualvllm.service.scoring import PromptScores, ScoringSettings, score_prompts, scoring_engine, vllm_prompt_logprobs
from dualvllm.service.streaming import stream_choices
from dualvllm.service.tokens import TokenTexts

# Writes a whole response: (job, outputs in choice order, vLLM's prompt logprobs per prompt or None).
Answer = Callable[
    [Job, Sequence[GenerationOutput], Sequence[list[dict[str, Any] | None]] | None], Awaitable[dict[str, Any]]
]
A = TypeVar("A")
B = TypeVar("B")


class JobRunner:
    """Runs the jobs of one service (`model`: its served name); what a stream asks of the service
    (dualvllm.service.streaming.Generation)."""

    def __init__(
        self,
        coordinator: DualVLLMCoordinator,
        config: ServiceConfig,
        model: str,
        admission: RequestQueue,
        metrics: ServiceMetrics,
    ) -> None:
        self.coordinator, self.config, self.model = coordinator, config, model
        self.admission, self.metrics = admission, metrics
        self.texts = TokenTexts(coordinator)
        self._scorers: tuple[BatchedScoring | PromptScoringEngine, BatchedScoring | PromptScoringEngine] | None = None

    async def run(self, request: web.Request, job: Job, answer: Answer | None = None) -> web.StreamResponse:
        """Admit and run the job; `answer` writes a whole (non-echo) response from the outputs
        and vLLM's prompt logprobs (default: the job's OpenAI format)."""
        answer = answer or self.response
        self.coordinator.check(job.params)  # what the coordinator would refuse, refused before a stream's first byte
        # A scoring-only request (echo, max_tokens 0) never enters the coordinator's batch: it takes no place there.
        sequences = job.sequences if job.max_tokens else 0
        with self.admission.hold(
            sequences, sequences * job.max_tokens, lambda: self.coordinator.get_statistics()["tokens_per_s"]
        ):
            if job.request.stream:
                return await stream_choices(request, self, job)
            if not job.echo and job.prompt_logprobs is None:
                async with self.generate(job) as outputs:
                    ordered = await _collect(outputs, job.sequences)
                return web.json_response(await answer(job, ordered, None), dumps=dumps)
            if not job.echo:  # vLLM's prompt_logprobs, scored while the completion is generated
                ordered, rows = await _both(self._generated(job), self.prompt_logprobs(job))
                return web.json_response(await answer(job, ordered, rows), dumps=dumps)
            # The prompt is scored while the completion is generated: both wait on the servers.
            ordered, scores = await _both(self._generated(job), self._scored(job))
            return web.json_response(await self.echo_response(job, ordered, scores), dumps=dumps)

    async def _generated(self, job: Job) -> list[GenerationOutput]:
        if not job.max_tokens:
            return []
        async with self.generate(job) as outputs:
            return await _collect(outputs, job.sequences)

    async def _scored(self, job: Job) -> list[PromptScores] | None:
        return await self.score(job) if job.want_logprobs else None

    @contextlib.asynccontextmanager
    async def generate(
        self, job: Job, on_tokens: TokenListener | None = None
    ) -> AsyncIterator[AsyncIterator[GenerationOutput]]:
        """The coordinator's stream of the job's sequences (choice index = prompt x n + j);
        closing it (a disconnect cancels the handler) cancels the sequences still running."""
        body = job.request
        prompts = [pair for pair in job.prompts for _ in range(body.n)]
        stream = self.coordinator.stream(prompts, job.params, seed=body.seed, on_tokens=on_tokens)
        self.metrics.sequences_started(len(prompts))
        delivered = 0

        async def counted() -> AsyncIterator[GenerationOutput]:
            nonlocal delivered
            async for output in stream:
                delivered += 1
                self.metrics.sequence_done(output)
                yield output

        try:
            async with contextlib.aclosing(stream):
                yield counted()
        finally:
            self.metrics.cancelled(len(prompts) - delivered)

    async def response(
        self,
        job: Job,
        outputs: Sequence[GenerationOutput],
        prompt_logprobs: Sequence[list[dict[str, Any] | None]] | None = None,
    ) -> dict[str, Any]:
        """The whole (non-streamed) response of a job whose outputs are all in; with vLLM's
        `prompt_logprobs` (one list per prompt) in each choice."""
        texts = await self.logprob_texts(job, outputs)
        form = job.format
        choices = [
            form.choice(
                o.index, o, job.options, form.logprobs(TokenLogprobs.of(o), texts, 0) if job.want_logprobs else None
            )
            for o in outputs
        ]
        if prompt_logprobs is not None:
            for choice, output in zip(choices, outputs):
                choice["prompt_logprobs"] = prompt_logprobs[output.index // job.request.n]
        body = responses.envelope(
            form.whole,
            form.request_id(),
            int(time.time()),
            self.model,
            choices,
            responses.usage(job.prompt_tokens, outputs),
        )
        if job.request.return_token_ids:  # vLLM's field, as TRL's client reads it
            form.add_token_ids(
                body, [job.prompts[o.index // job.request.n][0] for o in outputs], [o.generated_tokens for o in outputs]
            )
        return body

    async def echo_response(
        self, job: Job, outputs: Sequence[GenerationOutput], scores: list[PromptScores] | None
    ) -> dict[str, Any]:
        """A completion whose choices start with their prompt (echo): its text and, with `scores`,
        each prompt token's log q* before the generated tokens' (`outputs`: none for max_tokens 0)."""
        body = job.request
        texts = await self.logprob_texts(job, outputs, scores)
        prompt_texts = [p if isinstance(p, str) else await self.coordinator.detokenize(p) for p in body.prompts()]  # type: ignore[union-attr]
        choices = []
        for index in range(job.sequences):
            prompt = index // body.n  # choice index = prompt x n + j, as the coordinator numbers outputs
            scored = None if scores is None else scores[prompt]
            choices.append(
                responses.echo_choice(
                    index, prompt_texts[prompt], scored, outputs[index] if outputs else None, job.options, texts
                )
            )
        return responses.envelope(
            job.format.whole,
            job.format.request_id(),
            int(time.time()),
            self.model,
            choices,
            responses.usage(job.prompt_tokens, outputs),
        )

    async def prompt_logprobs(self, job: Job) -> list[list[dict[str, Any] | None]]:
        """vLLM's `prompt_logprobs` of each prompt, by the model asked for: the base alone
        (alpha 0) or the teacher alone (alpha 1) answer with their server's own prompt logprobs
        (exact ranks over the whole vocabulary); q* (any other alpha, or alpha*) with log q*
        over the merged candidates (dualvllm.service.scoring), ranks among them."""
        k, alpha = job.prompt_logprobs, job.options.fixed_alpha
        assert k is not None
        if alpha in (0.0, 1.0):
            side = 0 if alpha == 0.0 else 1
            scorer = self.scorers("prompt_logprobs")[side]
            return await scorer.prompt_logprobs([prompt[side] for prompt in job.prompts], k)
        if k == -1:
            raise RequestError(
                "prompt_logprobs=-1 (the whole vocabulary) is for one model alone: q* is defined "
                f"over each model's top-k candidates; ask for at most that many, or use "
                f"{self.model}{ALPHA_SUFFIX}0 (the base) or {ALPHA_SUFFIX}1 (the teacher)",
                param="prompt_logprobs",
            )
        scores = await self.score(job, top_n=k)
        texts = await self.token_texts(_scored_ids(scores), as_ids=bool(job.request.return_tokens_as_token_ids))
        return [vllm_prompt_logprobs(s, texts) for s in scores]

    async def score(self, job: Job, top_n: int | None = None) -> list[PromptScores]:
        """Every prompt token's log q* (dualvllm.service.scoring), once per prompt whatever n is; `top_n`
        of q*'s candidates per position (default: the request's top logprobs)."""
        config, options = self.coordinator.config, job.options
        prompts = []
        for i, (theta_ids, t_ids) in enumerate(job.prompts):
            if theta_ids != t_ids:  # the start-up check makes this rare: the tokenizers are the same
                raise RequestError(
                    f"the base and the teacher tokenize prompt {i} differently; echo scores one "
                    "token sequence under both, so give the prompt as token ids",
                    param="prompt",
                )
            prompts.append(theta_ids)
        settings = ScoringSettings(
            top_k=options.top_k or config.top_k,
            fill=config.fill_rule,
            vocab_size=self.coordinator.session.vocab_size,
            alpha_tol=config.alpha_tol,
            alpha_max_iter=config.alpha_max_iter,
            fixed_alpha=options.fixed_alpha,
            top_n=job.top_logprobs if top_n is None else top_n,
        )
        return await score_prompts(
            *self.scorers("prompt_logprobs" if job.prompt_logprobs is not None else "echo"), prompts, settings
        )

    def scorers(self, param: str) -> tuple[BatchedScoring | PromptScoringEngine, BatchedScoring | PromptScoringEngine]:
        """The base's and the teacher's prompt scoring, concurrent requests merged into one call
        per server (dualvllm.service.batching; the engines themselves with scoring_call_tokens 0); a 400
        naming `param` if an engine cannot score prompts."""
        if self._scorers is None:
            theta, t = (scoring_engine(e, param) for e in _engines(self.coordinator))
            tokens = self.config.scoring_call_tokens
            self._scorers = (BatchedScoring(theta, tokens), BatchedScoring(t, tokens)) if tokens else (theta, t)
        return self._scorers

    async def logprob_texts(
        self, job: Job, outputs: Sequence[GenerationOutput], scores: Sequence[PromptScores] | None = None
    ) -> dict[int, str]:
        if not job.want_logprobs:
            return {}
        ids = {i for o in outputs for i in TokenLogprobs.of(o).token_ids()} | _scored_ids(scores or [])
        return await self.token_texts(ids, as_ids=bool(job.request.return_tokens_as_token_ids))

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.coordinator.eos_token_ids

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        return await self.coordinator.detokenize(token_ids)

    async def token_texts(self, token_ids: Iterable[int], *, as_ids: bool = False) -> dict[int, str]:
        """How logprobs name these tokens: their texts, or with `as_ids` (vLLM's
        return_tokens_as_token_ids) "token_id:<id>", which stays exact where texts collide."""
        if as_ids:
            return {i: f"token_id:{i}" for i in token_ids}
        return await self.texts.get(token_ids)


def _scored_ids(scores: Sequence[PromptScores]) -> set[int]:
    """Every token id scored prompts show: their own and their positions' top candidates."""
    return {i for s in scores for i in s.token_ids} | {i for s in scores for row in s.top if row for i in row}


def _engines(coordinator: DualVLLMCoordinator) -> tuple[Engine, Engine]:
    """The base's and the teacher's engines, for prompt scoring."""
    return coordinator.base_engine, coordinator.session.t


async def _collect(outputs: AsyncIterator[GenerationOutput], count: int) -> list[GenerationOutput]:
    """Every output in choice order; a failed sequence fails the request (502) with its error."""
    ordered: list[GenerationOutput | None] = [None] * count
    async for output in outputs:
        if output.error is not None:
            raise GenerationFailedError(f"choice {output.index}: {output.error}")
        ordered[output.index] = output
    return ordered  # type: ignore[return-value]


async def _awaited(awaitable: Awaitable[A]) -> A:
    return await awaitable


async def _both(first: Awaitable[A], second: Awaitable[B]) -> tuple[A, B]:
    """Both results, computed at once; the first failure cancels the other and is raised as
    itself (not as the ExceptionGroup a TaskGroup raises), so the error middleware maps it."""
    one: asyncio.Task[A]
    two: asyncio.Task[B]
    try:
        async with asyncio.TaskGroup() as group:
            one, two = group.create_task(_awaited(first)), group.create_task(_awaited(second))
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None
    return one.result(), two.result()


def dumps(body: Any) -> str:
    """Compact JSON, as responses are sent."""
    return json.dumps(body, separators=(",", ":"))
