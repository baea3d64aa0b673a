"""Async client for one vLLM OpenAI-compatible server.

The HTTP side (one `aiohttp.ClientSession` per server, opened by `async with` and closed once;
retries, timeouts, the served model) is the client's `transport` (dualvllm.engines.vllm_transport),
which its parts take as well; a client cannot be reused after it closed.

Next-token top-k uses `/v1/completions` with token-id prompts (a list of lists batches
all contexts into one request), `max_tokens: 1`, `temperature: 0` (so the sampled token
is the argmax and already inside the top k) and `return_tokens_as_token_ids: true`
(otherwise distinct ids that decode to the same string collide in the logprobs dict).
Answers are read by the pure functions of dualvllm.engines.vllm_answers, run as each request's
`decode`; the admin routes are `client.admin` (dualvllm.engines.vllm_admin), the tokenizer's
`client.tokens` (dualvllm.engines.vllm_tokens), given prompts' scores `client.scoring`
(dualvllm.engines.vllm_scoring).

Speculative rounds use native generation (`draft`: several tokens sampled from the top-k,
with their top-k per position) and next-token requests (`score_continuations`: one prompt
per prefix context + draft[:j], batched, as per-token mode would send them).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any
from collections.abc import Callable, Mapping, Sequence


from dualvllm.common.errors import ServerError
from dualvllm.engines import vllm_answers as answers
from dualvllm.engines.http import (
    CONNECT_TIMEOUT_S,
    CONNECTION_POOL_SIZE,
    MAX_RETRIES,
    REQUEST_TIMEOUT_S,
    RETRY_DELAY_S,
)
from dualvllm.engines.protocol import Draft, ModelInfo, TopKBatch, score_by_prefixes
from dualvllm.engines.vllm_admin import VLLMAdmin
from dualvllm.engines.vllm_scoring import PromptScorer
from dualvllm.engines.vllm_tokens import ServerTokenizer
from dualvllm.engines.vllm_transport import ServerTransport


class VLLMClient:
    """Talks to one vLLM server; implements `dualvllm.engines.protocol.Engine`."""

    def __init__(
        self,
        url: str,
        *,
        name: str = "server",
        model: str | None = None,
        api_key: str | None = None,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        connection_pool_size: int = CONNECTION_POOL_SIZE,
        max_retries: int = MAX_RETRIES,
        retry_delay_s: float = RETRY_DELAY_S,
        local_tokenizer: bool = False,
    ) -> None:
        self.transport = ServerTransport(
            url,
            name=name,
            model=model,
            api_key=api_key,
            request_timeout_s=request_timeout_s,
            connect_timeout_s=connect_timeout_s,
            connection_pool_size=connection_pool_size,
            max_retries=max_retries,
            retry_delay_s=retry_delay_s,
        )
        self.url, self.name = self.transport.url, name
        self._token_ids = answers.TokenIdCache()
        # Tokenize and detokenize here, with the served model's own tokenizer, instead of
        # over HTTP, with `local_tokenizer`: what a server started with --skip-tokenizer-init needs.
        self.tokens = ServerTokenizer(self.transport, local=local_tokenizer)
        self.admin = VLLMAdmin(self.transport)  # pause, resume, reloads, native weight transfer
        self.scoring = PromptScorer(self.transport)  # given prompts' top-k and logprobs

    async def __aenter__(self) -> VLLMClient:
        self.transport.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.transport.close()

    # -- raw calls -------------------------------------------------------------------

    async def call(self, method: str, path: str, payload: Any = None, **kw: Any) -> Any:
        """One JSON request to `path`, with retries: ServerTransport.call."""
        return await self.transport.call(method, path, payload, **kw)

    async def health(self) -> None:
        """Raise a ServerError unless GET /health answers 200."""
        await self.call("GET", "/health")

    async def wait_healthy(self, timeout_s: float, poll_s: float = 1.0) -> None:
        """Poll GET /health every `poll_s` until it answers 200; after `timeout_s`, raise its last error."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            try:
                return await self.health()
            except ServerError:
                if loop.time() >= deadline:
                    raise
            await asyncio.sleep(poll_s)

    # -- Engine protocol -------------------------------------------------------------

    async def model_info(self) -> ModelInfo:
        return await self.transport.model_info()

    async def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return await self.tokens.tokenize(text, add_special_tokens=add_special_tokens)

    async def tokenize_chat(
        self, messages: Sequence[Mapping[str, Any]], template_kwargs: Mapping[str, Any] | None = None
    ) -> list[int]:
        return await self.tokens.tokenize_chat(messages, template_kwargs)

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        return await self.tokens.detokenize(token_ids)

    async def eos_token_ids(self) -> frozenset[int]:
        return await self.tokens.eos_token_ids()

    async def next_token_topk(
        self, contexts: Sequence[Sequence[int]], k: int, keys: Sequence[int] | None = None
    ) -> TopKBatch:
        info = await self.model_info()
        payload = {
            "model": info.name,
            "prompt": [list(c) for c in contexts],
            "max_tokens": 1,
            "logprobs": k,
            "temperature": 0.0,
            "return_tokens_as_token_ids": True,
        }
        n, ids = len(contexts), self._token_ids
        return await self.transport.completions(
            payload, k, decode=lambda raw: answers.next_token_rows(answers.decode_completion(raw), n, k, ids)
        )

    async def prompt_topk(self, prompts: Sequence[Sequence[int]], k: int) -> list[TopKBatch]:
        return await self.scoring.topk(prompts, k)

    async def prompt_logprobs(self, prompts: Sequence[Sequence[int]], k: int) -> list[list[dict[str, Any] | None]]:
        return await self.scoring.logprobs(prompts, k)

    # -- lockstep (engines/vllm_plugin) ------------------------------------------------

    async def forced_generation(
        self,
        prompt_ids: Sequence[int],
        *,
        max_tokens: int,
        stop_token: int,
        lockstep_args: dict[str, int | str],
        on_accepted: Callable[[], None] | None = None,
    ) -> str:
        """One lockstep request: the server generates whatever its plugin is told, until the
        coordinator ends it (`stop_token`) or `max_tokens`; returns the finish_reason.

        Sent at most once (a resend would be a second request with the same lockstep id)
        unless nothing left; no total timeout, because it lasts as long as its sequence: the
        plugin's own timeout ends it if the coordinator goes silent.

        The answer is streamed, only so that `on_accepted` can be called when the server
        has taken the request in: vLLM starts a streamed answer just before it hands the
        request to its engine, and a plain answer only at the end. `stream_interval` above
        `max_tokens` keeps the stream to its first and last token.
        """
        info = await self.model_info()
        payload = {
            "model": info.name,
            "prompt": list(prompt_ids),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stop_token_ids": [stop_token],
            "vllm_xargs": lockstep_args,
            "stream": True,
            "stream_interval": max_tokens + 1,
        }
        return await self.call(
            "POST",
            "/v1/completions",
            payload,
            decode=answers.streamed_finish_reason,
            idempotent=False,
            on_headers=on_accepted,
            timeout=self.transport.timeout(None),
        )

    # -- speculative rounds (dualvllm.engines.protocol.SpeculativeEngine) ------------------------

    async def draft(self, context: Sequence[int], *, max_tokens: int, k: int, temperature: float, seed: int) -> Draft:
        """Native generation of `max_tokens` tokens sampled from the top-k at `temperature`.

        One request per sequence: vLLM gives every prompt of a batched request the same
        seed, which would draw identical drafts for identical prompts.
        """
        info = await self.model_info()
        payload = {
            "model": info.name,
            "prompt": list(context),
            "max_tokens": max_tokens,
            "logprobs": k,
            "temperature": temperature,
            "seed": seed,
            "ignore_eos": True,
            "return_tokens_as_token_ids": True,
            **answers.neutral_sampling(k),
        }
        ids = self._token_ids
        (draft,) = await self.transport.completions(
            payload, k, decode=lambda raw: answers.drafts(json.loads(raw), 1, k, ids)
        )
        return draft

    async def draft_argmax(self, contexts: Sequence[Sequence[int]], *, max_tokens: int, k: int) -> list[Draft]:
        """One batched request at temperature 0 for every context."""
        info = await self.model_info()
        payload = {
            "model": info.name,
            "prompt": [list(c) for c in contexts],
            "max_tokens": max_tokens,
            "logprobs": k,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_tokens_as_token_ids": True,
        }
        n, ids = len(contexts), self._token_ids
        return await self.transport.completions(
            payload, k, decode=lambda raw: answers.drafts(json.loads(raw), n, k, ids)
        )

    async def score_continuations(
        self, contexts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]], k: int
    ) -> list[TopKBatch]:
        """One batched next-token request over every prefix context + continuation[:j].

        Not `prompt_logprobs`: it returns the top-k at every prompt position and bypasses
        the prefix cache, so its cost grows with the context. At 64 contexts and 4 drafted
        tokens on the bundled models it took 106 / 262 / 549 ms at 6 / 24 / 54-token
        contexts, against 81 / 85 / 93 ms for the prefixes (one run of a scratch probe, not
        committed). The prefixes are what per-token mode would send, so the
        logprobs are the same decode-step values too.
        """
        return await score_by_prefixes(self, contexts, continuations, k)
