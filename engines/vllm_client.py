"""Async client for one vLLM OpenAI-compatible server.

One `aiohttp.ClientSession` per server, opened by `async with` and closed once; a client
cannot be reused after it closed. Every call has a timeout and goes through
`dualvllm.engines.http.request_json`, which owns retries and error translation.

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
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable, Mapping, Sequence

import aiohttp

from dualvllm.common.errors import (
    LifecycleError,
    ServerError,
    ServerRejectedError,
    TopKUnsupportedError,
    UnknownModelError,
)
from dualvllm.engines import vllm_answers as answers
from dualvllm.engines.http import (
    CONNECT_TIMEOUT_S,
    CONNECTION_POOL_SIZE,
    KEEPALIVE_TIMEOUT_S,
    MAX_RETRIES,
    REQUEST_TIMEOUT_S,
    RETRY_DELAY_S,
    RetryPolicy,
    expect,
    request_json,
)
from dualvllm.engines.protocol import Draft, ModelInfo, TopKBatch, score_by_prefixes
from dualvllm.engines.vllm_admin import VLLMAdmin
from dualvllm.engines.vllm_scoring import GENERATE_PATH, PromptScorer
from dualvllm.engines.vllm_tokens import ServerTokenizer

# observer(server name, path, seconds, ok): one finished call, retries included.
CallObserver = Callable[[str, str, float, bool], None]


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
        self.url = url.rstrip("/")
        self.name = name
        self._model = model  # the served model name to use; None = the first one listed
        self._api_key = api_key
        self.connect_timeout_s = connect_timeout_s
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s, connect=connect_timeout_s)
        self._pool_size = connection_pool_size
        self._retry = RetryPolicy(max_retries=max_retries, base_delay_s=retry_delay_s)
        self._session: aiohttp.ClientSession | None = None
        self._closed = False
        self._model_info: ModelInfo | None = None
        self._token_ids = answers.TokenIdCache()
        # Tokenize and detokenize here, with the served model's own tokenizer, instead of
        # over HTTP, with `local_tokenizer`: what a server started with --skip-tokenizer-init needs.
        self.tokens = ServerTokenizer(self, local=local_tokenizer)
        self.admin = VLLMAdmin(self)  # pause, resume, reloads, native weight transfer
        self.scoring = PromptScorer(self)  # given prompts' top-k and logprobs
        self.requests = 0  # HTTP requests sent, retries included
        self.retries = 0
        self.failures = 0  # calls that raised after their retries
        self.observers: list[CallObserver] = []  # told of every call's outcome (metrics)

    async def __aenter__(self) -> VLLMClient:
        if self._session is not None or self._closed:
            raise LifecycleError(
                f"{self.name} client for {self.url} was already entered; create a new VLLMClient for each `async with`"
            )
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self._pool_size, keepalive_timeout=KEEPALIVE_TIMEOUT_S),
            timeout=self._timeout,
            headers=headers,
        )
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        self._session = None
        self._closed = True

    # -- raw calls -------------------------------------------------------------------

    # POST routes that are safe to send twice, so dualvllm.engines.http retries them like reads.
    # Every GET is. Any other POST counts as changing state and is resent only when
    # nothing was sent: /collective_rpc runs an arbitrary worker method (reload_weights),
    # and dualvllm.training.weight_sync checks what the server holds before it sends one again.
    IDEMPOTENT_POSTS = frozenset(
        {
            "/tokenize",
            "/detokenize",  # read the tokenizer
            "/v1/completions",  # generation changes no model state, only costs compute
            GENERATE_PATH,  # the same
            "/reset_prefix_cache",  # emptying an empty cache changes nothing
            "/pause",
            "/resume",  # set a state; a second send sets the same state
        }
    )

    async def call(
        self,
        method: str,
        path: str,
        payload: Any = None,
        decode: Callable[[bytes], Any] = json.loads,
        *,
        idempotent: bool | None = None,
        timeout: aiohttp.ClientTimeout | None = None,
        on_headers: Callable[[], None] | None = None,
    ) -> Any:
        """One JSON request to `path`, with retries; the building block of every call.

        Retried like a read if it is a GET or in IDEMPOTENT_POSTS (or `idempotent` says
        so), else only when it never left (dualvllm.engines.http's table). `decode` parses a 2xx
        body (default: any JSON); see dualvllm.engines.http.request_json. `timeout` replaces the
        client's request timeout for this call; `on_headers` is called when a 2xx answer starts.
        """
        if self._session is None:
            raise LifecycleError(
                f"{self.name} client for {self.url} is not open; use `async with VLLMClient(...) as client:`"
            )
        if idempotent is None:
            idempotent = method == "GET" or path.partition("?")[0] in self.IDEMPOTENT_POSTS
        self.requests += 1

        def count_retry(_: ServerError) -> None:
            self.retries += 1
            self.requests += 1

        started, ok = time.perf_counter(), False
        try:
            answer = await request_json(
                self._session,
                method,
                self.url + path,
                server=self.name,
                payload=payload,
                retry=self._retry,
                idempotent=idempotent,
                on_retry=count_retry,
                decode=decode,
                timeout=timeout,
                on_headers=on_headers,
            )
            ok = True
            return answer
        except ServerError:
            self.failures += 1
            raise
        finally:
            for observe in self.observers:
                observe(self.name, path.partition("?")[0], time.perf_counter() - started, ok)

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
        if self._model_info is None:
            body = await self.call("GET", "/v1/models")
            data = body.get("data") if isinstance(body, dict) else None
            expect(isinstance(data, list) and bool(data), self.name, self.url, "/v1/models lists no model")
            assert isinstance(data, list)  # expect raised otherwise; says so to mypy
            card = _pick_model(data, self._model, self.name, self.url)
            root = card.get("root") or card["id"]
            self._model_info = ModelInfo(
                name=card["id"],
                root=root,
                max_model_len=int(card.get("max_model_len") or 0),
                vocab_size=answers.config_int(Path(root), "vocab_size"),
                pad_token_id=answers.config_int(Path(root), "pad_token_id", minimum=0),
            )
        return self._model_info

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
        return await self.completions(
            payload, k, decode=lambda raw: answers.next_token_rows(answers.decode_completion(raw), n, k, ids)
        )

    async def prompt_topk(self, prompts: Sequence[Sequence[int]], k: int) -> list[TopKBatch]:
        return await self.scoring.topk(prompts, k)

    async def prompt_logprobs(self, prompts: Sequence[Sequence[int]], k: int) -> list[list[dict[str, Any] | None]]:
        return await self.scoring.logprobs(prompts, k)

    async def completions(
        self,
        payload: dict[str, Any],
        k: int,
        decode: Callable[[bytes], Any] = json.loads,
        path: str = "/v1/completions",
    ) -> Any:
        """POST /v1/completions (or `path`); a refused logprob count becomes TopKUnsupportedError."""
        try:
            return await self.call("POST", path, payload, decode=decode)
        except ServerRejectedError as err:
            if "max_logprobs" in err.body or "max allowed" in err.body:
                raise TopKUnsupportedError(
                    f"{self.name} server at {self.url} refuses top_k={k}: {err.body[:200]}. "
                    f"Restart it with `--max-logprobs {k}` (or more), or lower top_k."
                ) from err
            raise

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
            timeout=aiohttp.ClientTimeout(total=None, connect=self._timeout.connect),
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
        (draft,) = await self.completions(payload, k, decode=lambda raw: answers.drafts(json.loads(raw), 1, k, ids))
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
        return await self.completions(payload, k, decode=lambda raw: answers.drafts(json.loads(raw), n, k, ids))

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


def _pick_model(cards: list[dict[str, Any]], model: str | None, server: str, url: str) -> dict[str, Any]:
    if model is None:
        return cards[0]
    for card in cards:
        if card.get("id") == model:
            return card
    served = [card.get("id") for card in cards]
    raise UnknownModelError(
        f"{server} server at {url} does not serve a model named {model!r}; it "
        f"serves {served}. Use one of those names (or none, to take the first)."
    )
