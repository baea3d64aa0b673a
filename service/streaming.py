"""Streamed responses: server-sent events with each choice's text as its tokens are decided.

The coordinator hands over tokens as each step decides them (`on_tokens`). Events that
arrive while a chunk is being prepared are merged into the next one, so the service sends
at most one chunk per choice per round of detokenization, however fast tokens come.

Text is shown only once it is final:
- a trailing incomplete UTF-8 character (U+FFFD) waits for the next token;
- with stop strings, the text is cut at a stop string, and the last (longest stop - 1)
  characters wait, since they may start one;
- a trailing EOS token is not text.
The last chunk of a choice carries the rest of its final text, its finish_reason, its
`dualvllm` record and, when asked for, the logprobs of all its tokens.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator

from aiohttp import web

from common.errors import GenerationFailedError
from coordinator.outputs import GenerationOutput
from service import responses
from service.errors import error_of

if TYPE_CHECKING:
    from service.app import Job, QStarService

log = logging.getLogger("dualvllm.service")


@dataclass
class ChoiceText:
    """What one streamed choice has decided and already sent."""

    hold: int  # characters kept back: the longest stop string - 1
    stops: tuple[str, ...]
    tokens: list[int] = field(default_factory=list)
    sent: str = ""
    opened: bool = False  # the first chunk (chat: with the role) went out

    def visible_tokens(self, eos_ids: frozenset[int]) -> list[int]:
        if self.tokens and self.tokens[-1] in eos_ids:
            return self.tokens[:-1]
        return self.tokens

    def delta(self, text: str) -> str:
        """The part of `text` (all tokens so far) that is final and not yet sent."""
        safe = text.rstrip("\ufffd")
        cuts = [i for i in (safe.find(s) for s in self.stops) if i >= 0]
        safe = safe[:min(cuts)] if cuts else safe[:max(0, len(safe) - self.hold)]
        return self._advance(safe)

    def last(self, text: str) -> str:
        """The rest of the choice's final text."""
        if not text.startswith(self.sent):  # a tokenizer that rewrote earlier text as tokens came
            log.warning("streamed text %r is not a prefix of the final text %r", self.sent, text)
            return ""
        return self._advance(text)

    def _advance(self, safe: str) -> str:
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        piece, self.sent = safe[len(self.sent):], safe
        return piece


async def stream_choices(request: web.Request, service: QStarService, job: Job) -> web.StreamResponse:
    """Answer `job` as server-sent events; "data: [DONE]" ends a complete stream."""
    events: asyncio.Queue[tuple[int, list[int] | GenerationOutput | BaseException]] = asyncio.Queue()

    def on_tokens(index: int, tokens: Any) -> None:
        events.put_nowait((index, list(tokens)))

    stops = tuple(job.request.stop_strings())
    choices = [ChoiceText(hold=max((len(s) for s in stops), default=1) - 1, stops=stops)
               for _ in range(job.sequences)]
    writer = _Writer(service, job)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    async with service.generate(job, on_tokens) as outputs:
        pump = asyncio.create_task(_pump(outputs, events))
        try:
            await _relay(response, writer, job, choices, events)
        except ConnectionError:  # the client is gone: nobody to tell
            raise
        except Exception as exc:  # noqa: BLE001 - headers are sent: the error goes in the stream
            await _send(response, error_of(exc)[1])
        finally:
            pump.cancel()
            await asyncio.gather(pump, return_exceptions=True)
        await response.write(b"data: [DONE]\n\n")
    return response


async def _relay(response: web.StreamResponse, writer: _Writer, job: Job, choices: list[ChoiceText],
                 events: asyncio.Queue[Any]) -> None:
    """Chunks until every choice finished (and the usage chunk if asked for); raises what
    failed, a failed choice included."""
    finished: list[GenerationOutput] = []
    while len(finished) < job.sequences:
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
                choices[index].tokens.extend(item)
                grown.add(index)
        await _send_deltas(response, writer, choices, sorted(grown - {o.index for o in done}))
        for output in done:
            await _send(response, await writer.last_chunk(choices[output.index], output))
        finished.extend(done)
    if job.request.stream_options is not None and job.request.stream_options.include_usage:
        await _send(response, writer.usage_chunk(finished))


async def _pump(outputs: AsyncIterator[GenerationOutput], events: asyncio.Queue[Any]) -> None:
    try:
        async for output in outputs:
            events.put_nowait((output.index, output))
    except Exception as exc:  # noqa: BLE001 - handed to the writer, which answers with it
        events.put_nowait((-1, exc))


async def _send_deltas(response: web.StreamResponse, writer: _Writer, choices: list[ChoiceText],
                       moved: list[int]) -> None:
    """A chunk for each of the `moved` choices (unfinished, with new tokens) whose final text grew."""
    eos_ids = writer.service.coordinator.eos_token_ids
    texts = await asyncio.gather(*(writer.service.coordinator.detokenize(choices[i].visible_tokens(eos_ids))
                                   for i in moved))
    for i, text in zip(moved, texts):
        piece = choices[i].delta(text)
        if piece:
            await _send(response, writer.chunk(choices[i], i, piece))


async def _send(response: web.StreamResponse, body: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n")


class _Writer:
    """The chunks of one streamed job."""

    def __init__(self, service: QStarService, job: Job) -> None:
        self.service, self.job = service, job
        self.chat = job.kind == "chat"
        self.id = responses.request_id(job.kind)
        self.created = int(time.time())

    def chunk(self, choice: ChoiceText, index: int, piece: str, finish: GenerationOutput | None = None,
              logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        entry: dict[str, Any] = {"index": index, "logprobs": logprobs,
                                 "finish_reason": None if finish is None else responses.finish_reason(finish)}
        if self.chat:
            entry["delta"] = {"content": piece} if choice.opened else {"role": "assistant", "content": piece}
        else:
            entry["text"] = piece
        choice.opened = True
        if finish is not None:
            entry["dualvllm"] = responses.qstar_record(finish, self.job.options)
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return responses.envelope(kind, self.id, self.created, self.service.model, [entry], None)

    async def last_chunk(self, choice: ChoiceText, output: GenerationOutput) -> dict[str, Any]:
        logprobs = None
        if self.job.want_logprobs:
            texts = await self.service.logprob_texts(self.job, [output])
            logprobs = (responses.chat_logprobs if self.chat else responses.completion_logprobs)(output, texts)
        return self.chunk(choice, output.index, choice.last(output.generated_text), output, logprobs)

    def usage_chunk(self, outputs: list[GenerationOutput]) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return responses.envelope(kind, self.id, self.created, self.service.model, [],
                                  responses.usage(self.job.prompt_tokens, outputs))

