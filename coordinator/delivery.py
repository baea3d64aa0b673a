"""Finishing sequences: stop strings, the final text, and handing outputs to their callers.

Shared by every scheduler (per-token, speculative, lockstep): the text of generated
tokens comes from the base engine's detokenizer, so a stop string is found the same way
in every mode.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from dualvllm.common.errors import DualVLLMError
from dualvllm.coordinator.sequence import SequenceState
from dualvllm.coordinator.stats import Statistics
from dualvllm.coordinator.stop_filter import StopFilter
from dualvllm.engines.protocol import Engine


# A stop string ending in the newest token lies within this many tokens per character of the
# longest stop string (a token carries at least a quarter of a character: a 4-byte character
# in byte tokens), plus a margin for tokens that decode to nothing (special tokens).
STOP_WINDOW_TOKENS_PER_CHAR = 4
STOP_WINDOW_MARGIN = 8


def stop_window(stops: Sequence[str]) -> int:
    """Tokens a stop-string check decodes."""
    return STOP_WINDOW_TOKENS_PER_CHAR * max(map(len, stops)) + STOP_WINDOW_MARGIN


def _window(seq: SequenceState) -> list[int]:
    """The tokens a stop-string check decodes: the newest `stop_window` of the text's."""
    return seq.tokens_for_text()[-stop_window(seq.params.stop) :]


def _has_stop(seq: SequenceState, text: str) -> bool:
    return any(stop in text for stop in seq.params.stop)


class Delivery:
    def __init__(self, detokenizer: Engine, stats: Statistics) -> None:
        self._engine = detokenizer
        self._stats = stats
        self._filter = StopFilter(detokenizer)
        self._finishing: set[asyncio.Task[None]] = set()

    async def text(self, seq: SequenceState) -> str | None:
        """The text of `seq`'s generated tokens; None once `seq` failed because the server
        could not detokenize them."""
        return await self._decode(seq, seq.tokens_for_text())

    async def check_stop_strings(self, sequences: list[SequenceState]) -> None:
        """Finish each sequence whose newest token completed a stop string, its text cut before it.

        Called after every token, so it decodes only the last `stop_window` tokens (constant
        work per token, not the whole text each time: a 4k-token completion would otherwise
        send 8M token ids to the detokenizer). A window that shows a stop string is confirmed,
        and cut, on the whole text: a window's first characters can differ from the whole
        text's (a character split across its edge), never its last ones.
        """
        windows = [_window(seq) for seq in sequences]
        # Most windows cannot hold a stop string, and their tokens' own texts show it
        # (coordinator/stop_filter.py): only the others are decoded.
        needed = await self._filter.needed(windows, [seq.params.stop for seq in sequences])
        sequences = [seq for seq, need in zip(sequences, needed) if need]
        windows = [window for window, need in zip(windows, needed) if need]
        self._stats.stop_checks += len(needed)
        self._stats.stop_checks_decoded += len(sequences)
        texts = await self._texts(sequences, windows)
        self._filter.observe(windows, texts)
        hits = [seq for seq, text in zip(sequences, texts) if text is not None and _has_stop(seq, text)]
        for seq, text in zip(hits, await self._texts(hits, [seq.tokens_for_text() for seq in hits])):
            if text is not None and _has_stop(seq, text):
                seq.check_stop_strings(text)

    def unsettled(self, sequences: list[SequenceState]) -> list[bool]:
        """Per sequence: whether its newest token's stop-string check needs `check_stop_strings`
        (a request); the others' checks are settled here, synchronously, by the pre-filter."""
        unsettled = [not self._filter.settled(_window(seq), seq.params.stop) for seq in sequences]
        self._stats.stop_checks += unsettled.count(False)
        return unsettled

    async def _texts(self, sequences: list[SequenceState], tokens: list[list[int]]) -> list[str | None]:
        texts = await asyncio.gather(
            *(self._decode(seq, ids) for seq, ids in zip(sequences, tokens)), return_exceptions=True
        )
        for text in texts:
            if isinstance(text, BaseException):
                raise text
        return texts  # type: ignore[return-value]

    async def _decode(self, seq: SequenceState, token_ids: list[int]) -> str | None:
        try:
            return await self._engine.detokenize(token_ids)
        except DualVLLMError as err:
            seq.fail(f"{self._engine.name} server, detokenize: {err}")
            return None

    def retire(self, seq: SequenceState) -> None:
        """Hand a finished sequence to its caller, detokenizing first if its text is not known."""
        if seq.text is not None or seq.error is not None:
            self.deliver(seq, text=seq.text or "")
            return
        task = asyncio.create_task(self._detokenize_and_deliver(seq))
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)

    async def _detokenize_and_deliver(self, seq: SequenceState) -> None:
        text = await self.text(seq)
        if text is not None and seq.params.stop:
            # Its last token was not checked (lockstep ends a stream as that token is decided):
            # a stop string it completed cuts the text as per-token mode's check would have.
            seq.check_stop_strings(text)
            text = seq.text
        self.deliver(seq, text=text or "")

    def deliver(self, seq: SequenceState, *, text: str) -> None:
        seq.text = text
        self._stats.sequences_finished += 1
        if seq.error is not None:
            self._stats.sequences_failed += 1
        seq.sink.put_nowait(seq.output())

    async def aclose(self) -> None:
        """Wait for the outputs still being detokenized."""
        if self._finishing:
            await asyncio.gather(*self._finishing, return_exceptions=True)
