"""An in-process engine: a Hugging Face causal LM run with transformers, no server.

It implements `dualvllm.engines.protocol.SpeculativeEngine`, so the coordinator runs on it unchanged (the
fallback where vLLM cannot be installed), and it can return the FULL next-token
distribution (`next_token_logprobs`), which makes it the ground truth for measuring
what the top-k approximation costs.

The forward passes and the KV cache kept across steps are `engine.scorer`
(dualvllm.engines.kv_scorer.CachedScorer): a context whose prefix the last call scored runs one token.

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
import inspect
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from collections.abc import AsyncIterator, Callable, Mapping, Sequence

import numpy as np

from dualvllm.common.errors import InvalidInputError, LifecycleError
from dualvllm.engines.chat import render_chat
from dualvllm.engines.kv_scorer import CachedScorer
from dualvllm.engines.protocol import PAD_TOKEN_ID, Draft, ModelInfo, TopKBatch, score_by_prefixes

if TYPE_CHECKING:
    import torch

# topk_logprobs' chunk of rows, 4 MB of float32: glibc maps every allocation above 32 MB afresh
# (page faults on each step), smaller ones are reused.
LOGITS_PER_PASS = 1 << 20
TOPK_BLOCK = 64  # columns per block in _topk's first pass (64 to 256 ran alike at vocabulary 151,936)
T = TypeVar("T")


class TransformersEngine:
    """A causal LM in this process; implements `dualvllm.engines.protocol.Engine`.

    `device`: auto (the first GPU when torch sees one, else the CPU), cpu, cuda or cuda:N; the
    engines of `--engine transformers` take the learner's (dualvllm.training.inprocess).
    """

    def __init__(
        self,
        model: str | Path,
        *,
        name: str = "model",
        device: str = "auto",
        dtype: str = "float32",
        kv_cache: bool = True,
        max_model_len: int | None = None,
    ) -> None:
        self.model_path = str(model)
        self.name = name
        self._device_choice = device
        self._dtype_name = dtype
        self._kv_cache = kv_cache
        self._max_model_len = max_model_len
        self._model: Any = None
        self._tokenizer: Any = None
        self.scorer: CachedScorer | None = None  # the forward passes and their KV cache, once entered
        self._lock = asyncio.Lock()  # one forward pass at a time: the model and cache are shared
        self._state = "new"

    @classmethod
    def live(
        cls, model: Any, tokenizer: Any, *, name: str = "model", kv_cache: bool = True, max_model_len: int | None = None
    ) -> TransformersEngine:
        """An engine over a model object this process trains: it samples from the weights as they
        are (no copy, no push). Wrap every update in `updating()`."""
        engine = cls(
            getattr(model, "name_or_path", "") or "live", name=name, kv_cache=kv_cache, max_model_len=max_model_len
        )
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
                if self.scorer is not None:
                    self.scorer.forget()

    async def __aexit__(self, *exc_info: object) -> None:
        self._model = self._tokenizer = self.scorer = None
        self._state = "closed"

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if self._model is None:  # not a live model (that one is used where it is)
            if not Path(self.model_path).exists():
                raise InvalidInputError(f"{self.name} model directory {self.model_path} does not exist")
            device = engine_device(self._device_choice, self.name)
            dtype = getattr(torch, self._dtype_name, None)
            if not isinstance(dtype, torch.dtype):
                raise InvalidInputError(f"unknown dtype {self._dtype_name!r}; use float32, bfloat16 or float16")
            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            # Typed as the Module it is: transformers wraps its `to` with functools.wraps, which mypy does not
            # bind to the instance (the wrapper expects the model as its first argument).
            model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype)
            self._model = model.to(device).eval()
        last_logits_only = (
            {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(self._model.forward).parameters else {}
        )
        self.scorer = CachedScorer(
            self._model,
            kv_cache=self._kv_cache,
            vocab=int(self._model.config.vocab_size),
            forward_options=last_logits_only,
        )

    # -- Engine protocol -------------------------------------------------------------

    async def health(self) -> None:
        self._require_open()

    async def model_info(self) -> ModelInfo:
        self._require_open()
        limit = self._max_model_len or int(getattr(self._model.config, "max_position_embeddings", 0) or 0)
        return ModelInfo(
            name=self.model_path,
            root=self.model_path,
            max_model_len=limit,
            vocab_size=int(self._model.config.vocab_size),
        )

    async def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        self._require_open()
        return list(self._tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    async def tokenize_chat(
        self, messages: Sequence[Mapping[str, Any]], template_kwargs: Mapping[str, Any] | None = None
    ) -> list[int]:
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

    async def next_token_topk(
        self, contexts: Sequence[Sequence[int]], k: int, keys: Sequence[int] | None = None
    ) -> TopKBatch:
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
        scorer = self.scorer
        assert scorer is not None, "set when entered"
        async with self._lock:
            scorer.phase_seconds["contexts"] += time.perf_counter() - started
            return await asyncio.to_thread(scorer.score, snapshot, reduce)

    retries = 0  # in process: nothing to retry (dualvllm.engines.protocol.RequestCounting)
    failures = 0

    @property
    def requests(self) -> int:
        """Batched scoring calls (the coordinator's statistics add every engine's)."""
        return self.scorer.requests if self.scorer is not None else 0

    # -- speculative rounds (dualvllm.engines.protocol.SpeculativeEngine) ------------------------

    async def draft(self, context: Sequence[int], *, max_tokens: int, k: int, temperature: float, seed: int) -> Draft:
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
        return Draft(
            token_ids=np.asarray(sequence[len(context) :], dtype=np.int64),
            topk=TopKBatch(
                token_ids=np.concatenate([r.token_ids for r in rows]),
                logprobs=np.concatenate([r.logprobs for r in rows]),
            ),
        )

    async def draft_argmax(self, contexts: Sequence[Sequence[int]], *, max_tokens: int, k: int) -> list[Draft]:
        """The argmax continuation after every context (one draft at a time: the forward
        passes are serialized anyway)."""
        return [await self.draft(c, max_tokens=max_tokens, k=k, temperature=0.0, seed=0) for c in contexts]

    async def score_continuations(
        self, contexts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]], k: int
    ) -> list[TopKBatch]:
        """The top-k before every continuation token: all prefixes scored in one batched call."""
        return await score_by_prefixes(self, contexts, continuations, k)

    def _require_open(self) -> None:
        if self._state != "open" or self._model is None:
            raise LifecycleError(f"{self.name} engine is not open; use `async with TransformersEngine(...)`")


def engine_device(choice: str, name: str) -> torch.device:
    """The engine's device from its `device` option: auto, cpu, cuda or cuda:N."""
    import torch

    cuda = torch.cuda.is_available()
    if choice == "auto":
        return torch.device("cuda" if cuda else "cpu")
    try:
        device = torch.device(choice)
    except RuntimeError as err:
        raise InvalidInputError(f"{name} engine: device {choice!r} is not auto, cpu, cuda or cuda:N") from err
    if device.type == "cuda" and not cuda:
        raise InvalidInputError(f"{name} engine asked for device {choice!r} but torch sees no GPU")
    if device.type not in ("cpu", "cuda"):
        raise InvalidInputError(f"{name} engine: device {choice!r} is not auto, cpu, cuda or cuda:N")
    return device


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
        chunk = logits[start : start + rows]
        values[start : start + rows], ids[start : start + rows] = _topk(chunk, width)
        totals[start : start + rows] = (chunk - values[start : start + rows, :1]).exp_().sum(dim=-1, keepdim=True)
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
    maxima = logits[:, : blocks * TOPK_BLOCK].view(rows, blocks, TOPK_BLOCK).amax(dim=-1)  # [R, blocks]
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
