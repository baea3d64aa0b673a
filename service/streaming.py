"""Streamed responses: server-sent events with each choice's text as its tokens are decided.

The coordinator hands over tokens as each step decides them (`on_tokens`). Events that
arrive while a chunk is being prepared are merged into the next one, so the service sends
at most one chunk per choice per round of detokenization, however fast tokens come.

Text is shown only once it is final:
- a trailing incomplete UTF-8 character (U+FFFD) waits for the next token;
- with stop strings, the text is cut at a stop string, and the last (longest stop - 1)
  characters wait, since they may start one;
- a trailing EOS token is not text.
Logprobs are not held back: with `logprobs`, each chunk carries the logprobs of the tokens
decided since the choice's previous chunk (a chunk goes out for new tokens even when its
text must wait), as vLLM streams them; the chunks' logprobs put together are the whole
answer's. The last chunk of a choice carries the rest of its final text, the logprobs of
its tokens not sent yet, its finish_reason and its `dualvllm` record.

Streaming is written against `Generation`, the little it needs of the service; chat and
completion differ only through the job's format (dualvllm.service.formats).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence

from aiohttp import web

from dualvllm.common.errors import GenerationFailedError
from dualvllm.coordinator.outputs import GenerationOutput
from dualvllm.coordinator.sequence import TokenListener
from dualvllm.service import responses
from dualvllm.service.errors import error_of
from dualvllm.service.formats import TokenLogprobs
from dualvllm.service.jobs import Job

log = logging.getLogger("dualvllm.service")


class Generation(Protocol):
    """What a stream needs of the service."""

    model: str  # the served name, as chunks give it

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    def generate(
        self, job: Job, on_tokens: TokenListener
    ) -> AbstractAsyncContextManager[AsyncIterator[GenerationOutput]]:
        """The job's outputs as they finish; `on_tokens` hears each choice's tokens as decided."""
        ...

    async def detokenize(self, token_ids: Sequence[int]) -> str: ...

    async def token_texts(self, token_ids: Iterable[int], *, as_ids: bool = False) -> dict[int, str]:
        """The text of each single token (for logprobs); with `as_ids` "token_id:<id>"."""
        ...


@dataclass
class Decided:
    """Tokens a step decided for one choice, with their log q* and q*'s top candidates (empty
    unless the request asked for top logprobs)."""

    tokens: list[int]
    logprobs: list[float]
    top: list[Mapping[int, float]]


@dataclass
class ChoiceText:
    """What one streamed choice has decided and already sent."""

    hold: int  # characters kept back: the longest stop string - 1
    stops: tuple[str, ...]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # of the first len(logprobs) tokens
    top: list[Mapping[int, float]] = field(default_factory=list)
    sent: str = ""
    opened: bool = False  # the first chunk (chat: with the role) went out
    logged: int = 0  # tokens whose logprobs went out
    shown: int = 0  # tokens whose ids went out (return_token_ids)
    offset: int = 0  # where the next logged token's text starts (the logged tokens' texts, summed)

    def add(self, decided: Decided) -> None:
        self.tokens.extend(decided.tokens)
        self.logprobs.extend(decided.logprobs)
        self.top.extend(decided.top)

    def visible_tokens(self, eos_ids: frozenset[int]) -> list[int]:
        if self.tokens and self.tokens[-1] in eos_ids:
            return self.tokens[:-1]
        return self.tokens

    def delta(self, text: str) -> str:
        """The part of `text` (all tokens so far) that is final and not yet sent."""
        safe = text.rstrip("\ufffd")
        cuts = [i for i in (safe.find(s) for s in self.stops) if i >= 0]
        safe = safe[: min(cuts)] if cuts else safe[: max(0, len(safe) - self.hold)]
        return self._advance(safe)

    def last(self, text: str) -> str:
        """The rest of the choice's final text."""
        if not text.startswith(self.sent):  # a tokenizer that rewrote earlier text as tokens came
            log.warning("streamed text %r is not a prefix of the final text %r", self.sent, text)
            return ""
        return self._advance(text)

    def unlogged(self, with_top: bool) -> TokenLogprobs:
        """The tokens whose log q* is known and not sent yet."""
        end = len(self.logprobs)
        return TokenLogprobs(
            self.tokens[self.logged : end],
            self.logprobs[self.logged : end],
            self.top[self.logged : end] if with_top else None,
        )

    def _advance(self, safe: str) -> str:
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        piece, self.sent = safe[len(self.sent) :], safe
        return piece


async def stream_choices(request: web.Request, source: Generation, job: Job) -> web.StreamResponse:
    """Answer `job` as server-sent events; "data: [DONE]" ends a complete stream."""
    events: asyncio.Queue[tuple[int, Decided | GenerationOutput | BaseException]] = asyncio.Queue()

    def on_tokens(
        index: int, tokens: Sequence[int], logprobs: Sequence[float], top: Sequence[Mapping[int, float]]
    ) -> None:
        events.put_nowait((index, Decided(list(tokens), list(logprobs), list(top))))

    stops = tuple(job.request.stop_strings())
    choices = [ChoiceText(hold=max((len(s) for s in stops), default=1) - 1, stops=stops) for _ in range(job.sequences)]
    chunks = _Chunks(source, job)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    async with source.generate(job, on_tokens) as outputs:
        pump = asyncio.create_task(_pump(outputs, events))
        try:
            await _relay(response, source, chunks, choices, events)
        except ConnectionError:  # the client is gone: nobody to tell
            raise
        except Exception as exc:  # noqa: BLE001 - headers are sent: the error goes in the stream
            await _send(response, error_of(exc)[1])
        finally:
            pump.cancel()
            await asyncio.gather(pump, return_exceptions=True)
        await response.write(b"data: [DONE]\n\n")
    return response


async def _relay(
    response: web.StreamResponse,
    source: Generation,
    chunks: _Chunks,
    choices: list[ChoiceText],
    events: asyncio.Queue[Any],
) -> None:
    """Chunks until every choice finished (and the usage chunk if asked for); raises what
    failed, a failed choice included."""
    finished: list[GenerationOutput] = []
    while len(finished) < len(choices):
        batch = [await events.get()]
        while not events.empty():
            batch.append(events.get_nowait())
        done: list[GenerationOutput] = []
        grown: set[int] = set()
        for index, item in batch:
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, GenerationOutput):
                if item.error is not None:
                    raise GenerationFailedError(f"choice {item.index}: {item.error}")
                done.append(item)
            else:
                choices[index].add(item)
                grown.add(index)
        await _send_deltas(response, source, chunks, choices, sorted(grown - {o.index for o in done}))
        for output in done:
            await _send(response, await chunks.last(choices[output.index], output))
        finished.extend(done)
    if chunks.job.request.stream_options is not None and chunks.job.request.stream_options.include_usage:
        await _send(response, chunks.usage(finished))


async def _pump(outputs: AsyncIterator[GenerationOutput], events: asyncio.Queue[Any]) -> None:
    try:
        async for output in outputs:
            events.put_nowait((output.index, output))
    except Exception as exc:  # noqa: BLE001 - handed to the relay, which answers with it
        events.put_nowait((-1, exc))


async def _send_deltas(
    response: web.StreamResponse, source: Generation, chunks: _Chunks, choices: list[ChoiceText], moved: list[int]
) -> None:
    """A chunk for each of the `moved` choices (unfinished, with new tokens) whose final text
    grew or, with logprobs, that has tokens to report."""
    eos_ids = source.eos_token_ids
    texts = await asyncio.gather(*(source.detokenize(choices[i].visible_tokens(eos_ids)) for i in moved))
    for i, text in zip(moved, texts):
        chunk = await chunks.delta(choices[i], i, choices[i].delta(text))
        if chunk is not None:
            await _send(response, chunk)


async def _send(response: web.StreamResponse, body: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n")


class _Chunks:
    """The chunks of one streamed job."""

    def __init__(self, source: Generation, job: Job) -> None:
        self.source, self.job, self.format = source, job, job.format
        self.id = self.format.request_id()
        self.created = int(time.time())

    async def delta(self, choice: ChoiceText, index: int, piece: str) -> dict[str, Any] | None:
        """The chunk of an unfinished choice, or None when it has nothing new to show."""
        tokens = choice.unlogged(with_top=self.job.top_logprobs > 0)
        new_ids = self.job.request.return_token_ids and len(choice.tokens) > choice.shown
        if not piece and not (self.job.want_logprobs and tokens.ids) and not new_ids:
            return None
        return self._chunk(choice, index, piece, await self._logprobs(choice, tokens))

    async def last(self, choice: ChoiceText, output: GenerationOutput) -> dict[str, Any]:
        logprobs = await self._logprobs(choice, TokenLogprobs.of(output, choice.logged))
        return self._chunk(choice, output.index, choice.last(output.generated_text), logprobs, output)

    def usage(self, outputs: list[GenerationOutput]) -> dict[str, Any]:
        return responses.envelope(
            self.format.chunk,
            self.id,
            self.created,
            self.source.model,
            [],
            responses.usage(self.job.prompt_tokens, outputs),
        )

    async def _logprobs(self, choice: ChoiceText, tokens: TokenLogprobs) -> dict[str, Any] | None:
        """The logprobs of `tokens` (the choice's next ones), now counted as sent; None when not asked for."""
        if not self.job.want_logprobs:
            return None
        texts = await self.source.token_texts(
            tokens.token_ids(), as_ids=bool(self.job.request.return_tokens_as_token_ids)
        )
        logprobs = self.format.logprobs(tokens, texts, choice.offset)
        choice.logged += len(tokens.ids)
        choice.offset += sum(len(texts[t]) for t in tokens.ids)
        return logprobs

    def _chunk(
        self,
        choice: ChoiceText,
        index: int,
        piece: str,
        logprobs: dict[str, Any] | None,
        finish: GenerationOutput | None = None,
    ) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "index": index,
            **self.format.delta(piece, first=not choice.opened),
            "logprobs": logprobs,
            "finish_reason": None if finish is None else responses.finish_reason(finish),
        }
        first, choice.opened = not choice.opened, True
        if finish is not None:
            entry["dualvllm"] = responses.qstar_record(finish, self.job.options)
        chunk = responses.envelope(self.format.chunk, self.id, self.created, self.source.model, [entry], None)
        if self.job.request.return_token_ids:  # vLLM's: each chunk's new ids, the prompt's with a choice's first
            tokens = choice.tokens if finish is None else finish.generated_tokens
            prompt = self.job.prompts[index // self.job.request.n][0]
            self.format.add_token_ids(chunk, [prompt] if first else None, [tokens[choice.shown :]])
            choice.shown = len(tokens)
        return chunk
