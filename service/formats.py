"""Completion and chat: the two shapes of an OpenAI answer, as two small format objects.

Everything that differs between /v1/completions and /v1/chat/completions once a request is
validated lives here: the object names, the response id, a choice (text against message),
a stream chunk's text (text against delta, the first one with the role) and the logprobs
(the legacy completion lists against chat's one entry per token). The service asks the
job's format; it never branches on which it is.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Protocol
from collections.abc import Mapping, Sequence

from dualvllm.coordinator.outputs import GenerationOutput
from dualvllm.service import responses
from dualvllm.service.schema import QStarOptions


@dataclass(frozen=True)
class TokenLogprobs:
    """Some of a choice's tokens, in order, with their log q* and q*'s top candidates."""

    ids: Sequence[int]
    logprobs: Sequence[float]
    top: Sequence[Mapping[int, float]] | None  # per token; None when not asked for (logprobs 0)

    @classmethod
    def of(cls, output: GenerationOutput, start: int = 0) -> TokenLogprobs:
        """The output's tokens from `start` on."""
        top = None if output.top_logprobs is None else output.top_logprobs[start:]
        return cls(output.generated_tokens[start:], output.logprobs_q[start:], top)

    def token_ids(self) -> set[int]:
        """Every token id whose text the logprobs show."""
        return {*self.ids, *(i for row in self.top or () for i in row)}


class Format(Protocol):
    """How answers of one endpoint are written (see the module docstring)."""

    whole: str  # the `object` of a whole answer
    chunk: str  # the `object` of a stream chunk

    def request_id(self) -> str: ...

    def choice(
        self, index: int, output: GenerationOutput, options: QStarOptions, logprobs: dict[str, Any] | None
    ) -> dict[str, Any]: ...

    def delta(self, piece: str, first: bool) -> dict[str, Any]:
        """A stream chunk's text fields: `piece` follows what was sent; `first` opens the choice."""
        ...

    def logprobs(self, tokens: TokenLogprobs, texts: Mapping[int, str], offset: int) -> dict[str, Any]:
        """OpenAI's logprobs of `tokens`; `texts` maps every id in them to its text, `offset` is
        where the first token's text starts in the choice (what the tokens before it spelt)."""
        ...

    def add_token_ids(
        self, body: dict[str, Any], prompts: Sequence[Sequence[int]] | None, generated: Sequence[Sequence[int]]
    ) -> None:
        """vLLM's return_token_ids: the prompt's ids (`prompts`, one per choice of `body`; None in
        a stream chunk after a choice's first) and each choice's generated ids (a stream chunk's:
        those decided since the choice's last chunk), where vLLM's server puts them."""
        ...


class CompletionFormat:
    whole = chunk = "text_completion"

    def request_id(self) -> str:
        return f"cmpl-{uuid.uuid4().hex}"

    def choice(
        self, index: int, output: GenerationOutput, options: QStarOptions, logprobs: dict[str, Any] | None
    ) -> dict[str, Any]:
        return {
            "index": index,
            "text": output.generated_text,
            "logprobs": logprobs,
            "finish_reason": responses.finish_reason(output),
            "dualvllm": responses.qstar_record(output, options),
        }

    def delta(self, piece: str, first: bool) -> dict[str, Any]:
        return {"text": piece}

    def logprobs(self, tokens: TokenLogprobs, texts: Mapping[int, str], offset: int) -> dict[str, Any]:
        """The legacy lists: log q* of each token, and per token a dict of the token itself and
        q*'s top candidates (as many as asked for, none for logprobs 0), as vLLM answers."""
        rows = tokens.top or [{} for _ in tokens.ids]
        top = [
            {texts[token]: value, **{texts[i]: v for i, v in row.items()}}
            for token, value, row in zip(tokens.ids, tokens.logprobs, rows)
        ]
        return responses.legacy_logprobs([texts[t] for t in tokens.ids], tokens.logprobs, top, offset)

    def add_token_ids(
        self, body: dict[str, Any], prompts: Sequence[Sequence[int]] | None, generated: Sequence[Sequence[int]]
    ) -> None:
        for i, (choice, ids) in enumerate(zip(body["choices"], generated)):
            choice["token_ids"] = list(ids)
            if prompts is not None:
                choice["prompt_token_ids"] = list(prompts[i])


class ChatFormat:
    whole, chunk = "chat.completion", "chat.completion.chunk"

    def request_id(self) -> str:
        return f"chatcmpl-{uuid.uuid4().hex}"

    def choice(
        self, index: int, output: GenerationOutput, options: QStarOptions, logprobs: dict[str, Any] | None
    ) -> dict[str, Any]:
        return {
            "index": index,
            "message": {"role": "assistant", "content": output.generated_text},
            "logprobs": logprobs,
            "finish_reason": responses.finish_reason(output),
            "dualvllm": responses.qstar_record(output, options),
        }

    def delta(self, piece: str, first: bool) -> dict[str, Any]:
        return {"delta": {"role": "assistant", "content": piece} if first else {"content": piece}}

    def logprobs(self, tokens: TokenLogprobs, texts: Mapping[int, str], offset: int) -> dict[str, Any]:
        """One entry per token, with q*'s top candidates (none when not asked for)."""
        rows = tokens.top or [{} for _ in tokens.ids]
        content = []
        for token, logprob, top in zip(tokens.ids, tokens.logprobs, rows):
            entry = _chat_token(texts[token], logprob)
            entry["top_logprobs"] = [_chat_token(texts[i], v) for i, v in top.items()]
            content.append(entry)
        return {"content": content}

    def add_token_ids(
        self, body: dict[str, Any], prompts: Sequence[Sequence[int]] | None, generated: Sequence[Sequence[int]]
    ) -> None:
        if prompts is not None:
            body["prompt_token_ids"] = list(prompts[0])  # one conversation per chat request
        for choice, ids in zip(body["choices"], generated):
            choice["token_ids"] = list(ids)


COMPLETION = CompletionFormat()
CHAT = ChatFormat()


def _chat_token(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
