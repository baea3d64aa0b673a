"""The q* endpoint: OpenAI's completions and chat API over one DualVLLMCoordinator (aiohttp).

    POST /v1/completions        prompt(s) -> q* completions (stream: server-sent events)
    POST /v1/chat/completions   messages rendered with the base's chat template -> q* replies
    GET  /v1/models             the pair, under the name requests give as `model`
    POST /inference/v1/generate vLLM's tokens in, tokens out (dualvllm.service.generate)
    POST /v1/chat/completions/render  a chat request as the /inference/v1/generate request it becomes
    GET  /health                200 while the coordinator is open (no key needed)
    GET  /metrics               Prometheus text (dualvllm.service.metrics)

Every request's sequences join the coordinator's one continuous batch, so concurrent
clients share its steps. A completion with `echo` and `logprobs` also scores its prompt
under q* (dualvllm.service.scoring), with one prompt-logprobs request per server. A request passes,
in order: the key (401), JSON and the schema (400), the model name (404; "<name>@alpha=A"
fixes alpha), what q* cannot do (400), prompt and context checks (400), the per-request
token ceiling (400), and the queue (429 with Retry-After). A client that disconnects
cancels its sequences (the handler is cancelled; its streams close).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hmac
import json
import logging
import math
import socket
import time
from pathlib import PurePath
from typing import Any, TypeVar
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence

from aiohttp import web
from pydantic import BaseModel, ValidationError

from dualvllm.common.errors import (
    GenerationFailedError,
    InvalidInputError,
    LifecycleError,
    ServiceBusyError,
    UnknownModelError,
)
from dualvllm.coordinator.core import DualVLLMCoordinator
from dualvllm.coordinator.outputs import GenerationOutput
from dualvllm.coordinator.sequence import TokenListener
from dualvllm.engines.protocol import Engine, PromptScoringEngine
from dualvllm.service import responses
from dualvllm.service.config import ServiceConfig
from dualvllm.service.dev_routes import DevRoutes
from dualvllm.service.errors import RequestError, error_body, error_of
from dualvllm.service.formats import CHAT, COMPLETION, Format, TokenLogprobs
from dualvllm.service.jobs import RequestQueue, Job
from dualvllm.service.metrics import ServiceMetrics
from dualvllm.service.worker_metrics import WorkerPlace, every_worker, serve_own
from dualvllm.service.generate import generate_response, render_response
from dualvllm.service.schema import ChatCompletionRequest, CompletionRequest, GenerateRequest
from dualvllm.service.batching import BatchedScoring
from dualvllm.service.scoring import PromptScores, ScoringSettings, score_prompts, scoring_engine, vllm_prompt_logprobs
from dualvllm.service.streaming import stream_choices
from dualvllm.service.tokens import TokenTexts

log = logging.getLogger("dualvllm.service")
# "<served name>@alpha=0.25" names the pair with dualvllm.fixed_alpha 0.25: how clients that
# send no extra body fields (lm-eval's loglikelihood requests) choose the base or the teacher.
ALPHA_SUFFIX = "@alpha="
# Route prefixes whose model list names one model alone first (see QStarService.app).
ROLE_ALPHAS = {"teacher": 1.0, "base": 0.0}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# Writes a whole response: (job, outputs in choice order, vLLM's prompt logprobs per prompt or None).
Answer = Callable[
    [Job, Sequence[GenerationOutput], Sequence[list[dict[str, Any] | None]] | None], Awaitable[dict[str, Any]]
]
S = TypeVar("S", bound=BaseModel)
A = TypeVar("A")
B = TypeVar("B")


class QStarService:
    def __init__(self, coordinator: DualVLLMCoordinator, config: ServiceConfig) -> None:
        self.coordinator = coordinator
        self.config = config
        theta, t = coordinator.session.model_names
        self.model = config.served_model_name or f"{_short(theta)}+{_short(t)}"
        self.admission = RequestQueue(coordinator.capacity, config.max_queued_sequences)
        self.metrics = ServiceMetrics(coordinator, self.admission)
        self.texts = TokenTexts(coordinator)
        self.created = int(time.time())
        self._scorers: tuple[BatchedScoring | PromptScoringEngine, BatchedScoring | PromptScoringEngine] | None = None
        self.place: WorkerPlace | None = None  # one of several workers: /metrics holds every worker's

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[self._errors, self._auth])
        # "/teacher/..." and "/base/...": the same routes, whose model list names that model alone
        # first, for clients that take the first model of a base URL (TRL's VLLMClient: a
        # distillation trainer's teacher_model_server_url=http://HOST:PORT/teacher).
        for prefix in ("", *(f"/{role}" for role in ROLE_ALPHAS)):
            app.router.add_post(prefix + "/v1/completions", self.completions)
            app.router.add_post(prefix + "/v1/chat/completions", self.chat_completions)
            app.router.add_get(prefix + "/v1/models", self.models)
            app.router.add_get(prefix + "/health", self.health)
            app.router.add_post(prefix + "/inference/v1/generate", self.generate_tokens)
            app.router.add_post(prefix + "/v1/chat/completions/render", self.render_chat)
        app.router.add_get("/metrics", self.prometheus)
        if self.config.dev_mode:
            DevRoutes(self.coordinator).add_to(app)
        return app

    # -- middlewares --------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every failure becomes an OpenAI error object; nothing leaks a traceback."""
        started = time.perf_counter()
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except asyncio.CancelledError:  # the client left (nginx's 499: client closed request)
            status = 499
            raise
        except web.HTTPException as exc:  # aiohttp's own: 404 route, 405, 413 body too large
            status = exc.status
            kind = "invalid_request_error" if exc.status < 500 else "server_error"
            return _error(exc.status, f"{exc.reason}: {request.method} {request.path}", kind)
        except Exception as exc:  # noqa: BLE001 - the boundary where errors become HTTP answers
            response = self._answer(exc)
            status = response.status
            return response
        finally:
            # labelled by the route it matched (the app's own table: a bounded set), not the raw path
            resource = request.match_info.route.resource
            self.metrics.request_done(
                resource.canonical if resource is not None else "other", status, time.perf_counter() - started
            )

    def _answer(self, exc: Exception) -> web.Response:
        status, body = error_of(exc)
        response = web.json_response(body, status=status)
        if isinstance(exc, ServiceBusyError):
            response.headers["Retry-After"] = str(exc.retry_after_s)
        return response

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        key = self.config.api_key
        if key is None or request.path == "/health":
            return await handler(request)
        given = request.headers.get("Authorization", "")
        expected = f"Bearer {key.get_secret_value()}"
        if not hmac.compare_digest(given.encode(), expected.encode()):  # constant time
            return _error(
                401,
                "missing or wrong API key: send 'Authorization: Bearer KEY'",
                "authentication_error",
                "invalid_api_key",
            )
        return await handler(request)

    # -- routes -------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        if not self.coordinator.is_open:
            raise LifecycleError("the coordinator was closed")
        return web.json_response({"status": "ok", "mode": self.coordinator.mode})

    async def models(self, request: web.Request) -> web.Response:
        theta, t = self.coordinator.session.model_names
        card: dict[str, Any] = {
            "id": self.model,
            "object": "model",
            "created": self.created,
            "owned_by": "dualvllm",
            "max_model_len": self.coordinator.session.max_model_len,
            "dualvllm": {
                "base": theta,
                "teacher": t,
                "mode": self.coordinator.mode,
                "top_k": self.coordinator.config.top_k,
            },
        }
        # The base alone and the teacher alone; any alpha in [0, 1] works, these two are listed.
        aliases = {
            alpha: {
                **card,
                "id": f"{self.model}{ALPHA_SUFFIX}{alpha:g}",
                "dualvllm": {**card["dualvllm"], "fixed_alpha": alpha},
            }
            for alpha in (0.0, 1.0)
        }
        role = request.path.split("/")[1]
        if role in ROLE_ALPHAS:  # under /teacher or /base: that model first
            first = aliases.pop(ROLE_ALPHAS[role])
            return web.json_response({"object": "list", "data": [first, card, *aliases.values()]})
        return web.json_response({"object": "list", "data": [card, *aliases.values()]})

    async def prometheus(self, request: web.Request) -> web.Response:
        if self.place is None:
            body, content_type = self.metrics.render()
        else:
            body, content_type = await every_worker(self.place, self.metrics.render)
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = self._with_model(await _parse(request, CompletionRequest))
        return await self._run(request, await self._completion_job(body))

    async def generate_tokens(self, request: web.Request) -> web.StreamResponse:
        """vLLM's POST /inference/v1/generate: token ids in, token ids out (dualvllm.service.generate),
        checked and run as the same request to /v1/completions would be."""
        raw = await _parse(request, GenerateRequest)
        _refuse(raw.unsupported())
        body = self._with_model(_validated(CompletionRequest, raw.as_completion(self._default_model(request))))
        job = await self._completion_job(body)

        async def answer(
            job: Job, outputs: Sequence[GenerationOutput], rows: Sequence[list[dict[str, Any] | None]] | None
        ) -> dict[str, Any]:
            texts = await self.logprob_texts(job, outputs) if raw.output_mode == "text" else {}
            return generate_response(raw, job, outputs, body.model, None if rows is None else rows[0], texts)

        return await self._run(request, job, answer)

    async def _completion_job(self, body: CompletionRequest) -> Job:
        _refuse(body.unsupported())
        if body.max_tokens == 0 and not body.echo:
            raise RequestError(
                "max_tokens=0 generates nothing; it goes with echo=true (score the prompt), else "
                "ask for at least 1 token",
                param="max_tokens",
            )
        prompts = body.prompts()
        if not prompts:
            raise RequestError("prompt is empty; give a string, token ids, or a list of them", param="prompt")
        if body.dualvllm.t_prompt is not None and len(prompts) > 1:
            raise RequestError(
                "dualvllm.t_prompt goes with one prompt; send one request per prompt", param="dualvllm.t_prompt"
            )
        t_prompt = body.dualvllm.t_prompt
        self._check_ids(prompts, "prompt")
        if t_prompt is not None:
            self._check_ids([t_prompt], "dualvllm.t_prompt")
        encoded = await self.coordinator.encode([p if t_prompt is None else (p, t_prompt) for p in prompts])
        logprobs = body.logprobs
        max_tokens = self.config.default_max_tokens if body.max_tokens is None else body.max_tokens
        return self._job(
            COMPLETION,
            body,
            encoded,
            max_tokens,
            top_logprobs=logprobs or 0,
            want_logprobs=logprobs is not None,
            echo=body.echo,
            prompt_logprobs=body.prompt_logprobs,
        )

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = self._with_model(await _parse(request, ChatCompletionRequest))
        theta_ids, t_ids, budget = await self._rendered(body)
        job = self._job(
            CHAT, body, [(theta_ids, t_ids)], budget, top_logprobs=body.top_logprobs or 0, want_logprobs=body.logprobs
        )
        return await self._run(request, job)

    async def render_chat(self, request: web.Request) -> web.Response:
        """vLLM's POST /v1/chat/completions/render: the chat request as the generate request
        (/inference/v1/generate) that samples the same reply (dualvllm.service.generate)."""
        body = self._with_model(await _parse(request, ChatCompletionRequest))
        theta_ids, t_ids, budget = await self._rendered(body)
        self._job(
            CHAT, body, [(theta_ids, t_ids)], budget, top_logprobs=body.top_logprobs or 0, want_logprobs=body.logprobs
        )  # the checks the chat request itself would pass
        return web.json_response(render_response(body, body.model, theta_ids, t_ids, budget), dumps=_dumps)

    async def _rendered(self, body: ChatCompletionRequest) -> tuple[list[int], list[int], int]:
        """The base's and the teacher's prompt ids of a chat request (each model's own template),
        and its token budget."""
        _refuse(body.unsupported())
        extra = body.chat_template_kwargs
        theta_ids = await self.coordinator.render_chat([m.rendered() for m in body.messages], "theta", extra)
        t_messages = body.dualvllm.t_messages
        t_ids = (
            theta_ids
            if t_messages is None
            else await self.coordinator.render_chat([m.rendered() for m in t_messages], "t", extra)
        )
        budget = body.token_budget()
        if budget is None:  # OpenAI's chat default: the rest of the context, within the ceiling
            room = self.coordinator.session.max_model_len - max(len(theta_ids), len(t_ids))
            budget = max(1, min(room, self.config.max_request_tokens // body.n))
        return theta_ids, t_ids, budget

    # -- generation ---------------------------------------------------------------------

    def _with_model(self, body: Any) -> Any:
        """The request, checked against the served name; "<name>@alpha=A" sets dualvllm.fixed_alpha A."""
        model = body.model
        if model == self.model:
            return body
        if not model.startswith(self.model + ALPHA_SUFFIX):
            raise UnknownModelError(
                f"the model {model!r} does not exist here; this service serves {self.model!r} "
                f"and {self.model}{ALPHA_SUFFIX}A for a fixed alpha A in [0, 1] (GET /v1/models)"
            )
        given = model[len(self.model + ALPHA_SUFFIX) :]
        try:
            alpha = float(given)
        except ValueError:
            alpha = math.nan
        if not 0.0 <= alpha <= 1.0:  # NaN fails too
            raise RequestError(
                f"the model {model!r} asks for alpha {given!r}; give a number in [0, 1], e.g. "
                f"{self.model}{ALPHA_SUFFIX}0 for the base alone",
                param="model",
            )
        fixed = body.dualvllm.fixed_alpha
        if fixed is not None and fixed != alpha:
            raise RequestError(
                f"the model {model!r} fixes alpha at {alpha:g} and dualvllm.fixed_alpha is {fixed:g}; give one of them",
                param="dualvllm.fixed_alpha",
            )
        return body.model_copy(update={"dualvllm": body.dualvllm.model_copy(update={"fixed_alpha": alpha})})

    def _default_model(self, request: web.Request) -> str:
        """The model a request that names none asks for: the first its route lists (GET /v1/models)."""
        role = request.path.split("/")[1]
        return f"{self.model}{ALPHA_SUFFIX}{ROLE_ALPHAS[role]:g}" if role in ROLE_ALPHAS else self.model

    def _check_ids(self, prompts: list[str | list[int]], param: str) -> None:
        """Token ids outside the vocabulary refused here, not by a model server (which would be a 502)."""
        vocab = self.coordinator.session.vocab_size
        if vocab is None:
            return
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):  # text: the tokenizer makes only ids it has
                continue
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise RequestError(
                    f"{param} {i} has token id {bad[0]}, outside the vocabulary of {vocab} tokens "
                    f"(ids 0 to {vocab - 1})",
                    code="invalid_token_id",
                    param=param,
                )

    def _job(
        self,
        form: Format,
        body: CompletionRequest | ChatCompletionRequest,
        prompts: list[tuple[list[int], list[int]]],
        max_tokens: int,
        *,
        top_logprobs: int,
        want_logprobs: bool,
        echo: bool = False,
        prompt_logprobs: int | None = None,
    ) -> Job:
        limit = self.coordinator.session.max_model_len
        for i, (theta_ids, t_ids) in enumerate(prompts):
            if not theta_ids or not t_ids:
                raise RequestError(f"prompt {i} is empty after tokenization; give at least one token", param="prompt")
            longest = max(len(theta_ids), len(t_ids))
            if longest + max_tokens > limit:
                raise RequestError(
                    f"this model's maximum context length is {limit} tokens; prompt {i} has {longest} tokens and "
                    f"max_tokens is {max_tokens} ({longest + max_tokens} in all). Shorten the prompt or lower "
                    "max_tokens",
                    code="context_length_exceeded",
                    param="max_tokens",
                )
        job = Job(form, body, prompts, max_tokens, top_logprobs, want_logprobs, echo, prompt_logprobs)
        ceiling, generated = self.config.max_request_tokens, job.sequences * max_tokens
        if generated > ceiling:
            raise RequestError(
                f"this request asks for up to {generated} tokens ({len(prompts)} prompts x n="
                f"{body.n} x max_tokens={max_tokens}); the service allows {ceiling} per "
                "request. Split it, or lower n or max_tokens",
                code="request_too_large",
                param="n",
            )
        # Scoring costs each server a top-k row per prompt token, as generating costs a step.
        scored = job.prompt_tokens if (echo and want_logprobs) or prompt_logprobs is not None else 0
        if generated + scored > ceiling:
            raise RequestError(
                f"this request scores {scored} prompt tokens (echo with logprobs, or prompt_logprobs) and generates "
                f"up to {generated}; the service allows {ceiling} tokens per request. Send fewer prompts per request",
                code="request_too_large",
                param="prompt",
            )
        return job

    async def _run(self, request: web.Request, job: Job, answer: Answer | None = None) -> web.StreamResponse:
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
                return web.json_response(await answer(job, ordered, None), dumps=_dumps)
            if not job.echo:  # vLLM's prompt_logprobs, scored while the completion is generated
                ordered, rows = await _both(self._generated(job), self.prompt_logprobs(job))
                return web.json_response(await answer(job, ordered, rows), dumps=_dumps)
            # The prompt is scored while the completion is generated: both wait on the servers.
            ordered, scores = await _both(self._generated(job), self._scored(job))
            return web.json_response(await self.echo_response(job, ordered, scores), dumps=_dumps)

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

    # -- what a stream asks (dualvllm.service.streaming.Generation) -------------------------------

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


async def _parse(request: web.Request, schema: type[S]) -> S:
    try:
        raw = await request.json()
    except json.JSONDecodeError as exc:
        raise RequestError(f"the body is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise RequestError(f"the body must be a JSON object, got {type(raw).__name__}")
    return _validated(schema, raw)


def _validated(schema: type[S], raw: dict[str, Any]) -> S:
    try:
        return schema.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        problems = "; ".join(_describe(e) for e in exc.errors(include_url=False)[:5])
        # 400 as OpenAI and vLLM answer (not aiohttp's usual 422): the `openai` client raises
        # BadRequestError for it, the exception its users catch.
        raise RequestError(problems, code=first["type"], param=param) from exc


def _describe(error: Any) -> str:
    where = ".".join(str(part) for part in error["loc"])
    if error["type"] == "extra_forbidden":
        return f"unknown field {where!r} (q* options go in the 'dualvllm' object)"
    message = error["msg"].removeprefix("Value error, ")
    return f"{where}: {message}" if where else message


def _refuse(problem: str | None) -> None:
    if problem is not None:
        raise RequestError(problem, code="unsupported_parameter")


def _error(status: int, message: str, kind: str, code: str | None = None, param: str | None = None) -> web.Response:
    return web.json_response(error_body(message, kind, code, param), status=status)


def _dumps(body: Any) -> str:
    return json.dumps(body, separators=(",", ":"))


def _short(name: str) -> str:
    """A model's short name: the last part of a path or hub id."""
    return PurePath(name).name or name


def listening_socket(config: ServiceConfig) -> socket.socket:
    """The endpoint's socket, bound and listening: taken before anything slow starts, so that a
    port in use fails in one line instead of after the servers' start (~40 s on CPU), and no
    other process can take the port meanwhile. Port 0 picks a free one. Connections that arrive
    before `serve` answers wait in the backlog. With several workers the port is shared with
    them (SO_REUSEPORT; dualvllm.service.workers)."""
    where = f"{config.service_host}:{config.service_port}"
    try:
        return socket.create_server((config.service_host, config.service_port), reuse_port=config.workers > 1)
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            raise InvalidInputError(
                f"the q* endpoint's address {where} is in use (another `dualvllm serve`?): pass "
                "--service-port with a free port, or --service-port 0 to pick one"
            ) from err
        raise InvalidInputError(
            f"the q* endpoint cannot listen on {where}: {err.strerror or err}; check --service-host and --service-port"
        ) from err


async def serve(
    coordinator: DualVLLMCoordinator,
    config: ServiceConfig,
    *,
    ready: Callable[[str, str], None] | None = None,
    sock: socket.socket | None = None,
    worker: WorkerPlace | None = None,
) -> None:
    """Serve until cancelled; `ready(url, model name)` is called once the socket listens.
    `sock`: a socket from `listening_socket(config)`, taken over (closed when serving ends);
    else one is bound here. `worker`: this process is one of an endpoint's workers
    (dualvllm.service.workers), named in each response's X-DualVLLM-Worker header, whose
    /metrics holds every worker's series (dualvllm.service.worker_metrics)."""
    sock = listening_socket(config) if sock is None else sock
    service = QStarService(coordinator, config)
    service.place = worker
    coordinator.observe_server_calls(service.metrics.server_call)
    app = service.app()
    if worker is not None:
        name = worker.name

        async def name_worker(request: web.Request, response: web.StreamResponse) -> None:
            response.headers["X-DualVLLM-Worker"] = name

        app.on_response_prepare.append(name_worker)
    # handler_cancellation: a client that disconnects cancels its handler, so its
    # sequences stop instead of generating for nobody.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    own_metrics: web.AppRunner | None = None
    try:
        if worker is not None:
            own_metrics = await serve_own(worker, service.metrics.render)
        await web.SockSite(runner, sock).start()
        host, port = runner.addresses[0][:2]
        url = f"http://{host}:{port}"
        log.info("q* service on %s/v1 (model %r)", url, service.model)
        if ready is not None:
            ready(url, service.model)
        await asyncio.Event().wait()
    finally:
        if own_metrics is not None:
            await own_metrics.cleanup()
        await runner.cleanup()
        sock.close()
