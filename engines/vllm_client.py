"""Async client for one vLLM OpenAI-compatible server.

One `aiohttp.ClientSession` per server, opened by `async with` and closed once; a client
cannot be reused after it closed. Every call has a timeout and goes through
`engines.http.request_json`, which owns retries and error translation.

Next-token top-k uses `/v1/completions` with token-id prompts (a list of lists batches
all contexts into one request), `max_tokens: 1`, `temperature: 0` (so the sampled token
is the argmax and already inside the top k) and `return_tokens_as_token_ids: true`
(otherwise distinct ids that decode to the same string collide in the logprobs dict).

Speculative rounds use native generation (`draft`: several tokens sampled from the top-k,
with their top-k per position) and next-token requests (`score_continuations`: one prompt
per prefix context + draft[:j], batched, as per-token mode would send them).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from pathlib import Path
from typing import Any, Literal
from collections.abc import Callable, Iterable, Mapping, Sequence

import aiohttp
import msgspec
import numpy as np

from common.errors import (
    InvalidInputError,
    LifecycleError,
    MalformedResponseError,
    ServerError,
    ServerRejectedError,
    TopKUnsupportedError,
    UnknownModelError,
    WeightSyncError,
)
from engines.http import (
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
from engines.chat import render_chat
from engines.protocol import Draft, ModelInfo, TopKBatch, score_by_prefixes
from engines.weights_dir import checked_weights_dir

# observer(server name, path, seconds, ok): one finished call, retries included.
CallObserver = Callable[[str, str, float, bool], None]
TOKEN_ID_PREFIX = "token_id:"  # key format with return_tokens_as_token_ids
# vLLM refuses a prefix-cache reset (`success: false`) while running requests hold blocks;
# inside a /pause fence they drain within a few decode steps (~25 ms each on CPU), so 50
# tries 0.1 s apart outlast them, and a server that still refuses is reported.
RESET_ATTEMPTS = 50
RESET_RETRY_DELAY_S = 0.1
# The dtypes a vLLM server computes in, as /server_info names them (without "torch.").
SERVED_DTYPES = frozenset({"bfloat16", "float16", "float32"})
# What /pause does with requests in flight (vLLM 0.32's `mode`): wait for them to finish,
# abort them, or keep them queued until /resume.
PauseMode = Literal["wait", "abort", "keep"]


class _TopLogprobs(msgspec.Struct):
    top_logprobs: list[dict[str, float] | None] = []


class _Choice(msgspec.Struct):
    index: int
    logprobs: _TopLogprobs | None = None


class _Completion(msgspec.Struct):
    """The part of a /v1/completions answer next_token_topk reads; the rest is skipped unparsed."""

    choices: list[_Choice]


# Decoding only these fields, typed, takes 90 µs for a 64-prompt top-20 answer (60 kB)
# where json.loads of the whole body took 410 µs.
_decode_completion: Callable[[bytes], _Completion] = msgspec.json.Decoder(_Completion).decode


def _token_id(key: str) -> int:
    """"token_id:123" -> 123; any other key is a ValueError (the client always asks for ids)."""
    if not key.startswith(TOKEN_ID_PREFIX) or not key[len(TOKEN_ID_PREFIX):].isdigit():
        raise ValueError(f"logprob key {key[:40]!r} is not 'token_id:N'; the server ignored "
                         "return_tokens_as_token_ids")
    return int(key[len(TOKEN_ID_PREFIX):])


class _TokenIdCache(dict[str, int]):
    """_token_id of every key, parsed once per distinct key (at most the vocabulary).

    A dict lookup per logprob entry instead of a slice and an int(): 38 µs instead of
    142 µs for the 1,280 entries of a 64-prompt top-20 answer.
    """

    def __missing__(self, key: str) -> int:
        value = self[key] = _token_id(key)
        return value


class VLLMClient:
    """Talks to one vLLM server; implements `engines.protocol.Engine`."""

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
        # Tokenize and detokenize here, with the served model's own tokenizer, instead of
        # over HTTP: what a server started with --skip-tokenizer-init needs (see tokenize).
        self._local_tokenizer = local_tokenizer
        self._tokenizer: Any = None
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
        self._token_ids = _TokenIdCache()
        self.requests = 0  # HTTP requests sent, retries included
        self.retries = 0
        self.failures = 0  # calls that raised after their retries
        self.observers: list[CallObserver] = []  # told of every call's outcome (metrics)

    async def __aenter__(self) -> VLLMClient:
        if self._session is not None or self._closed:
            raise LifecycleError(f"{self.name} client for {self.url} was already entered; "
                                 "create a new VLLMClient for each `async with`")
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

    # POST routes that are safe to send twice, so engines.http retries them like reads.
    # Every GET is. Any other POST counts as changing state and is resent only when
    # nothing was sent: /collective_rpc runs an arbitrary worker method (reload_weights),
    # and training.weight_sync checks what the server holds before it sends one again.
    IDEMPOTENT_POSTS = frozenset({
        "/tokenize", "/detokenize",  # read the tokenizer
        "/v1/completions",  # generation changes no model state, only costs compute
        "/reset_prefix_cache",  # emptying an empty cache changes nothing
        "/pause", "/resume",  # set a state; a second send sets the same state
    })

    async def call(self, method: str, path: str, payload: Any = None,
                   decode: Callable[[bytes], Any] = json.loads, *, idempotent: bool | None = None,
                   timeout: aiohttp.ClientTimeout | None = None,
                   on_headers: Callable[[], None] | None = None) -> Any:
        """One JSON request to `path`, with retries; the building block of every call.

        Retried like a read if it is a GET or in IDEMPOTENT_POSTS (or `idempotent` says
        so), else only when it never left (engines.http's table). `decode` parses a 2xx
        body (default: any JSON); see engines.http.request_json. `timeout` replaces the
        client's request timeout for this call; `on_headers` is called when a 2xx answer starts.
        """
        if self._session is None:
            raise LifecycleError(f"{self.name} client for {self.url} is not open; "
                                 "use `async with VLLMClient(...) as client:`")
        if idempotent is None:
            idempotent = method == "GET" or path.partition("?")[0] in self.IDEMPOTENT_POSTS
        self.requests += 1

        def count_retry(_: ServerError) -> None:
            self.retries += 1
            self.requests += 1

        started, ok = time.perf_counter(), False
        try:
            answer = await request_json(
                self._session, method, self.url + path, server=self.name,
                payload=payload, retry=self._retry, idempotent=idempotent, on_retry=count_retry,
                decode=decode, timeout=timeout, on_headers=on_headers,
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

    # -- admin: weight pushes (training.weight_sync); the reload needs a dev-mode server ---
    #
    #   call                   sent again after a timeout, 5xx or lost connection?
    #   pause, resume          yes: each sets a state, and a second send sets the same one
    #   reset_prefix_cache     yes: emptying an empty cache changes nothing; a refusal
    #                          (`success: false`) is asked again, up to RESET_ATTEMPTS
    #   reload_weights         no, only when nothing was sent: a reload that may have run
    #                          is the caller's to check (it probes the weights served)
    #
    # 4xx answers are never resent (engines.http's table).

    async def pause(self, mode: PauseMode = "wait") -> bool:
        """Stop the server from scheduling new requests (`mode`: what happens to those running).

        True once paused; False if the server has no /pause route (an older vLLM), so the
        caller knows its reload is not fenced.
        """
        try:
            await self.call("POST", f"/pause?mode={mode}", idempotent=True)
        except ServerRejectedError as err:
            if err.status == 404:
                return False
            raise
        return True

    async def resume(self) -> None:
        """Let the server schedule requests again after `pause`."""
        await self.call("POST", "/resume", idempotent=True)

    async def reload_weights(self, weights_path: Path | str, *, timeout_s: float | None = None) -> None:
        """Load the HF-format checkpoint in `weights_path` into the running server, in place.

        The path is sent absolute, and only once `engines.weights_dir.checked_weights_dir`
        found a readable checkpoint there: the server reads it from its own working directory
        and filesystem, and a reload of a path vLLM cannot read can kill the server. A
        missing or corrupt checkpoint raises WeightSyncError and nothing is sent. On two
        machines the directory must be at the same absolute path on both.

        Sent at most once unless the connection never opened (see the table above): a
        timeout, 5xx or lost connection raises its ServerError, and the server may or may
        not serve the new weights. `timeout_s` replaces the request timeout for this call
        (a large model's reload takes longer than a decode step). A server started without
        dev mode has no /collective_rpc: WeightSyncError says how to restart it.
        """
        weights_dir = checked_weights_dir(weights_path)
        timeout = None if timeout_s is None else aiohttp.ClientTimeout(total=timeout_s,
                                                                         connect=self._timeout.connect)
        try:
            await self.call("POST", "/collective_rpc",
                            {"method": "reload_weights", "kwargs": {"weights_path": str(weights_dir)}},
                            idempotent=False, timeout=timeout)
        except ServerRejectedError as err:
            if err.status == 404:
                raise WeightSyncError(
                    f"{self.name} server at {self.url} has no /collective_rpc: it was started without dev "
                    "mode. Restart it with VLLM_SERVER_DEV_MODE=1 (ServerConfig(dev_mode=True), or `dualvllm "
                    "serve --dev-mode`), on a loopback host only") from err
            raise

    async def served_dtype(self) -> str | None:
        """The dtype the server computes in ("bfloat16", "float16", "float32"), from the dev-mode
        GET /server_info; None if the server has no such route (started without dev mode).

        A weight push compares the server's logprobs with the learner's, which are only
        comparable at the same precision: `--dtype auto` serves a float32 checkpoint in
        bfloat16 on the CPU build, and a bf16 checkpoint in bf16 everywhere.
        """
        config = await self.server_config()
        if config is None:
            return None
        model = config.get("model_config", {})
        dtype = str(model.get("dtype", "")) if isinstance(model, dict) else ""
        expect(dtype.removeprefix("torch.") in SERVED_DTYPES, self.name, self.url,
               f"/server_info names no model dtype among {sorted(SERVED_DTYPES)} (got {dtype!r})")
        return dtype.removeprefix("torch.")

    async def weight_transfer_backend(self) -> str | None:
        """The weight-transfer engine the server was started with (--weight-transfer-config), from
        the dev-mode GET /server_info; None if it has none, or no such route."""
        config = await self.server_config()
        transfer = (config or {}).get("weight_transfer_config")
        return transfer.get("backend") if isinstance(transfer, dict) else None

    async def server_config(self) -> dict[str, Any] | None:
        """The server's vllm_config from GET /server_info (dev mode); None without that route."""
        try:
            info = await self.call("GET", "/server_info?config_format=json")
        except ServerRejectedError as err:
            if err.status == 404:
                return None
            raise
        config = info.get("vllm_config") if isinstance(info, dict) else None
        return config if isinstance(config, dict) else {}

    async def reset_prefix_cache(self, *, attempts: int = RESET_ATTEMPTS,
                                 retry_delay_s: float = RESET_RETRY_DELAY_S,
                                 reset_running_requests: bool = False) -> None:
        """Drop every cached KV block, so that none computed with old weights is reused.

        vLLM answers `success: false` while running requests hold blocks: asked again up to
        `attempts` times, `retry_delay_s` apart; then WeightSyncError (call it inside `pause`).
        `reset_running_requests` drops the blocks of running requests too: vLLM preempts them,
        and they recompute their context when they are scheduled again.
        """
        path = "/reset_prefix_cache" + ("?reset_running_requests=true" if reset_running_requests else "")
        for attempt in range(attempts):
            answer = await self.call("POST", path, idempotent=True)
            expect(isinstance(answer, dict) and "success" in answer, self.name, self.url,
                   f"/reset_prefix_cache answered {answer!r}, not {{'success': bool}}")
            if answer["success"]:
                return
            if attempt + 1 < attempts:
                await asyncio.sleep(retry_delay_s)
        raise WeightSyncError(
            f"{self.name} server at {self.url} refused to reset its prefix cache {attempts} times, and stale KV "
            "blocks would give wrong logprobs; running requests hold blocks: reset inside pause(), and check "
            "that the server honours /pause")

    # -- admin: vLLM's native weight transfer (training.weight_transfer); dev mode ----------
    #
    # Four phases, each sent once (a phase changes the server's state): init the transfer
    # engine, start an update, update_weights per chunk, finish. None is resent after a
    # timeout: the caller ends the update and verifies what the server serves.

    async def init_weight_transfer_engine(self, init_info: dict[str, Any], *, timeout_s: float) -> None:
        """Set up the server's weight-transfer engine (its --weight-transfer-config backend)."""
        await self._transfer_phase("/init_weight_transfer_engine", {"init_info": init_info}, timeout_s)

    async def start_weight_update(self, *, timeout_s: float) -> None:
        await self._transfer_phase("/start_weight_update", None, timeout_s)

    async def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]], *, timeout_s: float) -> None:
        """Send one chunk's description; the server loads the chunk before it answers."""
        await self._transfer_phase("/update_weights", {"update_info": update_info}, timeout_s)

    async def finish_weight_update(self, weight_version: str | None = None, *, timeout_s: float) -> None:
        payload = None if weight_version is None else {"weight_version": weight_version}
        await self._transfer_phase("/finish_weight_update", payload, timeout_s)

    async def world_size(self, include_dp: bool = True) -> int:
        """The server's worker count (TP x PP, x DP with `include_dp`): GET /get_world_size (dev mode)."""
        body = await self.call("GET", "/get_world_size" + ("" if include_dp else "?include_dp=false"))
        expect(isinstance(body, dict) and isinstance(body.get("world_size"), int), self.name, self.url,
               f"/get_world_size answered {body!r}, not {{'world_size': int}}")
        return body["world_size"]

    async def weight_version(self) -> str | None:
        """The version the last finished update was tagged with (GET /weight_info)."""
        body = await self.call("GET", "/weight_info")
        return body.get("weight_version") if isinstance(body, dict) else None

    async def _transfer_phase(self, path: str, payload: Any, timeout_s: float) -> None:
        timeout = aiohttp.ClientTimeout(total=timeout_s, connect=self._timeout.connect)
        try:
            await self.call("POST", path, payload, idempotent=False, timeout=timeout)
        except ServerRejectedError as err:
            if err.status == 404:
                raise WeightSyncError(
                    f"{self.name} server at {self.url} has no {path}: it was started without dev mode. Restart it "
                    "with VLLM_SERVER_DEV_MODE=1 (ServerConfig(dev_mode=True)), on a loopback host only") from err
            raise

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
                vocab_size=_config_int(Path(root), "vocab_size"),
                pad_token_id=_config_int(Path(root), "pad_token_id", minimum=0),
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
        """The server's /tokenize, or with `local_tokenizer` the same transformers tokenizer
        vLLM loads, from the model directory the server reports (`root` in /v1/models).

        A server started with --skip-tokenizer-init has no /tokenize and /detokenize, and
        skips detokenizing the top-k entries of every answer: a 64-prompt top-20 request
        on the bundled models took 17.8 ms instead of 25.0 (median of 30).
        """
        if self._local_tokenizer:
            tokenizer = await self._load_tokenizer()
            return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
        info = await self.model_info()
        body = await self.call("POST", "/tokenize", {
            "model": info.name, "prompt": text, "add_special_tokens": add_special_tokens,
        })
        expect(isinstance(body, dict) and "tokens" in body, self.name, self.url,
               "/tokenize answer has no 'tokens'")
        return [int(t) for t in body["tokens"]]

    async def tokenize_chat(self, messages: Sequence[Mapping[str, Any]],
                            template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """A chat rendered with the model's chat template, up to the assistant's turn: the
        server's /tokenize with `messages`, or the local tokenizer's apply_chat_template."""
        if self._local_tokenizer:
            return render_chat(await self._load_tokenizer(), messages, self.name, template_kwargs)
        info = await self.model_info()
        request: dict[str, Any] = {"model": info.name, "messages": list(messages), "add_generation_prompt": True}
        if template_kwargs:
            request["chat_template_kwargs"] = dict(template_kwargs)
        body = await self.call("POST", "/tokenize", request)
        expect(isinstance(body, dict) and "tokens" in body, self.name, self.url,
               "/tokenize answer has no 'tokens'")
        return [int(t) for t in body["tokens"]]

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        if self._local_tokenizer:
            return (await self._load_tokenizer()).decode(list(token_ids))
        info = await self.model_info()
        body = await self.call("POST", "/detokenize", {"model": info.name, "tokens": list(token_ids)})
        expect(isinstance(body, dict) and "prompt" in body, self.name, self.url,
               "/detokenize answer has no 'prompt'")
        return body["prompt"]

    async def _load_tokenizer(self) -> Any:
        if self._tokenizer is None:
            root = Path((await self.model_info()).root)
            if not (root / "tokenizer_config.json").is_file() and not (root / "tokenizer.json").is_file():
                raise InvalidInputError(
                    f"local_tokenizer: the {self.name} server's model directory {root} has no tokenizer "
                    "files readable here; run the coordinator where the model directory is, or turn "
                    "local tokenizers off (and start the server without --skip-tokenizer-init).")
            try:
                import transformers
            except ImportError as err:
                raise InvalidInputError(
                    "local_tokenizer needs the transformers package: pip install 'dualvllm[cpu]' "
                    "(or transformers alone).") from err
            self._tokenizer = await asyncio.to_thread(transformers.AutoTokenizer.from_pretrained, str(root))
        return self._tokenizer

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

    async def next_token_topk(self, contexts: Sequence[Sequence[int]], k: int,
                              keys: Sequence[int] | None = None) -> TopKBatch:
        info = await self.model_info()
        payload = {
            "model": info.name,
            "prompt": [list(c) for c in contexts],
            "max_tokens": 1,
            "logprobs": k,
            "temperature": 0.0,
            "return_tokens_as_token_ids": True,
        }
        answer = await self._completions(payload, k, decode=_decode_completion)
        return self._parse_topk(answer, len(contexts), k)

    async def prompt_topk(self, prompts: Sequence[Sequence[int]], k: int) -> list[TopKBatch]:
        """The top-k before every token of each prompt but its first, in one batched request:
        vLLM's prompt logprobs (`echo` with `max_tokens: 0` and `logprobs: k`).

        Answer i has len(prompts[i]) - 1 rows; row j holds the raw logprobs of the distribution
        prompts[i][j + 1] was drawn from, with that token's own logprob always among them:
        vLLM adds it as a (k+1)-th entry when it is outside the top k. Not for decoding: a
        prompt-logprobs request bypasses the prefix cache, so its cost grows with the prompt.
        """
        info = await self.model_info()
        payload = {
            "model": info.name, "prompt": [list(p) for p in prompts], "max_tokens": 0, "echo": True,
            "logprobs": k, "temperature": 0.0, "return_tokens_as_token_ids": True,
        }
        body = await self._completions(payload, k)
        choices = body.get("choices") if isinstance(body, dict) else None
        expect(isinstance(choices, list) and len(choices) == len(prompts), self.name, self.url,
               f"expected {len(prompts)} choices")
        answers: list[TopKBatch | None] = [None] * len(prompts)
        for choice in choices:
            index = choice.get("index")
            expect(isinstance(index, int) and 0 <= index < len(prompts) and answers[index] is None,
                   self.name, self.url, f"choice index {index!r} is not one of 0..{len(prompts) - 1}, once each")
            answers[index] = self._prompt_rows(choice.get("logprobs") or {}, prompts[index], k)
        return answers  # type: ignore[return-value]

    async def prompt_logprobs(self, prompts: Sequence[Sequence[int]], k: int) -> list[list[dict[str, Any] | None]]:
        """vLLM's own prompt logprobs of each prompt, as its server gives them: per position
        None (position 0), then {"<token id>": {"logprob", "rank", "decoded_token"}} with the
        top k and the position's own token at its true rank (k = -1: the whole vocabulary,
        if the server allows it). One batched request; a q* service passes them through
        when a request scores with one model alone."""
        info = await self.model_info()
        payload = {"model": info.name, "prompt": [list(p) for p in prompts], "max_tokens": 1,
                   "temperature": 0.0, "prompt_logprobs": k}
        body = await self._completions(payload, k)
        choices = body.get("choices") if isinstance(body, dict) else None
        expect(isinstance(choices, list) and len(choices) == len(prompts), self.name, self.url,
               f"expected {len(prompts)} choices")
        answers: list[list[dict[str, Any] | None] | None] = [None] * len(prompts)
        for choice in choices:
            index, rows = choice.get("index"), choice.get("prompt_logprobs")
            expect(isinstance(index, int) and 0 <= index < len(prompts) and answers[index] is None,
                   self.name, self.url, f"choice index {index!r} is not one of 0..{len(prompts) - 1}, once each")
            expect(isinstance(rows, list) and len(rows) == len(prompts[index]) and
                   all(isinstance(row, dict) and str(token) in row for row, token in zip(rows[1:], prompts[index][1:])),
                   self.name, self.url, "prompt_logprobs do not cover the prompt, each position with its own token")
            answers[index] = rows
        return answers  # type: ignore[return-value]

    def _prompt_rows(self, logprobs: dict[str, Any], prompt: Sequence[int], k: int) -> TopKBatch:
        """One echoed prompt's top-k rows (positions 1..), checked against the prompt sent."""
        tokens, top = logprobs.get("tokens") or [], logprobs.get("top_logprobs") or []
        expect(len(tokens) == len(top) == len(prompt), self.name, self.url,
               f"an echo answer has {len(tokens)} tokens and {len(top)} top_logprobs for a prompt of "
               f"{len(prompt)} tokens; was `logprobs` dropped by a proxy?")
        expect(self._parse_token_ids(tokens, len(tokens)).tolist() == list(prompt), self.name, self.url,
               "the echoed tokens are not the prompt's")
        rows = top[1:]  # position 0 has no distribution (None)
        expect(all(isinstance(row, dict) and key in row for row, key in zip(rows, tokens[1:])), self.name,
               self.url, "a prompt position without its own token's logprob")
        return self._pad_rows(rows, k + 1)

    async def _completions(self, payload: dict[str, Any], k: int,
                           decode: Callable[[bytes], Any] = json.loads) -> Any:
        """POST /v1/completions; a refused logprob count becomes TopKUnsupportedError."""
        try:
            return await self.call("POST", "/v1/completions", payload, decode=decode)
        except ServerRejectedError as err:
            if "max_logprobs" in err.body or "max allowed" in err.body:
                raise TopKUnsupportedError(
                    f"{self.name} server at {self.url} refuses top_k={k}: {err.body[:200]}. "
                    f"Restart it with `--max-logprobs {k}` (or more), or lower top_k."
                ) from err
            raise

    def _parse_topk(self, answer: _Completion, batch_size: int, k: int) -> TopKBatch:
        """Pad every row's top-k into [batch_size, k + 1] arrays, rows in prompt order."""
        choices = answer.choices
        expect(len(choices) == batch_size, self.name, self.url, f"expected {batch_size} choices")
        entries = [c.logprobs.top_logprobs[0] if c.logprobs and c.logprobs.top_logprobs else None
                   for c in choices]
        expect(all(entries), self.name, self.url,
               "choice without top_logprobs; was `logprobs` dropped by a proxy?")
        rows = np.fromiter((c.index for c in choices), np.int64, batch_size)  # [B]
        expect(np.array_equal(np.sort(rows), np.arange(batch_size)), self.name, self.url,
               f"choice indices {rows.tolist()[:8]}... are not 0..{batch_size - 1}")
        # Up to k+1 entries per row: vLLM adds the sampled token if it is not in the top k.
        batch = self._pad_rows(entries, k + 1)  # rows in answer order
        if np.array_equal(rows, np.arange(batch_size)):
            return batch
        order = np.argsort(rows)
        return TopKBatch(token_ids=batch.token_ids[order], logprobs=batch.logprobs[order])

    def _pad_rows(self, entries: list[dict[str, float]], width: int) -> TopKBatch:
        """Each {"token_id:N": logprob} dict as one row, in order, padded to `width`.

        Vectorized over the rows: the entries of all rows are read in one pass each for
        ids and values (TopKBatch.from_flat scatters them into the padded arrays).
        """
        counts = np.fromiter(map(len, entries), np.int64, len(entries))  # [B]
        expect(int(counts.max(initial=0)) <= width, self.name, self.url, f"more than {width} logprobs in a row")
        total = int(counts.sum())
        ids = self._parse_token_ids(itertools.chain.from_iterable(entries), total)
        values = np.fromiter(itertools.chain.from_iterable(e.values() for e in entries), np.float64, total)
        return TopKBatch.from_flat(ids, values, counts, width)

    def _parse_token_ids(self, keys: Iterable[str], count: int) -> np.ndarray:
        """`count` "token_id:N" keys -> int64 [count]; any other key is a MalformedResponseError."""
        try:
            return np.fromiter(map(self._token_ids.__getitem__, keys), np.int64, count)
        except ValueError as err:
            raise MalformedResponseError(self.name, self.url, str(err)) from err

    # -- lockstep (engines/vllm_plugin) ------------------------------------------------

    async def forced_generation(self, prompt_ids: Sequence[int], *, max_tokens: int, stop_token: int,
                                lockstep_args: dict[str, int | str],
                                on_accepted: Callable[[], None] | None = None) -> str:
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
            "model": info.name, "prompt": list(prompt_ids), "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stop_token_ids": [stop_token], "vllm_xargs": lockstep_args,
            "stream": True, "stream_interval": max_tokens + 1,
        }
        return await self.call("POST", "/v1/completions", payload, decode=_streamed_finish_reason,
                               idempotent=False, on_headers=on_accepted,
                               timeout=aiohttp.ClientTimeout(total=None, connect=self._timeout.connect))

    # -- speculative rounds (engines.protocol.SpeculativeEngine) ------------------------

    async def draft(self, context: Sequence[int], *, max_tokens: int, k: int, temperature: float,
                    seed: int) -> Draft:
        """Native generation of `max_tokens` tokens sampled from the top-k at `temperature`.

        One request per sequence: vLLM gives every prompt of a batched request the same
        seed, which would draw identical drafts for identical prompts.
        """
        info = await self.model_info()
        payload = {
            "model": info.name, "prompt": list(context), "max_tokens": max_tokens, "logprobs": k,
            "temperature": temperature, "seed": seed, "ignore_eos": True,
            "return_tokens_as_token_ids": True, **neutral_sampling(k),
        }
        (draft,) = self._drafts(await self._completions(payload, k), 1, k)
        return draft

    async def draft_argmax(self, contexts: Sequence[Sequence[int]], *, max_tokens: int, k: int) -> list[Draft]:
        """One batched request at temperature 0 for every context."""
        info = await self.model_info()
        payload = {
            "model": info.name, "prompt": [list(c) for c in contexts], "max_tokens": max_tokens, "logprobs": k,
            "temperature": 0.0, "ignore_eos": True, "return_tokens_as_token_ids": True,
        }
        return self._drafts(await self._completions(payload, k), len(contexts), k)

    def _drafts(self, body: Any, count: int, k: int) -> list[Draft]:
        """The `count` choices of a draft request, in prompt order, each with its per-token top-k."""
        choices = body.get("choices") if isinstance(body, dict) else None
        expect(isinstance(choices, list) and len(choices) == count, self.name, self.url,
               f"expected {count} choices")
        drafts: list[Draft | None] = [None] * count
        for choice in choices:
            logprobs = choice.get("logprobs") or {}
            tokens = logprobs.get("tokens") or []
            top = logprobs.get("top_logprobs") or []
            expect(0 < len(tokens) == len(top), self.name, self.url,
                   "a draft without per-token top_logprobs; was `logprobs` dropped by a proxy?")
            rows = [_top_row(entries, token, k) for entries, token in zip(top, tokens)]
            drafts[int(choice.get("index", 0))] = Draft(token_ids=self._parse_token_ids(tokens, len(tokens)),
                                                        topk=self._pad_rows(rows, k + 1))
        expect(all(d is not None for d in drafts), self.name, self.url, "choice indices are not 0..n-1")
        return drafts  # type: ignore[return-value]

    async def score_continuations(self, contexts: Sequence[Sequence[int]],
                                  continuations: Sequence[Sequence[int]], k: int) -> list[TopKBatch]:
        """One batched next-token request over every prefix context + continuation[:j].

        Not `prompt_logprobs`: it returns the top-k at every prompt position and bypasses
        the prefix cache, so its cost grows with the context. At 64 contexts and 4 drafted
        tokens on the bundled models it took 106 / 262 / 549 ms at 6 / 24 / 54-token
        contexts, against 81 / 85 / 93 ms for the prefixes (one run of a scratch probe, not
        committed). The prefixes are what per-token mode would send, so the
        logprobs are the same decode-step values too.
        """
        return await score_by_prefixes(self, contexts, continuations, k)

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


def _config_int(root: Path, key: str, *, minimum: int = 1) -> int | None:
    """config.json's `key` (or its text_config's), if the server's model dir is readable here."""
    try:
        config = json.loads((root / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get(key)
    if value is None:
        value = (config.get("text_config") or {}).get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= minimum else None


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


def neutral_sampling(k: int) -> dict[str, Any]:
    """Sampling fields that make a draft's distribution the top-k at the request temperature.

    Every field is sent explicitly: vLLM otherwise takes defaults from the model's
    generation_config.json (e.g. top_p 0.8, repetition_penalty 1.05 for Qwen models), and
    any of them would change the distribution the acceptance test divides by.
    """
    return {"top_k": k, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0,
            "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_tokens": 0}


def _top_row(entries: dict[str, float], token: str, k: int) -> dict[str, float]:
    """A drafted position's top-k, keyed as the answer keys them; vLLM adds the position's own
    token as a (k+1)-th entry when it is not in the top k, and that entry is dropped so rows
    match next_token_topk."""
    if len(entries) > k:
        return {key: v for key, v in entries.items() if key != token}
    return entries


def _streamed_finish_reason(raw: bytes) -> str:
    """The finish_reason of a streamed one-choice completion (server-sent events)."""
    finish = None
    for line in raw.splitlines():
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[len(b"data: "):])
        if "error" in chunk:
            raise ValueError(f"the server reported an error in the stream: {chunk['error']}")
        choices = chunk.get("choices") or [{}]
        finish = choices[0].get("finish_reason") or finish
    if finish is None:
        raise ValueError("the stream ended without a finish_reason")
    return str(finish)
