"""An in-process engine: a Hugging Face causal LM run with transformers, no server.

It implements `engines.protocol.SpeculativeEngine`, so the coordinator runs on it unchanged (the
fallback where vLLM cannot be installed), and it can return the FULL next-token
distribution (`next_token_logprobs`), which makes it the ground truth for measuring
what the top-k approximation costs.

KV cache across steps: the coordinator extends every active context by one token per
step, so after each call the engine keeps the key/value states of exactly the contexts
it just scored. A context whose prefix (all but its last token) is cached runs one
token; any other context is prefilled. Rows of different lengths are batched by left
padding with an attention mask. torch and transformers are imported only when the
engine is entered, so importing `engines` stays light.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Literal, Mapping, Sequence

import numpy as np

from common.errors import InvalidInputError, LifecycleError
from engines.chat import render_chat
from engines.protocol import PAD_TOKEN_ID, Draft, ModelInfo, TopKBatch, score_by_prefixes

if TYPE_CHECKING:
    import torch

Device = Literal["auto", "cpu", "cuda"]
RowCache = tuple[tuple["torch.Tensor", "torch.Tensor"], ...]  # per layer (keys, values) [H, L, D]


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
        self._cache: dict[tuple[int, ...], RowCache] = {}
        self._lock = asyncio.Lock()  # one forward pass at a time: the model and cache are shared
        self._state = "new"
        self.requests = 0  # batched scoring calls
        self.tokens_prefilled = 0  # context tokens run without a cache hit
        self.cache_hits = 0  # rows that ran one token on cached keys/values

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
                self._cache.clear()

    async def __aexit__(self, *exc_info: object) -> None:
        self._model = self._tokenizer = None
        self._cache.clear()
        self._state = "closed"

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if self._model is not None:  # a live model: use it where it is
            self._torch = torch
            self._device = next(self._model.parameters()).device
            return
        if not Path(self.model_path).exists():
            raise InvalidInputError(f"{self.name} model directory {self.model_path} does not exist")
        cuda = torch.cuda.is_available()
        if self._device_choice == "cuda" and not cuda:
            raise InvalidInputError(f"{self.name} engine asked for device 'cuda' but torch sees no GPU")
        self._device = torch.device("cuda" if self._device_choice == "cuda" or
                                    (self._device_choice == "auto" and cuda) else "cpu")
        dtype = getattr(torch, self._dtype_name, None)
        if not isinstance(dtype, torch.dtype):
            raise InvalidInputError(f"unknown dtype {self._dtype_name!r}; use float32, bfloat16 or float16")
        self._torch = torch
        self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self._model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype).to(self._device).eval()

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

    async def tokenize_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        self._require_open()
        return render_chat(self._tokenizer, messages, self.name)

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
        """The k most likely next tokens per context (all of them when k >= vocabulary)."""
        logprobs = await self.next_token_logprobs(contexts)  # [B, V]
        width = min(k, logprobs.shape[1])
        top = np.argpartition(-logprobs, width - 1, axis=1)[:, :width]  # [B, width], unordered
        top_logprobs = np.take_along_axis(logprobs, top, axis=1)
        order = np.argsort(-top_logprobs, axis=1, kind="stable")
        token_ids = np.take_along_axis(top, order, axis=1).astype(np.int64)
        assert (token_ids != PAD_TOKEN_ID).all()
        return TopKBatch(token_ids=token_ids, logprobs=np.take_along_axis(top_logprobs, order, axis=1))

    async def next_token_logprobs(self, contexts: Sequence[Sequence[int]]) -> np.ndarray:
        """The full next-token log-distribution after each context -> float64 [B, vocab]."""
        self._require_open()
        if not contexts or any(len(c) == 0 for c in contexts):
            raise InvalidInputError(f"{self.name} engine needs at least one non-empty context")
        async with self._lock:
            return await asyncio.to_thread(self._score, [tuple(int(t) for t in c) for c in contexts])

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

    def _score(self, contexts: list[tuple[int, ...]]) -> np.ndarray:
        torch = self._torch
        self.requests += 1
        cached = [i for i, c in enumerate(contexts) if self._kv_cache and c[:-1] in self._cache]
        fresh = [i for i in range(len(contexts)) if i not in set(cached)]
        vocab = self._model.config.vocab_size
        out = np.empty((len(contexts), vocab), dtype=np.float64)
        new_cache: dict[tuple[int, ...], RowCache] = {}
        with torch.inference_mode():
            for rows, run in ((cached, self._extend), (fresh, self._prefill)):
                if rows:
                    logits, caches = run([contexts[i] for i in rows])
                    out[rows] = torch.log_softmax(logits.double(), dim=-1)[:, :vocab].cpu().numpy()
                    if self._kv_cache:
                        new_cache.update(zip((contexts[i] for i in rows), caches))
        self.cache_hits += len(cached)
        # Keep only what the next step can extend: the contexts just scored.
        self._cache = new_cache
        return out

    def _prefill(self, contexts: list[tuple[int, ...]]) -> tuple[torch.Tensor, list[RowCache]]:
        """Run whole contexts, left-padded into one batch -> last-position logits [B, V], row caches."""
        torch = self._torch
        lengths = [len(c) for c in contexts]
        width = max(lengths)
        self.tokens_prefilled += sum(lengths)
        ids = torch.zeros((len(contexts), width), dtype=torch.long)
        mask = torch.zeros((len(contexts), width), dtype=torch.long)
        for row, context in enumerate(contexts):
            ids[row, width - len(context):] = torch.tensor(context)
            mask[row, width - len(context):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        result = self._model(input_ids=ids.to(self._device), attention_mask=mask.to(self._device),
                             position_ids=positions.to(self._device), use_cache=self._kv_cache)
        caches = self._split_cache(result.past_key_values, lengths, width) if self._kv_cache else []
        return result.logits[:, -1], caches

    def _extend(self, contexts: list[tuple[int, ...]]) -> tuple[torch.Tensor, list[RowCache]]:
        """Run each context's last token on its cached prefix -> logits [B, V], row caches."""
        from transformers import DynamicCache

        torch = self._torch
        pasts = [self._cache[c[:-1]] for c in contexts]
        past_lengths = [len(c) - 1 for c in contexts]
        width = max(past_lengths)
        layers = []
        for layer in range(len(pasts[0])):
            keys, values = (torch.stack([_left_pad(torch, p[layer][j], width) for p in pasts])
                            for j in (0, 1))  # [B, H, width, D]
            layers.append((keys, values))
        mask = torch.zeros((len(contexts), width + 1), dtype=torch.long)
        for row, length in enumerate(past_lengths):
            mask[row, width - length:] = 1
        ids = torch.tensor([[c[-1]] for c in contexts])
        positions = torch.tensor([[length] for length in past_lengths])
        result = self._model(input_ids=ids.to(self._device), attention_mask=mask.to(self._device),
                             position_ids=positions.to(self._device),
                             past_key_values=DynamicCache(ddp_cache_data=layers), use_cache=True)
        caches = self._split_cache(result.past_key_values, [n + 1 for n in past_lengths], width + 1)
        return result.logits[:, -1], caches

    @staticmethod
    def _split_cache(cache: Any, lengths: list[int], width: int) -> list[RowCache]:
        """Per-row (keys, values) per layer with the left padding cut off."""
        layers = [(entry[0], entry[1]) for entry in cache]  # [B, H, width, D] each
        return [tuple((keys[row, :, width - n:], values[row, :, width - n:]) for keys, values in layers)
                for row, n in enumerate(lengths)]

    def _require_open(self) -> None:
        if self._state != "open" or self._model is None:
            raise LifecycleError(f"{self.name} engine is not open; use `async with TransformersEngine(...)`")


def _left_pad(torch: Any, states: torch.Tensor, width: int) -> torch.Tensor:
    """[H, L, D] -> [H, width, D] with zeros before the real positions (they are masked out)."""
    missing = width - states.shape[1]
    if missing == 0:
        return states
    return torch.cat([states.new_zeros((states.shape[0], missing, states.shape[2])), states], dim=1)
