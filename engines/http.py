"""The one place where aiohttp and asyncio errors become dualvllm errors, and retries live.

Retry policy (classified, capped): connection errors, timeouts and 5xx answers are
retried with exponential backoff and full jitter up to `max_retries` times; a 4xx is the
caller's mistake and is raised at once; a 2xx whose body is not JSON is raised at once.
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass
from typing import Any, Callable

import aiohttp

from dualvllm.errors import (
    MalformedResponseError,
    ServerError,
    ServerInternalError,
    ServerRejectedError,
    ServerTimeoutError,
    ServerUnavailableError,
)

# Backoff never sleeps longer than this between two tries: a server that stays down for
# longer is better reported than waited on.
MAX_BACKOFF_S = 10.0


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
    on_retry: Callable[[ServerError], None] | None = None,
) -> Any:
    """Send one JSON request with the session's timeout, retrying what is worth retrying."""
    attempt = 0
    while True:
        try:
            return await _request_once(session, method, url, server=server, payload=payload)
        except ServerError as err:
            if not err.retryable or attempt >= retry.max_retries:
                raise
            if on_retry is not None:
                on_retry(err)
            await asyncio.sleep(retry.delay_s(attempt))
            attempt += 1


async def _request_once(
    session: aiohttp.ClientSession, method: str, url: str, *, server: str, payload: Any
) -> Any:
    try:
        async with session.request(method, url, json=payload) as response:
            body = await response.text()
            status = response.status
    except asyncio.TimeoutError as exc:
        raise ServerTimeoutError(
            server, url, "no answer within the request timeout; raise request_timeout if the "
            "server is just slow (long contexts, large batches)"
        ) from exc
    except aiohttp.ClientError as exc:
        raise ServerUnavailableError(
            server, url, f"cannot reach the server ({type(exc).__name__}: {exc}); is it running?"
        ) from exc
    if status >= 500:
        raise ServerInternalError(server, url, status, body)
    if status >= 400:
        raise ServerRejectedError(server, url, status, body)
    if not body:
        return None
    try:
        return json.loads(body)
    except ValueError as exc:
        raise MalformedResponseError(
            server, url, f"expected JSON, got {body[:200]!r}"
        ) from exc


def expect(condition: bool, server: str, url: str, what: str) -> None:
    """Raise MalformedResponseError unless a response has the shape the API promises."""
    if not condition:
        raise MalformedResponseError(
            server, url, f"unexpected response: {what}; is this a vLLM OpenAI-compatible server "
            "of a supported version?"
        )

