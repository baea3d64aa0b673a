"""The one place where aiohttp and asyncio errors become dualvllm errors, and retries live.

Retry policy (classified, capped), with exponential backoff and full jitter up to
`max_retries` times:

    failure                                     idempotent call   call that changes state
    no connection opened (ServerConnectError)   retried           retried: nothing was sent
    connection reset / closed after sending     retried           raised: it may have acted
    timeout (ServerTimeoutError)                retried           raised: it may have acted
    5xx (ServerInternalError)                   retried           raised: it may have acted
    4xx (ServerRejectedError)                   raised            raised: the caller's mistake
    2xx that is not the expected JSON           raised            raised

A call that changes state and failed after sending is left to its caller, which can look
at what the server holds before deciding to send it again (dualvllm.training.weight_sync does).
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable

import aiohttp
import msgspec

from dualvllm.common.errors import (
    MalformedResponseError,
    ServerConnectError,
    ServerError,
    ServerInternalError,
    ServerRejectedError,
    ServerTimeoutError,
    ServerUnavailableError,
)

# msgspec encodes a batch of token-id prompts about 10x faster than json.dumps (64 contexts
# of 40 ids: 10 µs against 108 µs); the servers read the same JSON.
JSON_HEADERS = {"Content-Type": "application/json"}

# Backoff never sleeps longer than this between two tries: a server that stays down for
# longer is better reported than waited on.
MAX_BACKOFF_S = 10.0

# Client defaults, the one source for VLLMClient and CoordinatorConfig.
# A batched top-k step takes ~0.1 s on CPU; a minute is a stuck server, not a slow one.
REQUEST_TIMEOUT_S = 60.0
# Opening a loopback or LAN connection takes milliseconds; ten seconds without one is a
# host that is down or drops packets.
CONNECT_TIMEOUT_S = 10.0
# Per-token steps send one batched request per server; speculative drafts send one per
# sequence, and those beyond this many wait for a free connection.
CONNECTION_POOL_SIZE = 32
# Rides out a dropped connection or a brief 5xx; a server down for longer is reported.
MAX_RETRIES = 3
# First backoff; with doubling and jitter, three retries wait at most 0.2 + 0.4 + 0.8 s.
RETRY_DELAY_S = 0.2
# vLLM's server closes a connection idle for VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s); a client
# that keeps it longer (aiohttp: 15 s) may send a request into a socket the server is
# closing ("Can not write request body"). Let go of idle connections first.
KEEPALIVE_TIMEOUT_S = 4.0


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int  # extra tries after the first one
    base_delay_s: float  # first backoff; doubles each retry, with jitter

    def delay_s(self, retry_index: int) -> float:
        # "Full jitter": uniform in [0, base * 2^i], so many clients retrying at once spread out.
        return random.uniform(0.0, min(MAX_BACKOFF_S, self.base_delay_s * 2**retry_index))


async def request_json(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    *,
    server: str,
    payload: Any = None,
    retry: RetryPolicy,
    idempotent: bool,
    on_retry: Callable[[ServerError], None] | None = None,
    decode: Callable[[bytes], Any] = json.loads,
    timeout: aiohttp.ClientTimeout | None = None,
    on_headers: Callable[[], None] | None = None,
) -> Any:
    """Send one JSON request with the session's timeout (or `timeout`), retrying what is worth retrying.

    `idempotent`: sending the request twice has the effect of sending it once, so it may
    be resent after any retryable failure; if False it is resent only when nothing was
    sent (see the table in the module docstring). `decode` turns a 2xx body into the
    return value (a typed decoder for hot paths); a ValueError from it (msgspec's
    DecodeError is one) means a malformed answer. `on_headers` is called when a 2xx answer's
    headers arrive, before its body: for a streamed answer, the moment the server took the
    request in.
    """
    data = None if payload is None else msgspec.json.encode(payload)
    attempt = 0
    while True:
        try:
            return await _request_once(
                session, method, url, server=server, data=data, decode=decode, timeout=timeout, on_headers=on_headers
            )
        except ServerError as err:
            safe_to_resend = idempotent or not err.request_sent
            if not (err.retryable and safe_to_resend) or attempt >= retry.max_retries:
                raise
            if on_retry is not None:
                on_retry(err)
            await asyncio.sleep(retry.delay_s(attempt))
            attempt += 1


async def _request_once(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    *,
    server: str,
    data: bytes | None,
    decode: Callable[[bytes], Any],
    timeout: aiohttp.ClientTimeout | None = None,
    on_headers: Callable[[], None] | None = None,
) -> Any:
    try:
        options: dict[str, Any] = {"timeout": timeout} if timeout is not None else {}  # else the session's
        async with session.request(
            method, url, data=data, headers=JSON_HEADERS if data else None, **options
        ) as response:
            status = response.status
            if on_headers is not None and status < 400:
                on_headers()
            raw = await response.read()
    except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
        # aiohttp raises these before writing a byte of the request.
        raise ServerConnectError(
            server,
            url,
            f"cannot connect ({type(exc).__name__}: {exc}); nothing was sent; is it running, and is the URL right?",
        ) from exc
    except TimeoutError as exc:
        raise ServerTimeoutError(
            server,
            url,
            "no answer within the request timeout; raise request_timeout if the "
            "server is just slow (long contexts, large batches)",
        ) from exc
    except aiohttp.ClientError as exc:
        raise ServerUnavailableError(
            server,
            url,
            f"the connection broke after it opened ({type(exc).__name__}: {exc}), so the "
            "server may have received the request; is it still running? Check its log for a crash.",
        ) from exc
    if status >= 400:
        body = raw.decode("utf-8", errors="replace")
        raise (ServerInternalError if status >= 500 else ServerRejectedError)(server, url, status, body)
    if not raw:
        return None
    try:
        return decode(raw)
    except ValueError as exc:
        raise MalformedResponseError(
            server, url, f"expected JSON of the expected shape ({exc}), got {raw[:200]!r}"
        ) from exc


def expect(condition: bool, server: str, url: str, what: str) -> None:
    """Raise MalformedResponseError unless a response has the shape the API promises."""
    if not condition:
        raise MalformedResponseError(
            server, url, f"unexpected response: {what}; is this a vLLM OpenAI-compatible server of a supported version?"
        )
