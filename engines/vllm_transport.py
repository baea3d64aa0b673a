"""The HTTP side of one vLLM server: its session, its calls with retries, the model it serves.

`VLLMClient` (dualvllm.engines.vllm_client) speaks the Engine protocol on top of one of these,
and so do its parts, `VLLMAdmin`, `PromptScorer` and `ServerTokenizer`: each takes the transport
(what it needs: the server's name, URL and calls), not the whole client, so nothing in engines/
imports its way back to the client.

One `aiohttp.ClientSession` per server, opened once and closed once; a transport cannot be
reused after it closed. Every call has a timeout and goes through
`dualvllm.engines.http.request_json`, which owns retries and error translation.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable

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
from dualvllm.engines.protocol import ModelInfo

# observer(server name, path, seconds, ok): one finished call, retries included.
CallObserver = Callable[[str, str, float, bool], None]
# Read by dualvllm.engines.vllm_scoring, which asks it.
GENERATE_PATH = "/inference/v1/generate"  # vLLM's token-in token-out route (--enable-scale-out)


class ServerTransport:
    """Calls to one vLLM server: `open`, then `call` (and `model_info`, `completions`), then `close`."""

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
        self.requests = 0  # HTTP requests sent, retries included
        self.retries = 0
        self.failures = 0  # calls that raised after their retries
        self.observers: list[CallObserver] = []  # told of every call's outcome (metrics)

    def open(self) -> None:
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

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        self._session = None
        self._closed = True

    def timeout(self, total_s: float | None) -> aiohttp.ClientTimeout:
        """A timeout of `total_s` (None: none) for one call, with the transport's connect timeout."""
        return aiohttp.ClientTimeout(total=total_s, connect=self.connect_timeout_s)

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
        transport's request timeout for this call; `on_headers` is called when a 2xx answer starts.
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

    async def model_info(self) -> ModelInfo:
        """The served model's name, directory, context and vocabulary: asked once, then kept."""
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
