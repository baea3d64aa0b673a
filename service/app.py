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
import errno
import hmac
import json
import logging
import socket
import time
from pathlib import PurePath
from typing import Any, TypeVar
from collections.abc import Awaitable, Callable, Sequence

from aiohttp import web
from pydantic import BaseModel, ValidationError

from dualvllm.common.errors import InvalidInputError, LifecycleError, ServiceBusyError
from dualvllm.coordinator.core import DualVLLMCoordinator
from dualvllm.coordinator.outputs import GenerationOutput
from dualvllm.service.building import ALPHA_SUFFIX, ROLE_ALPHAS, JobBuilder, refuse
from dualvllm.service.config import ServiceConfig
from dualvllm.service.dev_routes import DevRoutes
from dualvllm.service.errors import RequestError, error_body, error_of
from dualvllm.service.generate import generate_response, render_response
from dualvllm.service.jobs import Job, RequestQueue
from dualvllm.service.metrics import ServiceMetrics
from dualvllm.service.running import JobRunner, dumps
from dualvllm.service.schema import ChatCompletionRequest, CompletionRequest, GenerateRequest
from dualvllm.service.worker_metrics import WorkerPlace, every_worker, serve_own

log = logging.getLogger("dualvllm.service")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
S = TypeVar("S", bound=BaseModel)


class QStarService:
    """The routes: each parses its request, hands it to the builder (a checked job) and the runner
    (dualvllm.service.building, dualvllm.service.running), and answers; middlewares map errors to
    OpenAI's error objects and check the key."""

    def __init__(self, coordinator: DualVLLMCoordinator, config: ServiceConfig) -> None:
        self.coordinator = coordinator
        self.config = config
        theta, t = coordinator.session.model_names
        self.model = config.served_model_name or f"{_short(theta)}+{_short(t)}"
        self.admission = RequestQueue(coordinator.capacity, config.max_queued_sequences)
        self.metrics = ServiceMetrics(coordinator, self.admission)
        self.jobs = JobBuilder(coordinator, config, self.model)
        self.runner = JobRunner(coordinator, config, self.model, self.admission, self.metrics)
        self.created = int(time.time())
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
        body = self.jobs.with_model(await _parse(request, CompletionRequest))
        return await self.runner.run(request, await self.jobs.completion_job(body))

    async def generate_tokens(self, request: web.Request) -> web.StreamResponse:
        """vLLM's POST /inference/v1/generate: token ids in, token ids out (dualvllm.service.generate),
        checked and run as the same request to /v1/completions would be."""
        raw = await _parse(request, GenerateRequest)
        refuse(raw.unsupported())
        body = self.jobs.with_model(
            _validated(CompletionRequest, raw.as_completion(self.jobs.default_model(request.path)))
        )
        job = await self.jobs.completion_job(body)

        async def answer(
            job: Job, outputs: Sequence[GenerationOutput], rows: Sequence[list[dict[str, Any] | None]] | None
        ) -> dict[str, Any]:
            texts = await self.runner.logprob_texts(job, outputs) if raw.output_mode == "text" else {}
            return generate_response(raw, job, outputs, body.model, None if rows is None else rows[0], texts)

        return await self.runner.run(request, job, answer)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = self.jobs.with_model(await _parse(request, ChatCompletionRequest))
        job = self.jobs.chat_job(body, *await self.jobs.chat_prompts(body))
        return await self.runner.run(request, job)

    async def render_chat(self, request: web.Request) -> web.Response:
        """vLLM's POST /v1/chat/completions/render: the chat request as the generate request
        (/inference/v1/generate) that samples the same reply (dualvllm.service.generate)."""
        body = self.jobs.with_model(await _parse(request, ChatCompletionRequest))
        theta_ids, t_ids, budget = await self.jobs.chat_prompts(body)
        self.jobs.chat_job(body, theta_ids, t_ids, budget)  # the checks the chat request itself would pass
        return web.json_response(render_response(body, body.model, theta_ids, t_ids, budget), dumps=dumps)


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


def _error(status: int, message: str, kind: str, code: str | None = None, param: str | None = None) -> web.Response:
    return web.json_response(error_body(message, kind, code, param), status=status)


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
