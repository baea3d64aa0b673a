"""vLLM's tokens-in, tokens-out answers (pure functions): /inference/v1/generate's response and
/v1/chat/completions/render's, in the shapes of the pinned vLLM's own server
(vllm/entrypoints/scale_out/token_in_token_out/protocol.py: GenerateTokensResponse,
GenerateTextResponse, GenerateRequest).

Render then generate is vLLM's split of a chat request: the render answer is a generate
request. Here it also carries the teacher's own prompt (`dualvllm.t_prompt`) when the
teacher's chat template renders the conversation differently, so that the pair stays one
q* request. Logprobs are log q*, as everywhere in the service; a token's `rank` is its place
among q*'s candidates shown (1 = likeliest), None where it is not among them, since q* has
no rank over the whole vocabulary.
"""

from __future__ import annotations

import time
import uuid
from typing import Any
from collections.abc import Mapping, Sequence

from dualvllm.coordinator.outputs import GenerationOutput
from dualvllm.service import responses
from dualvllm.service.formats import CHAT, TokenLogprobs
from dualvllm.service.jobs import Job
from dualvllm.service.schema import ChatCompletionRequest, GenerateRequest


def generate_response(
    request: GenerateRequest,
    job: Job,
    outputs: Sequence[GenerationOutput],
    model: str,
    prompt_logprobs: list[dict[str, Any] | None] | None,
    texts: Mapping[int, str],
) -> dict[str, Any]:
    """GenerateTokensResponse (output_mode "tokens") or GenerateTextResponse ("text") of a job
    whose outputs are all in; `texts` (text mode with logprobs) names every token they show."""
    logprobs = job.top_logprobs if job.want_logprobs else None
    choices = []
    for output in outputs:
        choice: dict[str, Any] = {
            "index": output.index,
            "finish_reason": responses.finish_reason(output),
            "stop_reason": _stop_reason(output),
            "token_ids": list(output.generated_tokens),
            "logprobs": None,
            "dualvllm": responses.qstar_record(output, job.options),
        }
        if request.output_mode == "text":
            choice["text"] = output.generated_text
            if logprobs is not None:
                choice["logprobs"] = CHAT.logprobs(TokenLogprobs.of(output), texts, 0)
        elif logprobs is not None:
            choice["logprobs"] = {"content": token_logprobs(TokenLogprobs.of(output), logprobs)}
        choices.append(choice)
    prompt_ids = job.prompts[0][0]
    return {
        "request_id": request.request_id or f"generate-{uuid.uuid4().hex}",
        "model": model,
        "created": int(time.time()),
        "output_mode": request.output_mode,
        "choices": choices,
        "usage": responses.usage(len(prompt_ids), outputs),
        "prompt_logprobs": prompt_logprobs,
        "prompt_token_ids": list(prompt_ids) if request.return_token_ids else None,
    }


def token_logprobs(tokens: TokenLogprobs, shown: int) -> list[dict[str, Any]]:
    """vLLM's generate logprobs: per token its id, log q* and rank, and `top_logprobs` in vLLM's
    order (the sampled token first, then q*'s likeliest others), max(shown, 1) entries, as
    vLLM's server cuts them."""
    rows = tokens.top or [{} for _ in tokens.ids]
    content = []
    for token, value, row in zip(tokens.ids, tokens.logprobs, rows):
        ranked = sorted(row.items(), key=lambda item: -item[1])
        ranks = {i: r for r, (i, _) in enumerate(ranked, 1)}
        entries = [(token, value), *((i, v) for i, v in ranked if i != token)][: max(shown, 1)]
        content.append(
            {
                "token_id": token,
                "logprob": value,
                "rank": ranks.get(token),
                "top_logprobs": [{"token_id": i, "logprob": v, "rank": ranks.get(i)} for i, v in entries],
            }
        )
    return content


def render_response(
    body: ChatCompletionRequest, model: str, theta_ids: list[int], t_ids: list[int], max_tokens: int
) -> dict[str, Any]:
    """A chat request rendered into the generate request that samples the same reply: the
    base's token ids, the sampling fields, and the teacher's own ids when they differ."""
    options = body.dualvllm.model_dump(exclude={"t_messages", "t_prompt"}, exclude_defaults=True)
    if t_ids != theta_ids:
        options["t_prompt"] = list(t_ids)
    params: dict[str, Any] = {
        "n": body.n,
        "temperature": body.temperature,
        "max_tokens": max_tokens,
        "seed": body.seed,
        "stop": body.stop,
        "stop_token_ids": body.stop_token_ids,
        "ignore_eos": body.ignore_eos,
        "logprobs": (body.top_logprobs or 0) if body.logprobs else None,
    }
    return {
        "request_id": f"render-{uuid.uuid4().hex}",
        "token_ids": list(theta_ids),
        "features": None,
        "sampling_params": params,
        "model": model,
        "dualvllm": options,
    }


def _stop_reason(output: GenerationOutput) -> int | None:
    """vLLM's stop_reason: the stop token id that ended the sequence; None on EOS and length.
    (vLLM gives the matched stop string too; the coordinator does not record which one.)"""
    if output.finish_reason == "stop_token" and output.generated_tokens:
        return output.generated_tokens[-1]
    return None
