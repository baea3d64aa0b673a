"""What the coordinator needs from a model engine, and the data it gets back.

An engine is anything that can score "which token comes next" for a batch of token-id
contexts: the vLLM HTTP client (engines/vllm_client.py) or an in-process transformers
model (engines/transformers_engine.py). The coordinator only ever talks to this Protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable
from collections.abc import Mapping, Sequence

import numpy as np

PAD_TOKEN_ID = -1  # marks padding in TopKBatch.token_ids; real ids are >= 0


@dataclass(frozen=True)
class TopKBatch:
    """Next-token top-k for a batch of contexts, padded to a common width.

    Rows keep the order of the contexts that were asked for. A row may hold fewer than
    k real entries (small vocabularies); the rest is padding.
    """

    token_ids: np.ndarray  # int64 [B, w], PAD_TOKEN_ID in padding
    logprobs: np.ndarray  # float64 [B, w], raw model logprobs (temperature 1), -inf in padding

    def __post_init__(self) -> None:
        assert self.token_ids.shape == self.logprobs.shape, (
            f"token_ids {self.token_ids.shape} and logprobs {self.logprobs.shape} differ"
        )

    @property
    def batch_size(self) -> int:
        return self.token_ids.shape[0]

    @classmethod
    def from_flat(cls, token_ids: np.ndarray, logprobs: np.ndarray, counts: np.ndarray, width: int) -> TopKBatch:
        """Rows given one after another (row i has counts[i] entries), padded to `width`.

        `token_ids`, `logprobs`: [sum(counts)]; `counts`: int64 [B], each <= width. Vectorized:
        the entries are scattered into the padded arrays by a row-length mask.
        """
        filled = np.arange(width) < counts[:, None]  # [B, w]
        padded_ids = np.full(filled.shape, PAD_TOKEN_ID, dtype=np.int64)
        padded_logprobs = np.full(filled.shape, -np.inf, dtype=np.float64)
        padded_ids[filled], padded_logprobs[filled] = token_ids, logprobs
        return cls(token_ids=padded_ids, logprobs=padded_logprobs)

    @classmethod
    def concat(cls, batches: Sequence[TopKBatch]) -> TopKBatch:
        """The rows of several batches, in order, padded to the widest."""
        widths = [b.token_ids.shape[1] for b in batches]
        return cls.from_flat(
            np.concatenate([b.token_ids.ravel() for b in batches]),
            np.concatenate([b.logprobs.ravel() for b in batches]),
            np.repeat(widths, [b.batch_size for b in batches]),
            max(widths),
        )


@dataclass(frozen=True)
class ModelInfo:
    """Identity and limits of the model behind an engine."""

    name: str  # the name requests must carry ("model" field)
    root: str  # where the weights came from (a local path or a hub id)
    max_model_len: int  # prompt + generated tokens the engine accepts
    vocab_size: int | None = None  # output vocabulary, when the engine can tell
    pad_token_id: int | None = None  # the padding token, when the engine can tell


@runtime_checkable
class Engine(Protocol):
    """Next-token top-k logprobs for batches of token-id contexts, plus the tokenizer."""

    name: str  # a short label for messages and statistics, e.g. "theta" or "t"

    async def health(self) -> None:
        """Return if the engine can serve requests; raise a ServerError if not."""
        ...

    async def model_info(self) -> ModelInfo: ...

    async def next_token_topk(
        self, contexts: Sequence[Sequence[int]], k: int, keys: Sequence[int] | None = None
    ) -> TopKBatch:
        """Top-k next-token logprobs after each context, in one batched call. `keys` name the
        contexts' sequences, for engines that route by sequence (engines/pool.py); others ignore them."""
        ...

    async def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    async def tokenize_chat(
        self, messages: Sequence[Mapping[str, Any]], template_kwargs: Mapping[str, Any] | None = None
    ) -> list[int]:
        """A chat ([{"role", "content"}, ...]) rendered with the model's chat template, ending
        with the prompt of the assistant's turn; InvalidInputError if the model has none.
        `template_kwargs`: extra template variables (vLLM's chat_template_kwargs)."""
        ...

    async def detokenize(self, token_ids: Sequence[int]) -> str: ...

    async def eos_token_ids(self) -> frozenset[int]:
        """Ids that end a sequence (empty if the engine cannot tell)."""
        ...


@runtime_checkable
class RequestCounting(Protocol):
    """An engine that counts its server requests (a vLLM server's client): what the
    coordinator's statistics add up."""

    requests: int  # requests sent, retries included
    retries: int
    failures: int  # calls that raised after their retries


@dataclass(frozen=True)
class Draft:
    """Tokens one engine sampled natively, with its top-k before each of them.

    Sampling is restricted to the engine's own top-k at the given temperature, so the
    draft distribution p_D(y) = exp(lp(y)/T) / sum_{z in top-k} exp(lp(z)/T) is known
    exactly from `topk` (what speculative acceptance needs).
    """

    token_ids: np.ndarray  # int64 [n], the sampled (or argmax) continuation
    topk: TopKBatch  # [n, w]: row j is the top-k before token j (raw logprobs)


@runtime_checkable
class SpeculativeEngine(Engine, Protocol):
    """An engine that can also draft several tokens and score continuations in one call each."""

    async def draft(self, context: Sequence[int], *, max_tokens: int, k: int, temperature: float, seed: int) -> Draft:
        """Sample `max_tokens` tokens after `context` from the top-k at `temperature` (0 = greedy).

        EOS does not stop a draft: the caller applies its own stop rules. `seed` makes the
        draft reproducible.
        """
        ...

    async def draft_argmax(self, contexts: Sequence[Sequence[int]], *, max_tokens: int, k: int) -> list[Draft]:
        """Greedy drafts: the argmax continuation of `max_tokens` tokens after every context, in
        one batched call (no seed needed: the draft is a function of the context).

        EOS does not stop a draft.
        """
        ...

    async def score_continuations(
        self, contexts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]], k: int
    ) -> list[TopKBatch]:
        """Top-k before each token of each continuation, in one batched call.

        Row j of answer i is the top-k after contexts[i] + continuations[i][:j] (exactly the
        rows next_token_topk would give for those contexts; the continuation's own tokens
        are not added unless they are in the top-k).
        """
        ...


@runtime_checkable
class PromptScoringEngine(Engine, Protocol):
    """An engine that can also score a given text: the top-k before every token of a prompt."""

    async def prompt_topk(self, prompts: Sequence[Sequence[int]], k: int) -> list[TopKBatch]:
        """Top-k before every token of each prompt but its first, in one batched call.

        Answer i has len(prompts[i]) - 1 rows; row j is the distribution prompts[i][j + 1] was
        drawn from (raw logprobs), and always holds that token's own logprob, as a (k+1)-th
        entry when it is outside the top k.
        """
        ...

    async def prompt_logprobs(self, prompts: Sequence[Sequence[int]], k: int) -> list[list[dict[str, Any] | None]]:
        """vLLM's prompt logprobs of each prompt, in its answer's shape: None, then per position
        {"<id>": {"logprob", "rank", "decoded_token"}}, the top k and the position's token."""
        ...


async def score_by_prefixes(
    engine: Engine, contexts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]], k: int
) -> list[TopKBatch]:
    """SpeculativeEngine.score_continuations as one next_token_topk call over every prefix
    contexts[i] + continuations[i][:j], split back per continuation."""
    prefixes = [list(c) + list(x[:j]) for c, x in zip(contexts, continuations) for j in range(len(x))]
    top = await engine.next_token_topk(prefixes, k)
    bounds = np.cumsum([0, *(len(x) for x in continuations)])
    return [
        TopKBatch(token_ids=top.token_ids[a:b], logprobs=top.logprobs[a:b]) for a, b in zip(bounds[:-1], bounds[1:])
    ]


@runtime_checkable
class WeightTransferServer(Protocol):
    """A server whose weights can be changed in place through vLLM's native weight-transfer
    API (dev mode): what the q* service's dev routes forward to (a vLLM client's `admin`,
    dualvllm.engines.vllm_admin.VLLMAdmin)."""

    name: str
    url: str

    async def pause(self, mode: str = "wait") -> bool: ...

    async def resume(self) -> None: ...

    async def reset_prefix_cache(self, *, reset_running_requests: bool = False) -> None: ...

    async def server_config(self) -> dict[str, Any] | None: ...

    async def weight_version(self) -> str | None: ...

    async def world_size(self, include_dp: bool = True) -> int: ...

    async def init_weight_transfer_engine(self, init_info: dict[str, Any], *, timeout_s: float) -> None: ...

    async def start_weight_update(self, *, timeout_s: float) -> None: ...

    async def update_weights(self, update_info: Any, *, timeout_s: float) -> None: ...

    async def finish_weight_update(self, weight_version: str | None = None, *, timeout_s: float) -> None: ...
