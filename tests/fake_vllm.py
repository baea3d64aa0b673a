"""An in-process HTTP server that speaks the slice of vLLM's API dualvllm uses.

Unit tests run the real VLLMClient and coordinator against it over real loopback HTTP,
with a tiny synthetic model whose exact next-token distribution is known, and with
scripted failures (status codes, delays) to exercise retries and error isolation.
It is a test double for unit tests only; integration tests use real vLLM servers.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict, deque
from dataclasses import dataclass, field

import numpy as np
from aiohttp import web
from aiohttp.test_utils import TestServer

ALPHABET = "abcdefghijklmno"  # ids 1..15; id 0 is <eos>
VOCAB_SIZE = len(ALPHABET) + 1
EOS_ID = 0
EOS_TEXT = "<eos>"


def tokenize(text: str) -> list[int]:
    """Character ids; the EOS token's text reads back as EOS, as vLLM's special tokens do."""
    ids: list[int] = []
    for n, part in enumerate(text.split(EOS_TEXT)):
        if n:
            ids.append(EOS_ID)
        ids.extend(ALPHABET.index(c) + 1 for c in part)
    return ids


def token_text(token_id: int) -> str:
    """One token's text as a logprobs key (vLLM without return_tokens_as_token_ids)."""
    return EOS_TEXT if token_id == EOS_ID else ALPHABET[token_id - 1]


def detokenize(ids: list[int]) -> str:
    return "".join(ALPHABET[i - 1] for i in ids if i != EOS_ID)


@dataclass
class FakeModel:
    """Next-token logprobs that depend on (seed, context length, last token) only."""

    seed: int
    eos_after: int = 6  # EOS becomes likely once the context is this long
    max_model_len: int = 64

    def logprobs(self, context: list[int]) -> np.ndarray:
        rng = np.random.default_rng([self.seed, len(context), context[-1]])
        logits = rng.normal(0.0, 1.5, VOCAB_SIZE)
        logits[EOS_ID] = 3.0 if len(context) >= self.eos_after else -3.0
        return logits - np.logaddexp.reduce(logits)


@dataclass
class Failure:
    status: int = 500
    body: str = "injected failure"
    delay_s: float = 0.0


@dataclass
class FakeVLLM:
    model: FakeModel
    name: str = "fake"
    max_logprobs: int = 20
    api_key: str | None = None
    root: str | None = None  # the model directory /v1/models reports; None = a path that does not exist
    failures: dict[str, deque[Failure]] = field(default_factory=lambda: defaultdict(deque))
    calls: dict[str, list[dict]] = field(default_factory=lambda: defaultdict(list))
    server: TestServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return str(self.server.make_url("")).rstrip("/")

    def fail_next(self, path: str, *failures: Failure) -> None:
        self.failures[path].extend(failures)

    async def start(self) -> None:
        app = web.Application(middlewares=[self._middleware])
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_get("/tokenizer_info", self._tokenizer_info)
        app.router.add_post("/v1/completions", self._completions)
        self.server = TestServer(app, host="127.0.0.1")
        await self.server.start_server()

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        body = await request.json() if request.can_read_body else None
        self.calls[request.path].append(body)
        if self.api_key and request.path.startswith("/v1") and \
                request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.Response(status=401, text="Unauthorized")
        if isinstance(body, dict) and "model" in body and body["model"] != self.name:
            # vLLM's answer to a model name it does not serve.
            return web.json_response({"error": {"message": f"The model `{body['model']}` does not exist.",
                                                "type": "NotFoundError", "code": 404}}, status=404)
        queue = self.failures.get(request.path)
        if queue:
            failure = queue.popleft()
            await asyncio.sleep(failure.delay_s)
            if failure.status:
                return web.Response(status=failure.status, text=failure.body)
        return await handler(request)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": self.name, "root": self.root or f"/nonexistent/{self.name}",
                                            "max_model_len": self.model.max_model_len}]})

    async def _tokenize(self, request: web.Request) -> web.Response:
        text = (await request.json())["prompt"]
        if text == "<eos>":
            return web.json_response({"tokens": [EOS_ID], "count": 1})
        try:
            ids = tokenize(text)
        except ValueError:
            ids = [1 + (ord(c) % len(ALPHABET)) for c in text]  # the startup probes are free text
        return web.json_response({"tokens": ids, "count": len(ids)})

    async def _detokenize(self, request: web.Request) -> web.Response:
        return web.json_response({"prompt": detokenize((await request.json())["tokens"])})

    async def _tokenizer_info(self, request: web.Request) -> web.Response:
        return web.json_response({"tokenizer_class": "Fake", "eos_token": "<eos>"})

    async def _completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        k = body["logprobs"]
        if k > self.max_logprobs:
            return web.Response(status=400, text=f"Requested sample logprobs of {k}, which is "
                                                 f"greater than max allowed: {self.max_logprobs}")
        prompts = body["prompt"]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):  # a single prompt
            prompts = [prompts]
        prompts = [tokenize(p) if isinstance(p, str) else p for p in prompts]
        # Like vLLM: logprob keys are the token's text unless ids were asked for.
        key = (lambda t: f"token_id:{t}") if body.get("return_tokens_as_token_ids") else token_text
        max_tokens = body.get("max_tokens", 1)
        choices = []
        for index, context in enumerate(prompts):
            if len(context) + max_tokens > self.model.max_model_len:
                return web.Response(status=400, text="This model's maximum context length is exceeded")
            # Like vLLM, every prompt of a request gets a generator seeded with the request's seed.
            rng = np.random.default_rng(body.get("seed"))
            sequence, tokens, tops = list(context), [], []
            for _ in range(max_tokens):
                logprobs = self.model.logprobs(sequence)
                top = np.argsort(-logprobs)[:k]
                token = self._sample(logprobs, body, rng)
                entries = {key(int(t)): float(logprobs[t]) for t in top}
                entries.setdefault(key(token), float(logprobs[token]))
                tokens.append(key(token))
                tops.append(entries)
                sequence.append(token)
            choice = {"index": index, "text": "", "logprobs": {"tokens": tokens, "top_logprobs": tops}}
            if body.get("prompt_logprobs"):
                choice["prompt_logprobs"] = [None] + [
                    self._prompt_entries(context[:j], context[j], body["prompt_logprobs"])
                    for j in range(1, len(context))]
            choices.append(choice)
        return web.json_response({"choices": choices})

    def _sample(self, logprobs: np.ndarray, body: dict, rng: np.random.Generator) -> int:
        """vLLM's sampler: argmax at temperature 0, else softmax(lp/T) over the top_k (0 = all)."""
        temperature = body.get("temperature", 1.0)
        if temperature == 0:
            return int(np.argmax(logprobs))
        allowed = np.argsort(-logprobs)[:body.get("top_k") or len(logprobs)]
        scaled = logprobs[allowed] / temperature
        return int(rng.choice(allowed, p=np.exp(scaled - np.logaddexp.reduce(scaled))))

    def _prompt_entries(self, prefix: list[int], token: int, k: int) -> dict[str, dict]:
        """vLLM's prompt_logprobs entry: the top-k before `token`, plus `token` itself."""
        logprobs = self.model.logprobs(prefix)
        ranked = [int(t) for t in np.argsort(-logprobs)]
        chosen = dict.fromkeys([*ranked[:k], token])
        return {str(t): {"logprob": float(logprobs[t]), "rank": ranked.index(t) + 1,
                         "decoded_token": f"token_id:{t}"} for t in chosen}
