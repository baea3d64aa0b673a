"""The in-process engine's forward passes, with the keys and values of the last call kept.

`CachedScorer.score` runs a Hugging Face causal LM over a batch of contexts and reduces the
last position's logits. The coordinator extends every active context by one token per step,
so after each call the keys and values of exactly the contexts just scored are kept as one
batch (`_Batch`: rows of different lengths left-padded, with an attention mask). A context
whose prefix (all but its last token) is cached runs one token; any other is prefilled. When
the same contexts come back one token longer in the same order, the batch's cache is
extended in place; otherwise the rows that continue are gathered and the prefilled ones
merged in, once, on that step. A context is matched to its row by length and last token and
confirmed by one equality check, not by hashing whole contexts.

torch and transformers are imported when a scorer is made (an engine is entered), so that
importing `engines` stays light.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import TYPE_CHECKING, Any, TypeVar
from collections.abc import Callable, Iterator

if TYPE_CHECKING:
    import torch

PHASES = ("contexts", "kv", "forward", "vocab")  # the parts of a scoring call `phase_seconds` adds up
T = TypeVar("T")


class CachedScorer:
    """Scores contexts with `model` (on its device), keeping the last call's keys and values when `kv_cache`."""

    def __init__(self, model: Any, *, kv_cache: bool, vocab: int, forward_options: dict[str, int]) -> None:
        self._model = model
        self._kv_cache = kv_cache
        self._vocab = vocab  # logits past the config's vocabulary (padding columns) are cut off
        self._last_logits_only = forward_options  # logits_to_keep=1 where the model takes it
        self._device = next(model.parameters()).device
        self._batch: _Batch | None = None  # the contexts the last call scored, with their keys and values
        self.requests = 0  # batched scoring calls
        self.tokens_prefilled = 0  # context tokens run without a cache hit
        self.cache_hits = 0  # rows that ran one token on cached keys/values
        # Seconds spent, over all calls, matching contexts to the cache, gathering and merging
        # keys/values and masks, in the model's forward passes, and reducing logits to the answer.
        self.phase_seconds = dict.fromkeys(PHASES, 0.0)

    def forget(self) -> None:
        """Drop the kept keys and values (the weights changed, or the engine closes)."""
        self._batch = None

    def score(self, contexts: list[tuple[int, ...]], reduce: Callable[[torch.Tensor], T]) -> T:
        """`reduce` of the last-position logits [B, V] after every context. The batch of the
        previous call is taken out first: a pass that fails midway leaves no half-extended
        cache behind."""
        import torch

        self.requests += 1
        previous, self._batch = self._batch, None
        with self._timed("contexts"):
            rows = [previous.row_of(c) for c in contexts] if previous is not None else [None] * len(contexts)
        cached = [i for i, row in enumerate(rows) if row is not None]
        fresh = [i for i, row in enumerate(rows) if row is None]
        parts: list[tuple[list[int], torch.Tensor, _Batch | None]] = []
        with torch.inference_mode():
            if cached:
                assert previous is not None
                cached_rows = [row for row in rows if row is not None]  # in the order of `cached`
                extended = self._extend(previous, cached_rows, [contexts[i] for i in cached])
                parts.append((cached, *extended))
            if fresh:
                parts.append((fresh, *self._prefill([contexts[i] for i in fresh])))
            with self._timed("kv"):
                logits, batch = _combine(parts, contexts)
            with self._timed("vocab"):
                out = reduce(logits)
        self.cache_hits += len(cached)
        # Keep only what the next step can extend: the contexts just scored.
        self._batch = batch if self._kv_cache else None
        return out

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, past: Any = None) -> Any:
        """The model over ids [B, n] after `past` (None: nothing), keeping the last position's logits."""
        with self._timed("forward"):
            return self._model(
                input_ids=ids.to(self._device),
                attention_mask=mask.to(self._device),
                position_ids=positions.to(self._device),
                past_key_values=past,
                use_cache=self._kv_cache,
                **self._last_logits_only,
            )

    def _prefill(self, contexts: list[tuple[int, ...]]) -> tuple[torch.Tensor, _Batch | None]:
        """Run whole contexts, left-padded into one batch -> last-position logits [B, V], their batch."""
        import torch

        with self._timed("kv"):
            lengths = [len(c) for c in contexts]
            width = max(lengths)
            self.tokens_prefilled += sum(lengths)
            ids = torch.zeros((len(contexts), width), dtype=torch.long)
            mask = torch.zeros((len(contexts), width), dtype=torch.long)
            for row, context in enumerate(contexts):
                ids[row, width - len(context) :] = torch.tensor(context)
                mask[row, width - len(context) :] = 1
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
        result = self._forward(ids, mask, positions, _growing_cache([]) if self._kv_cache else None)
        batch = _Batch(contexts, result.past_key_values, mask.to(self._device)) if self._kv_cache else None
        return result.logits[:, -1, : self._vocab], batch

    def _extend(
        self, previous: _Batch, rows: list[int], contexts: list[tuple[int, ...]]
    ) -> tuple[torch.Tensor, _Batch]:
        """Run each context's last token on row `rows[i]` of `previous` (its prefix) -> logits [B, V],
        their batch. When every row continues in order, the cache is extended in place."""
        import torch

        with self._timed("kv"):
            batch = previous if rows == list(range(len(previous.contexts))) else previous.select(rows)
            mask = torch.cat([batch.mask, batch.mask.new_ones((len(rows), 1))], dim=1)  # [B, width + 1]
            ids = torch.tensor([[c[-1]] for c in contexts])
            positions = torch.tensor([[len(c) - 1] for c in contexts])
        result = self._forward(ids, mask, positions, batch.cache)
        return result.logits[:, -1, : self._vocab], _Batch(contexts, result.past_key_values, mask)

    @contextlib.contextmanager
    def _timed(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.phase_seconds[phase] += time.perf_counter() - started


class _Batch:
    """The keys and values of the contexts one call scored: row i holds contexts[i], left-padded
    to a common width (mask 0 on the padding).

    `row_of` finds the row holding a context's prefix without hashing whole contexts: rows are
    indexed by (length, last token) and a candidate is confirmed by one equality check.
    """

    def __init__(self, contexts: list[tuple[int, ...]], cache: Any, mask: torch.Tensor) -> None:
        self.contexts = contexts
        self.cache = cache  # a _growing_cache: per layer keys and values [B, H, width, D]
        self.mask = mask  # long [B, width]
        self._rows: dict[tuple[int, int], list[int]] = {}
        for row, context in enumerate(contexts):
            self._rows.setdefault((len(context), context[-1]), []).append(row)

    @property
    def width(self) -> int:
        return self.mask.shape[1]

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer.keys, layer.values) for layer in self.cache.layers]

    def row_of(self, context: tuple[int, ...]) -> int | None:
        """The row holding context[:-1], if any."""
        if len(context) < 2:
            return None
        for row in self._rows.get((len(context) - 1, context[-2]), ()):
            if self.contexts[row] == context[:-1]:
                return row
        return None

    def select(self, rows: list[int]) -> _Batch:
        """These rows, in this order (repeats allowed), without the columns that are padding in all."""
        import torch

        contexts = [self.contexts[row] for row in rows]
        cut = self.width - max(len(c) for c in contexts)
        index = torch.tensor(rows, device=self.mask.device)
        layers = [(keys[index, :, cut:], values[index, :, cut:]) for keys, values in self.layers()]
        return _Batch(contexts, _growing_cache(layers), self.mask[index, cut:])


def _combine(
    parts: list[tuple[list[int], torch.Tensor, _Batch | None]], contexts: list[tuple[int, ...]]
) -> tuple[torch.Tensor, _Batch | None]:
    """The logits [B, V] and the batch of every context, in the callers' order, from parts that
    each hold some of them (`indices` into `contexts`). One part is already in order (the
    common step); two are merged once, so that the next step finds its rows in order."""
    if len(parts) == 1:
        return parts[0][1], parts[0][2]
    import torch

    size = len(contexts)
    logits = parts[0][1].new_empty((size, parts[0][1].shape[1]))
    for indices, part_logits, _ in parts:
        logits[indices] = part_logits
    batches: list[tuple[torch.Tensor, _Batch]] = []
    for indices, _, batch in parts:
        assert batch is not None, "two parts mean cached rows, so a KV cache is kept"
        batches.append((torch.tensor(indices, device=logits.device), batch))
    width = max(batch.width for _, batch in batches)

    def scattered(layer: int, j: int) -> torch.Tensor:  # the layer's keys (j = 0) or values (1)
        return _scatter_rows([(index, batch.layers()[layer][j]) for index, batch in batches], size, width, axis=2)

    layers = [(scattered(layer, 0), scattered(layer, 1)) for layer in range(len(batches[0][1].layers()))]
    mask = _scatter_rows([(index, batch.mask) for index, batch in batches], size, width, axis=1)
    return logits, _Batch(list(contexts), _growing_cache(layers), mask)


def _scatter_rows(parts: list[tuple[torch.Tensor, torch.Tensor]], size: int, width: int, axis: int) -> torch.Tensor:
    """Each part's rows put at its row `index` of a zero tensor `size` rows deep and `width` wide
    on `axis`, right-aligned there (the padding is on the left)."""
    like = parts[0][1]
    shape = list(like.shape)
    shape[0], shape[axis] = size, width
    out = like.new_zeros(shape)
    for index, part in parts:
        out.narrow(axis, width - part.shape[axis], part.shape[axis]).index_copy_(0, index, part)
    return out


def _growing_cache(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """A transformers cache of `_growing_layer`s, holding these keys and values [B, H, L, D] per layer."""
    from transformers.cache_utils import Cache

    cache = Cache(layer_class_to_replicate=_growing_layer())
    for index, (keys, values) in enumerate(layers):
        cache.update(keys, values, index)
    return cache


@functools.cache
def _growing_layer() -> type:
    """transformers' DynamicLayer, appending in place (defined on first use: transformers is
    imported only when an engine is entered)."""
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        """DynamicLayer.update appends a position by concatenating, a copy of the whole cache
        on every step: O(context) per token, and at the benchmark's width several times the
        attention over it (benchmarks/README.md, "In-process engine at a real vocabulary").
        This layer keeps keys and values in buffers with room to spare, doubled when full, so
        appending writes one position; `keys` and `values` are views of the filled part.
        Only `update` is used: the engine gathers rows itself (`_Batch.select`)."""

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
                self.filled = 0
                self.buffers: tuple[torch.Tensor, ...] = ()
            end = self.filled + key_states.shape[-2]
            if not self.buffers or end > self.buffers[0].shape[-2]:
                grown = []
                for new, old in zip((key_states, value_states), self.buffers or (None, None)):
                    buffer = new.new_empty((*new.shape[:-2], 2 * end, new.shape[-1]))  # [B, H, room, D]
                    if old is not None:
                        buffer[..., : self.filled, :] = old[..., : self.filled, :]
                    grown.append(buffer)
                self.buffers = tuple(grown)
            for buffer, new in zip(self.buffers, (key_states, value_states)):
                buffer[..., self.filled : end, :] = new
            self.filled = end
            self.keys, self.values = (buffer[..., :end, :] for buffer in self.buffers)
            return self.keys, self.values

    return GrowingLayer
