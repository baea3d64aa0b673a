"""The text of single tokens, for logprobs: asked of the base's tokenizer once per id, then kept.

A vocabulary is bounded (~150k ids), so the cache is too; ids are asked for concurrently,
at most MAX_CONCURRENT_DETOKENIZE at a time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from dualvllm.coordinator.core import DualVLLMCoordinator

# Detokenize requests in flight at once while filling the cache.
MAX_CONCURRENT_DETOKENIZE = 16


class TokenTexts:
    def __init__(self, coordinator: DualVLLMCoordinator) -> None:
        self._coordinator = coordinator
        self._texts: dict[int, str] = {}
        self._limit = asyncio.Semaphore(MAX_CONCURRENT_DETOKENIZE)

    async def get(self, ids: Iterable[int]) -> dict[int, str]:
        """{id: text} for every id in `ids`."""
        wanted = set(ids)
        missing = sorted(wanted - self._texts.keys())
        texts = await asyncio.gather(*(self._one(i) for i in missing))
        self._texts.update(zip(missing, texts))
        return {i: self._texts[i] for i in wanted}

    async def _one(self, token_id: int) -> str:
        async with self._limit:
            return await self._coordinator.detokenize([token_id])
