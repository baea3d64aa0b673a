"""OpenAI response objects built from the coordinator's GenerationOutputs (pure functions):
the parts completions and chat share, and echo's (completions only). Where the two differ,
dualvllm.service.formats decides.

A choice's `dualvllm` object carries what q* adds (see dualvllm.service.schema): always the mean
alpha and the coordinator's own finish reason; with `return_token_ids` the per-token
token ids, alpha, log q*, log pi_theta and log pi_t (what a trainer needs for importance
weights); with `return_diagnostics` the diagnostics summaries. A choice that echoes a
scored prompt also has `prompt`: the prompt's token ids, and per position alpha, log q*,
log pi_theta and log pi_t (None at position 0, as OpenAI's echoed logprobs).
"""

from __future__ import annotations

from typing import Any
from collections.abc import Mapping, Sequence

from dualvllm.coordinator.outputs import GenerationOutput
from dualvllm.service.schema import QStarOptions
from dualvllm.service.scoring import PromptScores

# The coordinator's finish reasons, in OpenAI's words.
FINISH_REASONS = {
    "eos": "stop",
    "stop_token": "stop",
    "stop_string": "stop",
    "max_tokens": "length",
    "context_limit": "length",
}


def finish_reason(output: GenerationOutput) -> str:
    return FINISH_REASONS[output.finish_reason]


def qstar_record(output: GenerationOutput, options: QStarOptions) -> dict[str, Any]:
    """The choice's `dualvllm` object."""
    record: dict[str, Any] = {"mean_alpha": _finite(output.mean_alpha), "finish_reason": output.finish_reason}
    if options.return_token_ids:
        record.update(
            token_ids=output.generated_tokens,
            alpha=output.alpha_history,
            logprobs_q=output.logprobs_q,
            logprobs_theta=output.logprobs_theta,
            logprobs_t=output.logprobs_t,
        )
    if options.return_diagnostics:
        record["diagnostics"] = output.diagnostics
    return record


def usage(prompt_tokens: int, outputs: Sequence[GenerationOutput]) -> dict[str, int]:
    completion = sum(len(o.generated_tokens) for o in outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def echo_logprobs(scores: PromptScores, output: GenerationOutput | None, texts: Mapping[int, str]) -> dict[str, Any]:
    """Legacy logprobs of an echoed prompt and its completion (`output`; None for max_tokens 0).

    As vLLM answers echo: position 0 has None; every other position's top_logprobs holds q*'s
    top candidates and the token itself, whether or not it is among them.
    """
    ids, values, rows = list(scores.token_ids), list(scores.logprob_q), list(scores.top)
    if output is not None:
        ids += output.generated_tokens
        values += output.logprobs_q
        rows += output.top_logprobs or [{} for _ in output.generated_tokens]  # logprobs 0: the token alone
    top = [
        None if row is None else {texts[i]: v for i, v in {**row, token: value}.items()}
        for token, value, row in zip(ids, values, rows)
    ]
    return legacy_logprobs([texts[t] for t in ids], values, top)


def legacy_logprobs(
    tokens: list[str],
    values: Sequence[float | None],
    top: Sequence[Mapping[str, float | None] | None] | None,
    offset: int = 0,
) -> dict[str, Any]:
    """OpenAI's completion logprobs of tokens with these texts; the first starts at `offset` in the
    choice's text (a stream chunk's tokens follow the earlier chunks')."""
    offsets, at = [], offset
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {"tokens": tokens, "token_logprobs": list(values), "top_logprobs": top, "text_offset": offsets}


def echo_choice(
    index: int,
    prompt_text: str,
    scores: PromptScores | None,
    output: GenerationOutput | None,
    options: QStarOptions,
    texts: Mapping[int, str],
) -> dict[str, Any]:
    """A completion choice that starts with its prompt; `scores` when logprobs were asked for,
    `output` unless max_tokens was 0 (then the finish reason is "length", as vLLM gives)."""
    record: dict[str, Any]
    if output is None:
        text, reason, record = prompt_text, "length", {"mean_alpha": None, "finish_reason": "max_tokens"}
    else:
        text, reason, record = prompt_text + output.generated_text, finish_reason(output), qstar_record(output, options)
    logprobs = None
    if scores is not None:
        logprobs = echo_logprobs(scores, output, texts)
        record["prompt"] = {
            "token_ids": scores.token_ids,
            "alpha": scores.alpha,
            "logprobs_q": scores.logprob_q,
            "logprobs_theta": scores.logprob_theta,
            "logprobs_t": scores.logprob_t,
        }
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason, "dualvllm": record}


def envelope(
    kind: str, request_id: str, created: int, model: str, choices: list[dict[str, Any]], usage_: dict[str, int] | None
) -> dict[str, Any]:
    """A whole response ("text_completion" / "chat.completion") or one stream chunk
    ("text_completion" / "chat.completion.chunk")."""
    body: dict[str, Any] = {"id": request_id, "object": kind, "created": created, "model": model, "choices": choices}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def _finite(value: float) -> float | None:
    return value if value == value else None  # NaN (no tokens) is not JSON
