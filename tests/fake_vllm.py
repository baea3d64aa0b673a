"""An in-process HTTP server that speaks the slice of vLLM's API dualvllm uses.

Unit tests run the real VLLMClient and coordinator against it over real loopback HTTP,
with a tiny synthetic model whose exact next-token distribution is known, and with
scripted failures (status codes, delays) to exercise retries and error isolation, and
rendezvous between two servers to prove that requests are in flight together.
It is a test double for unit tests only; integration tests use real vLLM servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator

import numpy as np
from aiohttp import web
from aiohttp.test_utils import TestServer

ALPHABET = "abcdefghijklmno"  # ids 1..15; id 0 is <eos>
VOCAB_SIZE = len(ALPHABET) + 1
EOS_ID = 0
EOS_TEXT = "<eos>"
FAKE_WEIGHTS_FILE = "fake_weights.json"  # what /collective_rpc reload_weights reads in weights_path
# How long a request held for a rendezvous waits for the other one: far beyond a step on
# loopback, so only a client that never sends the other request (it waits for this answer
# first) runs into it, and then gets a 500 instead of hanging the test.
RENDEZVOUS_TIMEOUT_S = 10.0


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


def write_fake_weights(directory: Path, seed: int) -> Path:
    """A checkpoint directory the fake's reload_weights switches to: FakeModel(seed=seed).

    It also holds what a real checkpoint does, a config.json and a model.safetensors (one
    tiny tensor), because every push checks them before it sends anything (dualvllm.engines.weights_dir).
    """
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / FAKE_WEIGHTS_FILE).write_text(json.dumps({"seed": seed}))
    (directory / "config.json").write_text(json.dumps({"model_type": "fake", "vocab_size": VOCAB_SIZE}))
    save_file({"seed": np.array([seed], dtype=np.int64)}, str(directory / "model.safetensors"))
    return directory


@dataclass
class Failure:
    status: int = 500  # 0 = no error answer: handle the request after the delay
    body: str = "injected failure"
    delay_s: float = 0.0
    after_handling: bool = False  # handle the request first (the server acts), then delay and answer
    arrived: asyncio.Event | None = None  # set when this request arrives (see rendezvous)
    meet: asyncio.Event | None = None  # hold this request until it is set, before anything else
    dies: bool = False  # the server stops once it answered (a crash): later requests find no one listening

    async def met(self) -> bool:
        """Mark this request arrived, then wait for the one it meets -> False if it never came."""
        if self.arrived is not None:
            self.arrived.set()
        if self.meet is None:
            return True
        try:
            await asyncio.wait_for(self.meet.wait(), RENDEZVOUS_TIMEOUT_S)
        except TimeoutError:
            return False
        return True


def rendezvous(first: Failure, second: Failure) -> tuple[Failure, Failure]:
    """`first` and `second` (for two servers), each held until the other's request has arrived:
    both answer only if the two requests are in flight together."""
    first_arrived, second_arrived = asyncio.Event(), asyncio.Event()
    return (dataclasses.replace(first, arrived=first_arrived, meet=second_arrived),
            dataclasses.replace(second, arrived=second_arrived, meet=first_arrived))


@dataclass
class FakeVLLM:
    model: FakeModel
    name: str = "fake"
    max_logprobs: int = 20
    api_key: str | None = None
    root: str | None = None  # the model directory /v1/models reports; None = a path that does not exist
    chat_template: bool = True  # /tokenize renders messages (their non-system texts, joined)
    completion_delay_s: float = 0.0  # every /v1/completions answer waits this long (a slow model)
    dtype: str | None = "float32"  # what dev-mode /server_info names; None = no such route (not dev mode)
    scale_out: bool = True  # /inference/v1/generate answers (vLLM's --enable-scale-out); False: a 403, as vLLM's
    world_size: int = 1  # what dev-mode /get_world_size answers (TP x PP x DP)
    weight_transfer_backend: str | None = "dualvllm_shm"  # /server_info's weight_transfer_config backend (None: none)
    # What collective_rpc dualvllm_weight_digest answers, on every rank (engines/vllm_plugin/worker_extension.py);
    # digest_extension False: the server was started without the extension (vLLM's "not implemented" 500).
    weight_digest: str | None = None
    digest_extension: bool = True
    failures: dict[str, deque[Failure]] = field(default_factory=lambda: defaultdict(deque))
    calls: dict[str, list[dict]] = field(default_factory=lambda: defaultdict(list))
    order: list[str] = field(default_factory=list)  # the path of every request, in arrival order
    # When each call of `calls` arrived (time.monotonic), for tests of schedules (retry intervals).
    call_times: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    running: asyncio.Event = field(default_factory=asyncio.Event)  # cleared between /pause and /resume
    server: TestServer | None = None
    _died: asyncio.Task | None = None  # the close a Failure(dies=True) started

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
        app.router.add_post("/inference/v1/generate", self._generate)
        app.router.add_post("/collective_rpc", self._collective_rpc)
        if self.dtype is not None:
            app.router.add_get("/server_info", self._server_info)
        app.router.add_post("/pause", self._pause)
        app.router.add_post("/resume", self._resume)
        app.router.add_post("/reset_prefix_cache", self._reset_prefix_cache)
        if self.dtype is not None:  # dev mode: vLLM's RL routes (the phases are recorded, nothing moves)
            app.router.add_get("/get_world_size", self._world_size)
            app.router.add_get("/weight_info", self._weight_info)
            for phase in ("init_weight_transfer_engine", "start_weight_update", "update_weights",
                          "finish_weight_update", "shutdown_weight_transfer_engine"):
                app.router.add_post(f"/{phase}", self._transfer_phase)
        self.running.set()
        self.server = TestServer(app, host="127.0.0.1")
        await self.server.start_server()

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()

    @property
    def dead(self) -> bool:
        """A Failure(dies=True) stopped this server, and it no longer listens."""
        return self._died is not None and self._died.done()

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        if self._died is not None:  # crashed, and still closing: drop the connection, as a dead server would
            assert request.transport is not None
            request.transport.close()
            return web.Response(status=503)
        body = await request.json() if request.can_read_body else None
        self.calls[request.path].append(body)
        self.call_times[request.path].append(time.monotonic())
        self.order.append(request.path)
        if request.path == "/v1/completions":
            await self.running.wait()  # like vLLM, generation waits while paused
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
            if failure.dies:
                self._died = asyncio.create_task(self.close())  # stops listening; this answer still goes out
            if not await failure.met():
                return web.Response(status=500, text="rendezvous timed out: the other server never got its "
                                                     "request (were the two calls sent one after the other?)")
            if failure.after_handling:
                response = await handler(request)
                await asyncio.sleep(failure.delay_s)
                return web.Response(status=failure.status, text=failure.body) if failure.status else response
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
        body = await request.json()
        if "messages" in body:  # like vLLM: the chat rendered with the model's template
            if not self.chat_template:
                return web.Response(status=400, text="As of transformers v4.44, default chat template is no "
                                                     "longer allowed, so you must provide a chat template")
            text = "".join(m["content"] for m in body["messages"] if m["role"] != "system")
            return web.json_response({"tokens": tokenize(text), "count": len(text)})
        text = body["prompt"]
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

    async def _server_info(self, request: web.Request) -> web.Response:
        # vLLM dumps its config with fallback=str, so the dtype reads "torch.bfloat16".
        return web.json_response({"vllm_config": {"model_config": {"dtype": f"torch.{self.dtype}",
                                                                   "logprobs_mode": "raw_logprobs"},
                                                  "weight_transfer_config": None if self.weight_transfer_backend is None
                                                  else {"backend": self.weight_transfer_backend},
                                                  "parallel_config": {"data_parallel_size": 1}, "lora_config": None},
                                  "vllm_env": {}, "system_env": {}})

    async def _world_size(self, request: web.Request) -> web.Response:
        return web.json_response({"world_size": self.world_size})

    async def _weight_info(self, request: web.Request) -> web.Response:
        finished = [b for b in self.calls["/finish_weight_update"] if b]
        return web.json_response({"weight_version": finished[-1].get("weight_version") if finished else None})

    async def _transfer_phase(self, request: web.Request) -> web.Response:
        return web.json_response({"message": f"{request.path} done"})

    async def _collective_rpc(self, request: web.Request) -> web.Response:
        """reload_weights: the model becomes the one write_fake_weights put in weights_path; and the digest
        extension's method."""
        body = await request.json()
        if body.get("method") == "dualvllm_weight_digest" and self.digest_extension:
            return web.json_response({"results": [self.weight_digest] * self.world_size})
        if body.get("method") != "reload_weights":  # vLLM's answer for a method its worker lacks
            return web.json_response({"error": {"message": "Call to collective_rpc method failed: Method "
                                                           f"{body.get('method')!r} is not implemented.",
                                                "type": "InternalServerError", "code": 500}}, status=500)
        try:
            weights = json.loads((Path(body["kwargs"]["weights_path"]) / FAKE_WEIGHTS_FILE).read_text())
        except (KeyError, OSError) as err:
            return web.Response(status=500, text=f"reload_weights failed: {err!r}")
        self.model = dataclasses.replace(self.model, seed=weights["seed"])
        return web.json_response({"results": [None]})

    async def _pause(self, request: web.Request) -> web.Response:
        self.running.clear()
        return web.json_response({"status": "paused"})

    async def _resume(self, request: web.Request) -> web.Response:
        self.running.set()
        return web.json_response({"status": "resumed"})

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        return web.json_response({"success": True})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        await asyncio.sleep(self.completion_delay_s)
        k = body.get("logprobs") or 0  # like vLLM: no logprobs asked, none returned
        if k > self.max_logprobs:
            return web.Response(status=400, text=f"Requested sample logprobs of {k}, which is "
                                                 f"greater than max allowed: {self.max_logprobs}")
        scored = body.get("prompt_logprobs")
        if scored is not None and (scored == -1 or scored > self.max_logprobs):
            return web.Response(status=400, text=f"Requested prompt logprobs of {scored}, which is greater than "
                                                 f"max allowed: {self.max_logprobs}")
        prompts = body["prompt"]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):  # a single prompt
            prompts = [prompts]
        prompts = [tokenize(p) if isinstance(p, str) else p for p in prompts]
        # Like vLLM: logprob keys are the token's text unless ids were asked for.
        key = (lambda t: f"token_id:{t}") if body.get("return_tokens_as_token_ids") else token_text
        max_tokens = body.get("max_tokens", 1)
        if body.get("echo"):
            if max_tokens != 0:
                return web.Response(status=400, text="the fake echoes prompts only with max_tokens 0")
            return web.json_response({"choices": [self._echo(index, prompt, k, key)
                                                  for index, prompt in enumerate(prompts)]})
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
            choices.append({"index": index, "text": "", "finish_reason": "length",
                            "logprobs": {"tokens": tokens, "top_logprobs": tops} if k else None})
            if body.get("prompt_logprobs") is not None:
                choices[-1]["prompt_logprobs"] = self._prompt_logprobs(context, body["prompt_logprobs"])
        if body.get("stream"):  # like vLLM: server-sent events, one chunk per choice here, then [DONE]
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for choice in choices:
                await response.write(b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        return web.json_response({"choices": choices})

    async def _generate(self, request: web.Request) -> web.Response:
        """vLLM's token-in token-out route, as far as scoring uses it: prompt_logprobs of one prompt."""
        if not self.scale_out:
            return web.Response(status=403, text="Scale-out endpoints are disabled. Restart vllm serve with "
                                                 "--enable-scale-out to enable them.")
        body = await request.json()
        params = body["sampling_params"]
        k = params.get("prompt_logprobs")
        if k is not None and (k == -1 or k > self.max_logprobs):
            return web.Response(status=400, text=f"Requested prompt logprobs of {k}, which is greater than "
                                                 f"max allowed: {self.max_logprobs}")
        rows = self._prompt_logprobs(body["token_ids"], k) if k is not None else None
        if rows is not None and params.get("detokenize") is False:  # like vLLM: no text for any entry
            for row in rows[1:]:
                for entry in row.values():
                    entry["decoded_token"] = None
        return web.json_response({"request_id": "generate-tokens-0", "choices": [{"index": 0, "token_ids": [0]}],
                                  "prompt_logprobs": rows})

    def _echo(self, index: int, prompt: list[int], k: int, key) -> dict:
        """vLLM's prompt logprobs (echo, max_tokens 0): None at position 0, then the top k before
        each prompt token and that token's own logprob (a (k+1)-th entry outside the top k)."""
        tops: list[dict | None] = [None]
        for j in range(1, len(prompt)):
            logprobs = self.model.logprobs(prompt[:j])
            entries = {key(int(t)): float(logprobs[t]) for t in np.argsort(-logprobs)[:k]}
            entries.setdefault(key(prompt[j]), float(logprobs[prompt[j]]))
            tops.append(entries)
        return {"index": index, "text": detokenize(prompt), "finish_reason": "length",
                "logprobs": {"tokens": [key(t) for t in prompt], "token_logprobs": [None] + [
                    row[key(t)] for row, t in zip(tops[1:], prompt[1:])], "top_logprobs": tops} if k else None}

    def _prompt_logprobs(self, prompt: list[int], k: int) -> list[dict | None]:
        """vLLM's `prompt_logprobs`: None, then per position {"<id>": {logprob, rank, decoded_token}}
        over the top k (-1: all) and the position's own token at its true rank (1 = likeliest)."""
        rows: list[dict | None] = [None]
        for j in range(1, len(prompt)):
            logprobs = self.model.logprobs(prompt[:j])
            order = np.argsort(-logprobs, kind="stable")
            ranks = np.empty_like(order)
            ranks[order] = np.arange(1, len(order) + 1)
            chosen = [*(order if k == -1 else order[:k]), prompt[j]]
            rows.append({str(int(t)): {"logprob": float(logprobs[t]), "rank": int(ranks[t]),
                                       "decoded_token": token_text(int(t))} for t in chosen})
        return rows

    def _sample(self, logprobs: np.ndarray, body: dict, rng: np.random.Generator) -> int:
        """vLLM's sampler: argmax at temperature 0, else softmax(lp/T) over the top_k (0 = all)."""
        temperature = body.get("temperature", 1.0)
        if temperature == 0:
            return int(np.argmax(logprobs))
        allowed = np.argsort(-logprobs)[:body.get("top_k") or len(logprobs)]
        scaled = logprobs[allowed] / temperature
        return int(rng.choice(allowed, p=np.exp(scaled - np.logaddexp.reduce(scaled))))


@contextlib.asynccontextmanager
async def running_fakes(*models: FakeModel) -> AsyncIterator[list[FakeVLLM]]:
    """A started FakeVLLM per model (named fake-teacher for seed 2, fake-base otherwise), closed on the way out."""
    started = [FakeVLLM(m, name="fake-base" if m.seed != 2 else "fake-teacher") for m in models]
    for server in started:
        await server.start()
    try:
        yield started
    finally:
        for server in started:
            await server.close()
