"""The reference implementation's serving protocol, re-implemented to measure against.

Every sequence runs on its own: for each token it sends its full text (prompt + text
generated so far) to each server in a request of its own (`max_tokens` 1, `logprobs` k,
temperature 0), to both servers at once, over one pooled aiohttp session per server; the
top-k comes back keyed by token text; the coordinator merges that one row, solves alpha*,
samples (coordinator/step.py::mix_and_sample, so the math is the same as ours) and
appends the token's text. All sequences run concurrently. What differs from the
coordinator is the protocol: text re-sent and re-tokenized every token, and 2B requests
per token instead of 2.

Used by benchmarks/throughput.py; not part of the product.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import aiohttp
import numpy as np

from dualvllm.coordinator.step import mix_and_sample
from dualvllm.common.errors import LifecycleError, MalformedResponseError
from dualvllm.engines.protocol import PAD_TOKEN_ID, TopKBatch

ALPHA_TOL = 1e-6
ALPHA_MAX_ITER = 20


@dataclass
class ReferenceOutput:
    text: str  # generated text only
    tokens: list[str] = field(default_factory=list)  # token texts, as the servers keyed them
    alphas: list[float] = field(default_factory=list)


class ReferenceProtocolClient:
    """Per-sequence, per-token, full-text requests to two vLLM servers (see module doc)."""

    def __init__(self, theta_url: str, t_url: str, *, top_k: int, pool_size: int = 64,
                 request_timeout_s: float = 120.0) -> None:
        self._urls = (theta_url.rstrip("/"), t_url.rstrip("/"))
        self._top_k = top_k
        self._pool_size = pool_size
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self._sessions: tuple[aiohttp.ClientSession, aiohttp.ClientSession] | None = None
        self._models: tuple[str, str] = ("", "")
        # Token text <-> a local id, so the two servers' lists can be merged by id.
        self._ids: dict[str, int] = {}
        self._texts: list[str] = []
        self.requests = 0

    async def __aenter__(self) -> ReferenceProtocolClient:
        if self._sessions is not None:
            raise LifecycleError("a ReferenceProtocolClient can be entered once")
        theta, t = (aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self._pool_size), timeout=self._timeout)
                    for _ in self._urls)
        self._sessions = (theta, t)
        self._models = (await self._model_name(theta, self._urls[0]), await self._model_name(t, self._urls[1]))
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._sessions is not None:
            for session in self._sessions:
                await session.close()

    async def _model_name(self, session: aiohttp.ClientSession, url: str) -> str:
        async with session.get(url + "/v1/models") as response:
            response.raise_for_status()
            return (await response.json())["data"][0]["id"]

    async def generate(self, prompts: list[str], max_tokens: int, seed: int) -> list[ReferenceOutput]:
        """`max_tokens` tokens for every prompt (EOS does not stop a sequence: fixed lengths)."""
        return list(await asyncio.gather(*(self._sequence(p, max_tokens, np.random.default_rng([seed, i]))
                                            for i, p in enumerate(prompts))))

    async def _sequence(self, prompt: str, max_tokens: int, rng: np.random.Generator) -> ReferenceOutput:
        out = ReferenceOutput(text="")
        for _ in range(max_tokens):
            theta, t = await asyncio.gather(self._topk(0, prompt + out.text), self._topk(1, prompt + out.text))
            step = mix_and_sample(theta, t, temperature=np.ones(1), fixed_alpha=np.full(1, np.nan),
                                  uniforms=np.array([rng.random()]), fill="min",
                                  alpha_tol=ALPHA_TOL, alpha_max_iter=ALPHA_MAX_ITER)
            token = self._texts[int(step.token_ids[0])]
            out.tokens.append(token)
            out.alphas.append(float(step.alpha[0]))
            out.text += token
        return out

    async def _topk(self, server: int, text: str) -> TopKBatch:
        assert self._sessions is not None, "use `async with ReferenceProtocolClient(...)`"
        payload = {"model": self._models[server], "prompt": text, "max_tokens": 1,
                   "logprobs": self._top_k, "temperature": 0.0}
        self.requests += 1
        async with self._sessions[server].post(self._urls[server] + "/v1/completions", json=payload) as response:
            response.raise_for_status()
            body = await response.json()
        try:
            entries = body["choices"][0]["logprobs"]["top_logprobs"][0]
        except (KeyError, IndexError, TypeError) as exc:
            raise MalformedResponseError(f"server {server}", self._urls[server], "no top_logprobs") from exc
        width = self._top_k + 1
        ids = np.full((1, width), PAD_TOKEN_ID, dtype=np.int64)
        logprobs = np.full((1, width), -np.inf)
        for j, (token, logprob) in enumerate(list(entries.items())[:width]):
            if token not in self._ids:
                self._ids[token] = len(self._texts)
                self._texts.append(token)
            ids[0, j] = self._ids[token]
            logprobs[0, j] = logprob
        return TopKBatch(ids, logprobs)
