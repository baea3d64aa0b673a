"""Finishing sequences: stop strings, the final text, and handing outputs to their callers.

Shared by every scheduler (per-token, speculative, lockstep): the text of generated
tokens comes from the base engine's detokenizer, so a stop string is found the same way
in every mode.
"""

from __future__ import annotations

import asyncio

from common.errors import DualVLLMError
from coordinator.sequence import SequenceState
from coordinator.stats import Statistics
from engines.protocol import Engine


class Delivery:
    def __init__(self, detokenizer: Engine, stats: Statistics) -> None:
        self._engine = detokenizer
        self._stats = stats
        self._finishing: set[asyncio.Task[None]] = set()

    async def text(self, seq: SequenceState) -> str | None:
        """The text of `seq`'s generated tokens; None once `seq` failed because the server
        could not detokenize them."""
        try:
            return await self._engine.detokenize(seq.tokens_for_text())
        except DualVLLMError as err:
            seq.fail(f"{self._engine.name} server, detokenize: {err}")
            return None

    async def check_stop_strings(self, sequences: list[SequenceState]) -> None:
        """Cut each sequence's text at its earliest stop string, finishing it if one occurred."""
        texts = await asyncio.gather(*(self.text(s) for s in sequences), return_exceptions=True)
        for seq, text in zip(sequences, texts):
            if isinstance(text, BaseException):
                raise text
            if text is not None:
                seq.check_stop_strings(text)

    def retire(self, seq: SequenceState) -> None:
        """Hand a finished sequence to its caller, detokenizing first if its text is not known."""
        if seq.text is not None or seq.error is not None:
            self.deliver(seq, text=seq.text or "")
            return
        task = asyncio.create_task(self._detokenize_and_deliver(seq))
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)

    async def _detokenize_and_deliver(self, seq: SequenceState) -> None:
        self.deliver(seq, text=await self.text(seq) or "")

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
