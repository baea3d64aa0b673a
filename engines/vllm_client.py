"""Async client for one vLLM OpenAI-compatible server.

One `aiohttp.ClientSession` per server, opened by `async with` and closed once; a client
cannot be reused after it closed. Every call has a timeout and goes through
`engines.http.request_json`, which owns retries and error translation.

Next-token top-k uses `/v1/completions` with token-id prompts (a list of lists batches
all contexts into one request), `max_tokens: 1`, `temperature: 0` (so the sampled token
is the argmax and already inside the top k) and `return_tokens_as_token_ids: true`
(otherwise distinct ids that decode to the same string collide in the logprobs dict).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import aiohttp
import numpy as np

from dualvllm.errors import (
    LifecycleError,
    ServerError,
    ServerRejectedError,
    TopKUnsupportedError,
    UnknownModelError,
)
from engines.http import RetryPolicy, expect, request_json
from engines.protocol import PAD_TOKEN_ID, ModelInfo, TopKBatch

TOKEN_ID_PREFIX = "token_id:"  # key format with return_tokens_as_token_ids


class VLLMClient:
    """Talks to one vLLM server; implements `engines.protocol.Engine`."""

    def __init__(
        self,
        url: str,
        *,
        name: str = "server",
        model: str | None = None,
        api_key: str | None = None,
        request_timeout_s: float = 60.0,
        connect_timeout_s: float = 10.0,
        connection_pool_size: int = 32,
        max_retries: int = 3,
        retry_delay_s: float = 0.2,
    ) -> None:
        self.url = url.rstrip("/")
        self.name = name
        self._model = model  # the served model name to use; None = the first one listed
        self._api_key = api_key
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s, connect=connect_timeout_s)
        self._pool_size = connection_pool_size
        self._retry = RetryPolicy(max_retries=max_retries, base_delay_s=retry_delay_s)
        self._session: aiohttp.ClientSession | None = None
        self._closed = False
        self._model_info: ModelInfo | None = None
        self._eos_ids: frozenset[int] | None = None
        self.requests = 0  # HTTP requests sent, retries included
        self.retries = 0
        self.failures = 0  # calls that raised after their retries

    async def __aenter__(self) -> VLLMClient:
        if self._session is not None or self._closed:
            raise LifecycleError(f"{self.name} client for {self.url} was already entered; "
                                 "create a new VLLMClient for each `async with`")
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self._pool_size),
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

    async def call(self, method: str, path: str, payload: Any = None) -> Any:
        """One JSON request to `path`, with retries; the building block of every call."""
        if self._session is None:
            raise LifecycleError(f"{self.name} client for {self.url} is not open; "
                                 "use `async with VLLMClient(...) as client:`")
        self.requests += 1

        def count_retry(_: ServerError) -> None:
            self.retries += 1
            self.requests += 1

        try:
            return await request_json(
                self._session, method, self.url + path, server=self.name,
                payload=payload, retry=self._retry, on_retry=count_retry,
            )
        except ServerError:
            self.failures += 1
            raise

    async def health(self) -> None:
        """Raise a ServerError unless GET /health answers 200."""
        await self.call("GET", "/health")

    # -- Engine protocol -------------------------------------------------------------

    async def model_info(self) -> ModelInfo:
        if self._model_info is None:
            body = await self.call("GET", "/v1/models")
            data = body.get("data") if isinstance(body, dict) else None
            expect(isinstance(data, list) and bool(data), self.name, self.url, "/v1/models lists no model")
            card = self._pick_model(data)
            root = card.get("root") or card["id"]
            self._model_info = ModelInfo(
                name=card["id"],
                root=root,
                max_model_len=int(card.get("max_model_len") or 0),
                vocab_size=_vocab_size_from_model_dir(Path(root)),
            )
        return self._model_info

    def _pick_model(self, cards: list[dict[str, Any]]) -> dict[str, Any]:
        if self._model is None:
            return cards[0]
        for card in cards:
            if card.get("id") == self._model:
                return card
        served = [card.get("id") for card in cards]
        raise UnknownModelError(
            f"{self.name} server at {self.url} does not serve a model named {self._model!r}; it "
            f"serves {served}. Use one of those names (or none, to take the first).")

    async def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        info = await self.model_info()
        body = await self.call("POST", "/tokenize", {
            "model": info.name, "prompt": text, "add_special_tokens": add_special_tokens,
        })
        expect(isinstance(body, dict) and "tokens" in body, self.name, self.url,
               "/tokenize answer has no 'tokens'")
        return [int(t) for t in body["tokens"]]

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        info = await self.model_info()
        body = await self.call("POST", "/detokenize", {"model": info.name, "tokens": list(token_ids)})
        expect(isinstance(body, dict) and "prompt" in body, self.name, self.url,
               "/detokenize answer has no 'prompt'")
        return body["prompt"]

    async def eos_token_ids(self) -> frozenset[int]:
        """EOS ids, from the model directory if the server's `root` is readable here,
        else from `/tokenizer_info` (vLLM `--enable-tokenizer-info-endpoint`), else empty."""
        if self._eos_ids is None:
            info = await self.model_info()
            ids = _eos_ids_from_model_dir(Path(info.root))
            if not ids:
                ids = await self._eos_ids_from_tokenizer_info()
            self._eos_ids = ids
        return self._eos_ids

    async def next_token_topk(self, contexts: Sequence[Sequence[int]], k: int) -> TopKBatch:
        info = await self.model_info()
        payload = {
            "model": info.name,
            "prompt": [list(c) for c in contexts],
            "max_tokens": 1,
            "logprobs": k,
            "temperature": 0.0,
            "return_tokens_as_token_ids": True,
        }
        try:
            body = await self.call("POST", "/v1/completions", payload)
        except ServerRejectedError as err:
            if "max_logprobs" in err.body or "max allowed" in err.body:
                raise TopKUnsupportedError(
                    f"{self.name} server at {self.url} refuses top_k={k}: {err.body[:200]}. "
                    f"Restart it with `--max-logprobs {k}` (or more), or lower top_k."
                ) from err
            raise
        return self._parse_topk(body, len(contexts), k)

    def _parse_topk(self, body: Any, batch_size: int, k: int) -> TopKBatch:
        choices = body.get("choices") if isinstance(body, dict) else None
        expect(isinstance(choices, list) and len(choices) == batch_size, self.name, self.url,
               f"expected {batch_size} choices")
        # Up to k+1 entries per row: vLLM adds the sampled token if it is not in the top k.
        width = k + 1
        token_ids = np.full((batch_size, width), PAD_TOKEN_ID, dtype=np.int64)
        logprobs = np.full((batch_size, width), -np.inf, dtype=np.float64)
        for choice in choices:
            row = int(choice["index"])
            top = (choice.get("logprobs") or {}).get("top_logprobs") or [None]
            entries = top[0]
            expect(isinstance(entries, dict) and len(entries) > 0, self.name, self.url,
                   "choice without top_logprobs; was `logprobs` dropped by a proxy?")
            ids = [int(key[len(TOKEN_ID_PREFIX):]) for key in entries]
            n = min(len(ids), width)
            token_ids[row, :n] = ids[:n]
            logprobs[row, :n] = list(entries.values())[:n]
        return TopKBatch(token_ids=token_ids, logprobs=logprobs)

    async def _eos_ids_from_tokenizer_info(self) -> frozenset[int]:
        try:
            body = await self.call("GET", "/tokenizer_info")
        except ServerRejectedError:  # 404: endpoint not enabled on this server
            return frozenset()
        eos = body.get("eos_token") if isinstance(body, dict) else None
        if isinstance(eos, dict):
            eos = eos.get("content")
        if not isinstance(eos, str) or not eos:
            return frozenset()
        ids = await self.tokenize(eos, add_special_tokens=False)
        return frozenset(ids) if len(ids) == 1 else frozenset()


def _vocab_size_from_model_dir(root: Path) -> int | None:
    """config.json's vocab_size (or its text_config's), if the server's model dir is readable here."""
    try:
        config = json.loads((root / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return value if isinstance(value, int) and value > 0 else None


def _eos_ids_from_model_dir(root: Path) -> frozenset[int]:
    """eos_token_id from generation_config.json and config.json (int or list), if present."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = root / name
        if not path.is_file():
            continue
        try:
            value = json.loads(path.read_text()).get("eos_token_id")
        except (OSError, ValueError):
            continue
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)
