"""An in-process engine: a Hugging Face causal LM run with transformers, no server.

It implements `engines.protocol.SpeculativeEngine`, so the coordinator runs on it unchanged (the
fallback where vLLM cannot be installed), and it can return the FULL next-token
distribution (`next_token_logprobs`), which makes it the ground truth for measuring
what the top-k approximation costs.

KV cache across steps: the coordinator extends every active context by one token per
step, so after each call the engine keeps the key/value states of exactly the contexts
it just scored, as one batch (rows of different lengths left-padded, with an attention
mask). A context whose prefix (all but its last token) is cached runs one token; any
other context is prefilled. When the same contexts come back one token longer in the same
order (the coordinator's per-token steps), the batch's cache is extended in place;
otherwise the rows that continue are gathered and the prefilled ones merged in, once, on
that step. A context is matched to its row by length and last token and confirmed by one
equality check, not by hashing whole contexts.

Cost per token at a large vocabulary: the forward pass keeps only the last position's
logits; `next_token_topk` takes their top k (a max pass, then torch.topk over the
blocks that can hold them) and the normalizer from one float32 pass over the row
(`topk_logprobs`), never a float64 [B, V] array; only
`next_token_logprobs`, the full-distribution reference, builds one. torch and
transformers are imported only when the engine is entered, so importing `engines` stays
light.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence

import numpy as np

from common.errors import InvalidInputError, LifecycleError
from engines.chat import render_chat
from engines.protocol import PAD_TOKEN_ID, Draft, ModelInfo, TopKBatch, score_by_prefixes

if TYPE_CHECKING:
    import torch

Device = Literal["auto", "cpu", "cuda"]
PHASES = ("contexts", "kv", "forward", "vocab")  # the parts of a scoring call `phase_seconds` adds up
# topk_logprobs' chunk of rows, 4 MB of float32: glibc maps every allocation above 32 MB afresh
# (page faults on each step), smaller ones are reused.
LOGITS_PER_PASS = 1 << 20
TOPK_BLOCK = 64  # columns per block in _topk's first pass (64 to 256 ran alike at vocabulary 151,936)
T = TypeVar("T")


class TransformersEngine:
    """A causal LM in this process; implements `engines.protocol.Engine`."""

    def __init__(self, model: str | Path, *, name: str = "model", device: Device = "auto",
                 dtype: str = "float32", kv_cache: bool = True, max_model_len: int | None = None) -> None:
        self.model_path = str(model)
        self.name = name
        self._device_choice = device
        self._dtype_name = dtype
        self._kv_cache = kv_cache
        self._max_model_len = max_model_len
        self._model: Any = None
        self._tokenizer: Any = None
        self._torch: Any = None
        self._device: Any = None
        self._vocab = 0  # logits past the config's vocabulary (padding columns) are cut off
        self._last_logits_only: dict[str, int] = {}  # logits_to_keep=1 where the model takes it
        self._batch: _Batch | None = None  # the contexts the last call scored, with their keys and values
        self._lock = asyncio.Lock()  # one forward pass at a time: the model and cache are shared
        self._state = "new"
        self.requests = 0  # batched scoring calls
        self.tokens_prefilled = 0  # context tokens run without a cache hit
        self.cache_hits = 0  # rows that ran one token on cached keys/values
        # Seconds spent, over all calls, matching contexts to the cache, gathering and merging
        # keys/values and masks, in the model's forward passes, and reducing logits to the answer.
        self.phase_seconds = dict.fromkeys(PHASES, 0.0)

    @classmethod
    def live(cls, model: Any, tokenizer: Any, *, name: str = "model", kv_cache: bool = True,
             max_model_len: int | None = None) -> TransformersEngine:
        """An engine over a model object this process trains: it samples from the weights as they
        are (no copy, no push). Wrap every update in `updating()`."""
        engine = cls(getattr(model, "name_or_path", "") or "live", name=name, kv_cache=kv_cache,
                     max_model_len=max_model_len)
        engine._model, engine._tokenizer = model, tokenizer
        return engine

    async def __aenter__(self) -> TransformersEngine:
        if self._state != "new":
            raise LifecycleError(f"{self.name} engine was already entered; create a new TransformersEngine")
        self._state = "open"
        await asyncio.to_thread(self._load)
        return self

    @contextlib.asynccontextmanager
    async def updating(self) -> AsyncIterator[None]:
        """Hold every forward pass while the caller changes the weights (an optimizer step on a
        `live` engine's model); the cached keys and values, computed with the old weights, are
        dropped after it, as a server's prefix cache is reset after a push."""
        async with self._lock:
            try:
                yield
            finally:
                self._batch = None

    async def __aexit__(self, *exc_info: object) -> None:
        self._model = self._tokenizer = self._batch = None
        self._state = "closed"

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self._torch = torch
        if self._model is None:  # not a live model (that one is used where it is)
            if not Path(self.model_path).exists():
                raise InvalidInputError(f"{self.name} model directory {self.model_path} does not exist")
            cuda = torch.cuda.is_available()
            if self._device_choice == "cuda" and not cuda:
                raise InvalidInputError(f"{self.name} engine asked for device 'cuda' but torch sees no GPU")
            device = torch.device("cuda" if self._device_choice == "cuda" or
                                  (self._device_choice == "auto" and cuda) else "cpu")
            dtype = getattr(torch, self._dtype_name, None)
            if not isinstance(dtype, torch.dtype):
                raise InvalidInputError(f"unknown dtype {self._dtype_name!r}; use float32, bfloat16 or float16")
            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            self._model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype).to(device).eval()
        self._device = next(self._model.parameters()).device
        self._vocab = int(self._model.config.vocab_size)
        if "logits_to_keep" in inspect.signature(self._model.forward).parameters:
            self._last_logits_only = {"logits_to_keep": 1}

    # -- Engine protocol -------------------------------------------------------------

    async def health(self) -> None:
        self._require_open()

    async def model_info(self) -> ModelInfo:
        self._require_open()
        limit = self._max_model_len or int(getattr(self._model.config, "max_position_embeddings", 0) or 0)
        return ModelInfo(name=self.model_path, root=self.model_path, max_model_len=limit,
                         vocab_size=int(self._model.config.vocab_size))

    async def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        self._require_open()
        return list(self._tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    async def tokenize_chat(self, messages: Sequence[Mapping[str, Any]],
                            template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        self._require_open()
        return render_chat(self._tokenizer, messages, self.name, template_kwargs)

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        self._require_open()
        return self._tokenizer.decode(list(token_ids))

    async def eos_token_ids(self) -> frozenset[int]:
        self._require_open()
        ids: set[int] = set()
        for source in (getattr(self._model, "generation_config", None), self._model.config):
            value = getattr(source, "eos_token_id", None)
            ids.update([value] if isinstance(value, int) else (value or []))
        if not ids and self._tokenizer.eos_token_id is not None:
            ids.add(self._tokenizer.eos_token_id)
        return frozenset(ids)

    async def next_token_topk(self, contexts: Sequence[Sequence[int]], k: int,
                              keys: Sequence[int] | None = None) -> TopKBatch:
        """The k most likely next tokens per context (all of them when k >= vocabulary), sorted."""
        token_ids, logprobs = await self._scored(contexts, lambda logits: topk_logprobs(logits, k))
        assert (token_ids != PAD_TOKEN_ID).all()
        return TopKBatch(token_ids=token_ids, logprobs=logprobs)

    async def next_token_logprobs(self, contexts: Sequence[Sequence[int]]) -> np.ndarray:
        """The full next-token log-distribution after each context -> float64 [B, vocab]."""
        return await self._scored(contexts, full_logprobs)

    async def _scored(self, contexts: Sequence[Sequence[int]], reduce: Callable[[torch.Tensor], T]) -> T:
        self._require_open()
        if not contexts or any(len(c) == 0 for c in contexts):
            raise InvalidInputError(f"{self.name} engine needs at least one non-empty context")
        started = time.perf_counter()
        snapshot = [tuple(c) for c in contexts]  # the callers' lists may change while we wait for the lock
        async with self._lock:
            self.phase_seconds["contexts"] += time.perf_counter() - started
            return await asyncio.to_thread(self._score, snapshot, reduce)

    # -- speculative rounds (engines.protocol.SpeculativeEngine) ------------------------

    async def draft(self, context: Sequence[int], *, max_tokens: int, k: int, temperature: float,
                    seed: int) -> Draft:
        """Sample `max_tokens` tokens from the top-k at `temperature` (0 = argmax), seeded."""
        rng = np.random.default_rng(seed)
        sequence, rows = list(context), []
        for _ in range(max_tokens):
            top = await self.next_token_topk([sequence], k)  # one row, sorted by logprob
            if temperature == 0:
                token = int(top.token_ids[0, 0])
            else:
                scaled = top.logprobs[0] / temperature
                token = int(rng.choice(top.token_ids[0], p=np.exp(scaled - np.logaddexp.reduce(scaled))))
            rows.append(top)
            sequence.append(token)
        return Draft(token_ids=np.asarray(sequence[len(context):], dtype=np.int64),
                     topk=TopKBatch(token_ids=np.concatenate([r.token_ids for r in rows]),
                                    logprobs=np.concatenate([r.logprobs for r in rows])))

    async def draft_argmax(self, contexts: Sequence[Sequence[int]], *, max_tokens: int, k: int) -> list[Draft]:
        """The argmax continuation after every context (one draft at a time: the forward
        passes are serialized anyway)."""
        return [await self.draft(c, max_tokens=max_tokens, k=k, temperature=0.0, seed=0) for c in contexts]

    async def score_continuations(self, contexts: Sequence[Sequence[int]],
                                  continuations: Sequence[Sequence[int]], k: int) -> list[TopKBatch]:
        """The top-k before every continuation token: all prefixes scored in one batched call."""
        return await score_by_prefixes(self, contexts, continuations, k)

    # -- the forward passes ----------------------------------------------------------

    def _score(self, contexts: list[tuple[int, ...]], reduce: Callable[[torch.Tensor], T]) -> T:
        """`reduce` of the last-position logits [B, V] after every context. The batch of the
        previous call is taken out first: a pass that fails midway leaves no half-extended
        cache behind."""
        torch = self._torch
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
                extended = self._extend(previous, [rows[i] for i in cached], [contexts[i] for i in cached])
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
            return self._model(input_ids=ids.to(self._device), attention_mask=mask.to(self._device),
                               position_ids=positions.to(self._device), past_key_values=past,
                               use_cache=self._kv_cache, **self._last_logits_only)

    def _prefill(self, contexts: list[tuple[int, ...]]) -> tuple[torch.Tensor, _Batch | None]:
        """Run whole contexts, left-padded into one batch -> last-position logits [B, V], their batch."""
        torch = self._torch
        with self._timed("kv"):
            lengths = [len(c) for c in contexts]
            width = max(lengths)
            self.tokens_prefilled += sum(lengths)
            ids = torch.zeros((len(contexts), width), dtype=torch.long)
            mask = torch.zeros((len(contexts), width), dtype=torch.long)
            for row, context in enumerate(contexts):
                ids[row, width - len(context):] = torch.tensor(context)
                mask[row, width - len(context):] = 1
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
        result = self._forward(ids, mask, positions, _growing_cache([]) if self._kv_cache else None)
        batch = _Batch(contexts, result.past_key_values, mask.to(self._device)) if self._kv_cache else None
        return result.logits[:, -1, :self._vocab], batch

    def _extend(self, previous: _Batch, rows: list[int],
                contexts: list[tuple[int, ...]]) -> tuple[torch.Tensor, _Batch]:
        """Run each context's last token on row `rows[i]` of `previous` (its prefix) -> logits [B, V],
        their batch. When every row continues in order, the cache is extended in place."""
        torch = self._torch
        with self._timed("kv"):
            batch = previous if rows == list(range(len(previous.contexts))) else previous.select(rows)
            mask = torch.cat([batch.mask, batch.mask.new_ones((len(rows), 1))], dim=1)  # [B, width + 1]
            ids = torch.tensor([[c[-1]] for c in contexts])
            positions = torch.tensor([[len(c) - 1] for c in contexts])
        result = self._forward(ids, mask, positions, batch.cache)
        return result.logits[:, -1, :self._vocab], _Batch(contexts, result.past_key_values, mask)

    @contextlib.contextmanager
    def _timed(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.phase_seconds[phase] += time.perf_counter() - started

    def _require_open(self) -> None:
        if self._state != "open" or self._model is None:
            raise LifecycleError(f"{self.name} engine is not open; use `async with TransformersEngine(...)`")


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


def _combine(parts: list[tuple[list[int], torch.Tensor, _Batch | None]],
             contexts: list[tuple[int, ...]]) -> tuple[torch.Tensor, _Batch | None]:
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
    batches = [(torch.tensor(indices, device=logits.device), batch) for indices, _, batch in parts]
    assert all(batch is not None for _, batch in batches), "two parts mean cached rows, so a KV cache is kept"
    width = max(batch.width for _, batch in batches)
    layers = [tuple(_scatter_rows([(index, batch.layers()[layer][j]) for index, batch in batches], size, width, axis=2)
                    for j in (0, 1))
              for layer in range(len(batches[0][1].layers()))]
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

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
                self.filled, self.buffers = 0, ()
            end = self.filled + key_states.shape[-2]
            if not self.buffers or end > self.buffers[0].shape[-2]:
                grown = []
                for new, old in zip((key_states, value_states), self.buffers or (None, None)):
                    buffer = new.new_empty((*new.shape[:-2], 2 * end, new.shape[-1]))  # [B, H, room, D]
                    if old is not None:
                        buffer[..., :self.filled, :] = old[..., :self.filled, :]
                    grown.append(buffer)
                self.buffers = tuple(grown)
            for buffer, new in zip(self.buffers, (key_states, value_states)):
                buffer[..., self.filled:end, :] = new
            self.filled = end
            self.keys, self.values = (buffer[..., :end, :] for buffer in self.buffers)
            return self.keys, self.values

    return GrowingLayer


def topk_logprobs(logits: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The min(k, V) largest logprobs per row, sorted -> (int64 ids [B, w], float64 logprobs [B, w]).

    log p_i = (z_i - m) - log sum_j exp(z_j - m), m = max_j z_j. `_topk` picks the k largest
    logits (m is the first); the sum is one float32 pass over the row; the differences and
    the log are float64. Against a float64 log-softmax of the same logits the error is the
    float32 sum's, ~1e-7 (summing in float64 gives ~3e-9 and costs a float64 copy of every
    row). Rows are taken a few at a time (LOGITS_PER_PASS): the temporaries stay small
    enough to be reused, and each chunk is still in cache for its second pass.
    """
    import torch

    logits = logits.float().contiguous()  # [B, V]
    batch, vocab = logits.shape
    width = min(k, vocab)
    rows = max(1, LOGITS_PER_PASS // vocab)
    values = logits.new_empty((batch, width))
    ids = torch.empty((batch, width), dtype=torch.long, device=logits.device)
    totals = torch.empty((batch, 1), dtype=torch.float64, device=logits.device)  # sum_j exp(z_j - m), in [1, V]
    for start in range(0, batch, rows):
        chunk = logits[start:start + rows]
        values[start:start + rows], ids[start:start + rows] = _topk(chunk, width)
        totals[start:start + rows] = (chunk - values[start:start + rows, :1]).exp_().sum(dim=-1, keepdim=True)
    logprobs = (values.double() - values[:, :1].double()) - totals.log()
    return ids.cpu().numpy(), logprobs.cpu().numpy()


def _topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(logits, k) over rows [R, V] -> (values, ids) [R, k], descending, from a
    fraction of each row.

    The row is cut into blocks of TOPK_BLOCK columns. Each of the k largest logits lies in a
    block whose maximum is at least it, so the k blocks with the largest maxima (plus the
    columns past the last whole block) hold them all: one max pass over the row, then
    torch.topk over k * TOPK_BLOCK candidates. torch.topk over the whole row costs about
    three max passes on CPU.
    """
    import torch

    rows, vocab = logits.shape
    blocks = vocab // TOPK_BLOCK
    if blocks <= k:
        return torch.topk(logits, k, dim=-1)
    maxima = logits[:, :blocks * TOPK_BLOCK].view(rows, blocks, TOPK_BLOCK).amax(dim=-1)  # [R, blocks]
    best = torch.topk(maxima, k, dim=-1).indices  # [R, k]
    columns = (best[:, :, None] * TOPK_BLOCK + torch.arange(TOPK_BLOCK, device=logits.device)).flatten(1)
    tail = torch.arange(blocks * TOPK_BLOCK, vocab, device=logits.device).expand(rows, -1)
    columns = torch.cat([columns, tail], dim=1)  # [R, k * TOPK_BLOCK + vocab % TOPK_BLOCK]
    values, picked = torch.topk(logits.gather(1, columns), k, dim=-1)
    return values, columns.gather(1, picked)


def full_logprobs(logits: torch.Tensor) -> np.ndarray:
    """The whole log-softmax of every row in float64 -> [B, V] (the reference the top-k is checked on)."""
    import torch

    return torch.log_softmax(logits.double(), dim=-1).cpu().numpy()
