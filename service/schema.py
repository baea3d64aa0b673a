"""What the q* endpoint accepts: OpenAI's completion and chat requests, plus a `dualvllm` object.

The OpenAI fields keep OpenAI's names, types and defaults. Fields OpenAI has and q*
sampling cannot honour (top_p, penalties, logit_bias, best_of, suffix) are accepted
only at their neutral values, so a client that sends its defaults works, and one that
asks for more hears why not (`unsupported`). Any other field is refused: a misspelt
option fails loudly instead of being ignored.

The q* extension (`"dualvllm": {...}` in the body; `extra_body={"dualvllm": {...}}` with
the `openai` package):
    fixed_alpha        replace alpha* with this alpha in [0, 1] (0 = base only, 1 = teacher only)
    t_prompt           completions: the teacher's own prompt (text or token ids), e.g. with a hint
    t_messages         chat: the teacher's own messages, rendered with the teacher's template
    top_k              mix only each model's top_k most likely tokens (<= the service's top_k)
    return_token_ids   per choice: token ids, alpha, log q*, log pi_theta, log pi_t per token
    return_diagnostics per choice: KL/ESS/entropy summaries (dualvllm.theory.diagnostics)
    ignore_eos         generate past EOS up to max_tokens (fixed lengths, for benchmarks)
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

TokenIds = list[int]
PROMPT_FORMS = "a string, a list of strings, a list of token ids (integers) or a list of such lists"


def _is_ids(value: Any) -> bool:
    # type() is int: JSON true/false are not token ids 1 and 0.
    return isinstance(value, list) and all(type(v) is int for v in value)


def _one_prompt(value: Any) -> Any:
    if isinstance(value, str) or _is_ids(value):
        return value
    raise ValueError("must be a string or a list of token ids (integers; true/false are not ids)")


def _prompts(value: Any) -> Any:
    """OpenAI's four prompt forms, checked as a whole: one clear error instead of one per Union branch."""
    if isinstance(value, str) or _is_ids(value):
        return value
    if isinstance(value, list) and (all(isinstance(v, str) for v in value) or all(_is_ids(v) for v in value)):
        return value
    raise ValueError(f"must be {PROMPT_FORMS} (true/false are not token ids)")


PromptField = Annotated[str | list[str] | TokenIds | list[TokenIds], BeforeValidator(_prompts)]
OnePrompt = Annotated[str | TokenIds, BeforeValidator(_one_prompt)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def rendered(self) -> dict[str, Any]:
        """The message as chat templates take it: text content, parts joined."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        message: dict[str, Any] = {"role": self.role, "content": text}
        if self.name is not None:
            message["name"] = self.name
        return message


class QStarOptions(_Strict):
    """The `dualvllm` object of a request (see the module docstring)."""

    fixed_alpha: float | None = Field(None, ge=0, le=1)
    t_prompt: OnePrompt | None = None
    t_messages: list[ChatMessage] | None = Field(None, min_length=1)
    top_k: int | None = Field(None, ge=1)
    return_token_ids: bool = False
    return_diagnostics: bool = False
    ignore_eos: bool = False


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields both endpoints share."""

    model: str
    temperature: float = Field(1.0, ge=0)
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM's: stop after any of these ids (in token_ids, not in text)
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for the client's own logs; not used here
    top_p: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # vLLM's own fields, as its server takes them (what TRL's VLLMClient and vLLM users send).
    return_token_ids: bool | None = None  # completions: each choice's prompt_token_ids and token_ids
    return_tokens_as_token_ids: bool | None = None  # logprobs name tokens "token_id:<id>", not their text
    ignore_eos: bool = False  # as dualvllm.ignore_eos
    top_k: int | None = None  # vLLM's truncation: only 0 / -1 (none); q*'s candidates: dualvllm.top_k
    min_p: float | None = None
    repetition_penalty: float | None = None
    structured_outputs: dict[str, Any] | None = None
    dualvllm: QStarOptions = Field(default_factory=QStarOptions)

    def unsupported(self) -> str | None:
        """Why the request asks for what q* sampling cannot do, or None."""
        if self.top_p != 1.0:
            return (
                "top_p must be 1: q* is sampled from its full candidate set (top_k per model); "
                "use dualvllm.top_k to mix fewer candidates"
            )
        if self.presence_penalty or self.frequency_penalty:
            return "presence_penalty and frequency_penalty are not supported by q* sampling; leave them 0"
        if self.logit_bias:
            return "logit_bias is not supported by q* sampling"
        if self.top_k not in (None, 0, -1):
            return (
                f"top_k={self.top_k} would truncate q* to its {self.top_k} likeliest tokens, which q* sampling "
                "does not do; leave top_k 0 (or -1), and set dualvllm.top_k to mix fewer candidates per model"
            )
        if self.min_p not in (None, 0.0):
            return "min_p is not supported by q* sampling; leave it 0"
        if self.repetition_penalty not in (None, 1.0):
            return "repetition_penalty is not supported by q* sampling; leave it 1"
        if self.structured_outputs:
            return "structured_outputs (guided decoding) is not supported by q* sampling"
        return None

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def stop_ids(self) -> frozenset[int]:
        return frozenset(self.stop_token_ids or ())


class CompletionRequest(_Sampling):
    prompt: PromptField
    max_tokens: int | None = Field(None, ge=0)  # 0 only with echo: score the prompt, generate nothing
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False  # the prompt before the completion; with logprobs, each prompt token's log q*
    best_of: int | None = None
    suffix: str | None = None
    prompt_logprobs: int | None = Field(
        None, ge=-1
    )  # vLLM's: each prompt token's top logprobs (dualvllm.service.scoring)

    @model_validator(mode="after")
    def _teacher_prompt_only_for_completions(self) -> CompletionRequest:
        if self.dualvllm.t_messages is not None:
            raise ValueError("dualvllm.t_messages belongs to chat requests; give dualvllm.t_prompt here")
        return self

    def unsupported(self) -> str | None:
        if self.prompt_logprobs is not None and (self.stream or self.echo):
            return (
                "prompt_logprobs goes with stream=false and echo=false (echo with logprobs scores the "
                "prompt in OpenAI's shape instead)"
            )
        if self.echo and self.stream:
            return "echo is not streamed; send stream=false (the prompt's logprobs come in one answer)"
        if self.echo and self.dualvllm.t_prompt is not None:
            return (
                "echo scores the prompt under both models, so both must see it; leave out "
                "dualvllm.t_prompt (the teacher's own prompt would not match the prompt's positions)"
            )
        if self.best_of is not None and self.best_of != self.n:
            return "best_of is not supported; ask for n completions and rank them yourself"
        if self.suffix:
            return "suffix (insertion) is not supported"
        return super().unsupported()

    def prompts(self) -> list[str | TokenIds]:
        """The prompts, one per element: OpenAI's list forms are batches."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(p, int) for p in prompt):
            return [prompt]  # type: ignore[list-item]
        return list(prompt)  # type: ignore[arg-type]


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra variables for the chat template
    chat_template: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None

    def unsupported(self) -> str | None:
        if self.chat_template is not None:
            return "chat_template is not supported: each model renders with its own template"
        if self.tools:
            return "tools are not supported by the q* endpoint; render them into the messages yourself"
        return super().unsupported()

    @model_validator(mode="after")
    def _teacher_messages_only_for_chat(self) -> ChatCompletionRequest:
        if self.dualvllm.t_prompt is not None:
            raise ValueError("dualvllm.t_prompt belongs to completion requests; give dualvllm.t_messages here")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self

    def token_budget(self) -> int | None:
        """max_completion_tokens (OpenAI's current name) or max_tokens (its older one)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# -- vLLM's tokens-in, tokens-out API (/inference/v1/generate and the render routes) ----------


class GenerateSampling(_Strict):
    """`sampling_params` of vLLM's GenerateRequest: the fields of its SamplingParams that q*
    sampling honours, and the rest only at their neutral values (checked as completions
    check them). `output_kind` and the detokenizer switches change nothing in an answer that
    is never streamed and carries token ids, so any value is taken."""

    n: int = Field(1, ge=1)
    temperature: float = Field(1.0, ge=0)
    max_tokens: int | None = Field(None, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    prompt_logprobs: int | None = Field(None, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    structured_outputs: dict[str, Any] | None = None
    output_kind: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False


class GenerateRequest(_Strict):
    """vLLM's POST /inference/v1/generate body, text models only: token ids in, token ids (and
    with output_mode "text", text) out. `dualvllm` as on the other routes; with `t_prompt`
    (token ids) the teacher reads its own prompt, as /v1/chat/completions/render gives it."""

    token_ids: list[Annotated[int, Field(ge=0)]] = Field(min_length=1)
    sampling_params: GenerateSampling = Field(default_factory=GenerateSampling)
    model: str | None = None
    request_id: str | None = None
    output_mode: Literal["tokens", "text"] = "tokens"
    return_token_ids: bool | None = None
    stream: bool = False
    features: dict[str, Any] | None = None
    content_parts: list[dict[str, Any]] | None = None
    cache_salt: str | None = None
    priority: int = 0
    dualvllm: QStarOptions = Field(default_factory=QStarOptions)

    def unsupported(self) -> str | None:
        """Why the request asks for what the q* endpoint cannot do, or None."""
        if self.features is not None or self.content_parts:
            return (
                "multimodal features and content parts are not supported: q* mixes two text models; send "
                "token ids alone"
            )
        if self.stream:
            return "/inference/v1/generate is not streamed here; send stream=false, or stream /v1/completions"
        if self.priority:
            return "priority is not supported: the coordinator runs one first-come batch; leave it 0"
        if self.sampling_params.include_stop_str_in_output:
            return "include_stop_str_in_output is not supported; leave it false"
        return None

    def as_completion(self, model: str) -> dict[str, Any]:
        """The same request as /v1/completions takes it (token ids as the prompt), to be checked
        as a CompletionRequest; `model` when the body names none."""
        params = self.sampling_params.model_dump(
            exclude={
                "output_kind",
                "detokenize",
                "skip_special_tokens",
                "spaces_between_special_tokens",
                "include_stop_str_in_output",
            }
        )
        return {
            **params,
            "model": self.model or model,
            "prompt": self.token_ids,
            "return_token_ids": True,
            "return_tokens_as_token_ids": self.output_mode == "tokens",
            "dualvllm": self.dualvllm,
        }
