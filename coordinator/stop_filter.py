"""Which stop-string checks need the detokenizer: an exact pre-filter from each token's own text.

A sequence with stop strings has its newest tokens' text checked after every token
(coordinator/delivery.py). Without a local tokenizer each check is a /detokenize request:
in lockstep at batch 64 on the bundled models that made a token cost the coordinator
326-420 µs of CPU instead of 21-28 without stop strings, and 35-42 with this filter
(`python benchmarks/sequence_overhead.py --stop @@@@`; benchmarks/README.md).

Most checks can be settled without one. A window's text, spaces aside, is the concatenation
of its tokens' own texts (each token decoded alone, once per id and coordinator), as long
as none of them decodes alone to nothing or to a replacement character (a piece of a
character split over several tokens): decoders differ from that concatenation only by
spaces (SentencePiece's word-start marker, which a lone token loses; clean-up of spaces
before punctuation; spaces between special tokens). So when a stop string, spaces removed,
does not occur in that concatenation, spaces removed, it does not occur in the window's
text either, and the check is skipped. Every other window is decoded as before; a stop
string made only of spaces is always decoded.

That premise is checked on the windows themselves: the first CALIBRATION_WINDOWS decoded
windows (all of them are decoded until then) must equal their concatenation, spaces
removed, and so must every window decoded later. One that does not turns the filter off
for good, with a warning: every check is then decoded, as before this filter existed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from dualvllm.common.errors import DualVLLMError
from dualvllm.engines.protocol import Engine

log = logging.getLogger("dualvllm.coordinator")

# Decoded windows that must match their tokens' own texts before any check is skipped.
CALIBRATION_WINDOWS = 16
# Single-token decodes in flight at once (each is a request to the server).
MAX_CONCURRENT_DECODES = 32
REPLACEMENT = "\ufffd"


def _squeezed(text: str) -> str:
    return text.replace(" ", "")


class StopFilter:
    def __init__(self, decoder: Engine) -> None:
        self._decoder = decoder
        self._texts: dict[int, str] = {}  # token id -> its text decoded alone
        self._agreed = 0  # decoded windows that matched their tokens' texts
        self.enabled = True

    async def needed(self, windows: Sequence[Sequence[int]], stops: Sequence[Sequence[str]]) -> list[bool]:
        """Per window (token ids) and its stop strings: whether its text must be decoded."""
        if not self.enabled:
            return [True] * len(windows)
        try:
            await self._learn_tokens({i for window in windows for i in window if i not in self._texts})
        except DualVLLMError:  # the windows' own decoding reports the server's failure
            return [True] * len(windows)
        return [not self.settled(window, stop) for window, stop in zip(windows, stops)]

    def settled(self, window: Sequence[int], stop: Sequence[str]) -> bool:
        """True when the window's text certainly holds none of `stop`, from what is known now
        (no request): False until calibrated, or when a token's text alone is unknown."""
        if not self.enabled or self._agreed < CALIBRATION_WINDOWS:
            return False
        joined = self._joined(window)
        return joined is not None and not any(_squeezed(s) in joined for s in stop)  # "" is in every text

    def observe(self, windows: Sequence[Sequence[int]], texts: Sequence[str | None]) -> None:
        """The decoded texts of windows `needed` asked for: they check the filter's premise."""
        for window, text in zip(windows, texts):
            if not self.enabled or text is None:
                continue
            joined = self._joined(window)
            if joined is None:
                continue
            if _squeezed(text) == joined:
                self._agreed += 1
                continue
            self.enabled = False
            log.warning(
                "stop strings: this tokenizer decodes tokens %s to %r, which is not their own texts "
                "joined (spaces aside); every stop-string check is decoded by the server from now on",
                list(window),
                text,
            )

    def _joined(self, window: Sequence[int]) -> str | None:
        """The window's tokens' own texts joined, spaces removed; None when a token's text alone
        says nothing of its text in context (empty, or a piece of a character), or is unknown."""
        parts = [self._texts.get(i) for i in window]
        if any(not part or REPLACEMENT in part for part in parts):
            return None
        return _squeezed("".join(parts))  # type: ignore[arg-type]

    async def _learn_tokens(self, ids: set[int]) -> None:
        if not ids:
            return
        limit = asyncio.Semaphore(MAX_CONCURRENT_DECODES)

        async def decode(token: int) -> str:
            async with limit:
                return await self._decoder.detokenize([token])

        ordered = list(ids)
        texts = await asyncio.gather(*(decode(i) for i in ordered), return_exceptions=True)
        for token, text in zip(ordered, texts):
            if isinstance(text, str):
                self._texts[token] = text
        for text in texts:
            if isinstance(text, BaseException):
                raise text
