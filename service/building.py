"""From a parsed request to a checked job (dualvllm.service.jobs.Job): the model it names, its
prompts encoded, and every limit a request can break (context, vocabulary, the per-request token
ceiling), each refused with a 400 that says what to change. dualvllm.service.running runs the job.
"""

from __future__ import annotations

import math
from typing import Any

from dualvllm.common.errors import UnknownModelError
from dualvllm.coordinator.core import DualVLLMCoordinator
from dualvllm.service.config import ServiceConfig
from dualvllm.service.errors import RequestError
from dualvllm.service.formats import CHAT, COMPLETION, Format
from dualvllm.service.jobs import Job
from dualvllm.service.schema import ChatCompletionRequest, CompletionRequest

# "<served name>@alpha=0.25" names the pair with dualvllm.fixed_alpha 0.25: how clients that
# send no extra body fields (lm-eval's loglikelihood requests) choose the base or the teacher.
ALPHA_SUFFIX = "@alpha="
# Route prefixes whose model list names one model alone first (dualvllm.service.app.QStarService.app).
ROLE_ALPHAS = {"teacher": 1.0, "base": 0.0}


class JobBuilder:
    """Builds the jobs of one service: `model` is its served name."""

    def __init__(self, coordinator: DualVLLMCoordinator, config: ServiceConfig, model: str) -> None:
        self.coordinator, self.config, self.model = coordinator, config, model

    def with_model(self, body: Any) -> Any:
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

    def default_model(self, path: str) -> str:
        """The model a request that names none asks for: the first its route lists (GET /v1/models)."""
        role = path.split("/")[1]
        return f"{self.model}{ALPHA_SUFFIX}{ROLE_ALPHAS[role]:g}" if role in ROLE_ALPHAS else self.model

    async def completion_job(self, body: CompletionRequest) -> Job:
        refuse(body.unsupported())
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
        return self.job(
            COMPLETION,
            body,
            encoded,
            max_tokens,
            top_logprobs=logprobs or 0,
            want_logprobs=logprobs is not None,
            echo=body.echo,
            prompt_logprobs=body.prompt_logprobs,
        )

    async def chat_prompts(self, body: ChatCompletionRequest) -> tuple[list[int], list[int], int]:
        """The base's and the teacher's prompt ids of a chat request (each model's own template),
        and its token budget."""
        refuse(body.unsupported())
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

    def chat_job(self, body: ChatCompletionRequest, theta_ids: list[int], t_ids: list[int], budget: int) -> Job:
        """The job of a chat request whose prompts are rendered (`chat_prompts`)."""
        return self.job(
            CHAT, body, [(theta_ids, t_ids)], budget, top_logprobs=body.top_logprobs or 0, want_logprobs=body.logprobs
        )

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

    def job(
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


def refuse(problem: str | None) -> None:
    """A 400 for what q* cannot do (a request's `unsupported()`), when there is one."""
    if problem is not None:
        raise RequestError(problem, code="unsupported_parameter")
