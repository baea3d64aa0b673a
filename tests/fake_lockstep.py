"""An in-process fake of a vLLM server that runs the dualvllm lockstep plugin.

It stands in for a VLLMClient in LockstepScheduler unit tests: the scheduler calls
`forced_generation` (one long request per sequence and server) and `detokenize`, and the
fake talks back over a real TCP connection to the scheduler's LockstepChannel with
the real wire format (engines/vllm_plugin/wire.py), as engines/vllm_plugin/processor.py
does inside vLLM.

What it simulates of a vLLM engine, one decode step at a time:
- admission: the front end takes a request in `accept_delay_s` after it is sent (then its
  `on_accepted` is called, as VLLMClient calls it when vLLM's streamed answer starts), it
  reaches the engine `arrival_delay_s` later, then waits in a queue until an admission
  policy (`admit`) moves it into the running batch at the start of a step; the default admits everything at once, tests pass
  policies that admit some requests late (a busy server, a limited batch);
- a step: for every running lockstep request, one row of ONE report per coordinator
  address: the request's lockstep id, its position (offset + tokens generated so far,
  counted here as the plugin counts them) and a deterministic synthetic top-k
  (FakeModel: it depends only on the model's seed and the request's full context, so a
  request resubmitted with its agreed tokens appended sees the same distributions);
- the wait for the reply (bounded by `reply_timeout_s`, a number or a function of the
  server, as the plugin's
  DUALVLLM_LOCKSTEP_TIMEOUT_S: on timeout the rows are ended and the connection is dropped
  and opened again, exactly as the plugin does);
- the forced tokens: a token is appended; END appends the request's stop token and ends
  it ("stop"); the stop token chosen as an ordinary token also ends it ("stop", vLLM's
  stop_token_ids); reaching max_tokens ends it ("length").
Scripted misbehaviour: `hold_after` (the engine stops after that step until `release()`, for a
crash or a pause at a known point), `crash()` (every request breaks, then connections and /health are
refused until `down` is cleared), and hooks on the request: `end_when` (the server ends a request
on its own, "length"), `fail_when` (the request fails with a ServerUnavailableError),
`position_skew` (a wrong position in a report). `plugin=False` is a server without the
plugin (it generates on its own and never reports); `flags` and `capacity` (the server's
max_num_seqs) are put in every report, with wire.FLAG_SHARED where the plugin would set it
(several coordinators). The admission policy is separate from `capacity`,
so a test can also simulate a server whose batch is full of other clients' work.
"""

from __future__ import annotations

import asyncio
import struct
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
from urllib.parse import urlsplit

from dualvllm.common.errors import ServerConnectError, ServerUnavailableError
from dualvllm.engines.vllm_plugin import wire
from dualvllm.engines.vllm_plugin.link import shared

VOCAB_SIZE = 32
EOS_ID = 0  # also the stop token the scheduler forces to end a request


@dataclass(frozen=True)
class FakeModel:
    """A synthetic next-token distribution over VOCAB_SIZE ids, a function of (seed, context).

    EOS never appears in the top-k (its logit is -inf), except after a context for which
    `eos_when(context)` holds: there EOS dominates (probability ~1 - 1e-8).
    """

    seed: int
    eos_when: Callable[[tuple[int, ...]], bool] | None = None

    def topk(self, context: Sequence[int], k: int) -> tuple[np.ndarray, np.ndarray]:
        """(token ids int32 [k], raw logprobs float32 [k]), best first."""
        context = tuple(int(c) for c in context)
        rng = np.random.default_rng([self.seed, len(context), *context])
        logits = rng.normal(scale=2.0, size=VOCAB_SIZE)
        if self.eos_when is not None and self.eos_when(context):
            logits[EOS_ID] = logits.max() + 20.0
        else:
            logits[EOS_ID] = -np.inf
        logprobs = logits - np.logaddexp.reduce(logits)
        order = np.argsort(-logprobs, kind="stable")[:k]
        return order.astype(np.int32), logprobs[order].astype(np.float32)


@dataclass(eq=False)
class FakeRequest:
    """One lockstep completion request as the fake server holds it."""

    prompt: list[int]
    max_tokens: int
    stop_token: int
    args: dict[str, int | str]
    generated: list[int] = field(default_factory=list)
    answers: list[tuple[int, int]] = field(default_factory=list)  # (position reported, token or END replied)
    finish: str | None = None  # "stop", "length", "error"; "cancelled" if the client gave up on it
    future: asyncio.Future | None = None

    @property
    def address(self) -> str:
        return str(self.args[wire.ARG_ADDRESS])

    @property
    def id(self) -> int:
        return int(self.args[wire.ARG_ID])

    @property
    def offset(self) -> int:
        return int(self.args[wire.ARG_OFFSET])

    @property
    def top_k(self) -> int:
        return int(self.args[wire.ARG_TOP_K])

    @property
    def key(self) -> int:
        """Which test sequence this is: tests give each sequence a distinct first prompt token,
        which every resubmission (prompt + agreed tokens) keeps."""
        return self.prompt[0]


def admit_all(server: "FakeLockstepServer", queued: list[FakeRequest]) -> list[FakeRequest]:
    return queued


async def read_message(reader: asyncio.StreamReader) -> bytes:
    """The next whole lockstep message of a stream (its frame header included)."""
    header = await reader.readexactly(wire.FRAME.size)
    return header + await reader.readexactly(wire.message_length(header) - wire.FRAME.size)


class _Link:
    """The plugin's connection to one coordinator (engines/vllm_plugin/link.py, on asyncio
    streams), with its step counter."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.step = 0
        self.last_report = float("-inf")  # as the plugin's: what wire.FLAG_SHARED is told from
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def send(self, message: bytes) -> None:
        """Send, connecting first if need be; a coordinator that cannot be reached gets nothing
        (and `receive` then answers None at once, as the plugin ends the rows)."""
        try:
            if self._streams is None:
                parts = urlsplit(self.address)
                self._streams = await asyncio.open_connection(parts.hostname, parts.port)
            self._streams[1].write(message)
        except OSError:
            self.close()

    async def receive(self, timeout_s: float) -> np.ndarray | None:
        """The reply to this step's report, or None after `timeout_s` or a closed connection
        (then the connection is dropped)."""
        if self._streams is None:
            return None
        reader = self._streams[0]
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    step, tokens = wire.decode_reply(await read_message(reader))
                    if step == self.step:
                        return tokens
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            self.close()
            return None

    def close(self) -> None:
        if self._streams is not None:
            self._streams[1].close()
            self._streams = None


class FakeLockstepServer:
    """A fake vLLM server with the lockstep plugin (see the module docstring)."""

    def __init__(self, name: str, model: FakeModel, *,
                 admit: Callable[["FakeLockstepServer", list[FakeRequest]], list[FakeRequest]] = admit_all,
                 plugin: bool = True, flags: int = 0, capacity: int = 256, wire_version: int = wire.VERSION,
                 reply_timeout_s: float | Callable[["FakeLockstepServer"], float] = 20.0,
                 accept_delay_s: float = 0.0,
                 arrival_delay_s: float = 0.0,
                 end_when: Callable[[FakeRequest], bool] | None = None,
                 fail_when: Callable[[FakeRequest], bool] | None = None,
                 position_skew: Callable[[FakeRequest], int] | None = None) -> None:
        self.name = name
        self.url = f"http://fake-{name}.invalid:8000"
        self.model = model
        self.admit = admit
        self.plugin = plugin
        self.flags = flags
        self.wire_version = wire_version  # another version: a server with another dualvllm's plugin
        self.capacity = capacity
        self.reply_timeout_s = reply_timeout_s
        self.accept_delay_s = accept_delay_s
        self.arrival_delay_s = arrival_delay_s
        self.end_when = end_when
        self.fail_when = fail_when
        self.position_skew = position_skew
        self.requests: list[FakeRequest] = []  # every request received, in order
        self.queue: list[FakeRequest] = []  # received, not admitted yet
        self.running: list[FakeRequest] = []  # the batch, in row order
        self.steps = 0  # decode steps run (each sends one report per coordinator)
        self.timeouts = 0  # reports whose reply did not come within reply_timeout_s
        self.down = False  # /health fails while set (a server restarting)
        self.hold_after: int | None = None  # the engine stops after this many steps, until release() or crash()
        self.holding = asyncio.Event()  # set once it stopped there
        self._released = asyncio.Event()
        self.health_checks = 0
        self._links: dict[str, _Link] = {}
        self._wake = asyncio.Event()
        self._loop: asyncio.Task[None] | None = None

    # -- what LockstepScheduler calls --------------------------------------------------

    async def forced_generation(self, prompt_ids: Sequence[int], *, max_tokens: int, stop_token: int,
                                lockstep_args: dict[str, int | str],
                                on_accepted: Callable[[], None] | None = None) -> str:
        if self.down:
            raise ServerConnectError(self.name, self.url, "connection refused (simulated restart)")
        request = FakeRequest(list(prompt_ids), max_tokens, stop_token, dict(lockstep_args))
        self.requests.append(request)
        if self.fail_when is not None and self.fail_when(request):
            request.finish = "error"
            raise ServerUnavailableError(self.name, self.url, "connection reset (simulated)")
        if not self.plugin:  # vLLM without the processor: it samples max_tokens tokens itself
            request.generated = [1] * max_tokens
            request.finish = "length"
            return "length"
        request.future = asyncio.get_running_loop().create_future()
        try:
            if self.accept_delay_s:
                await asyncio.sleep(self.accept_delay_s)
            if on_accepted is not None:
                on_accepted()
            if self.arrival_delay_s:
                await asyncio.sleep(self.arrival_delay_s)
            self.queue.append(request)
            self._wake.set()
            if self._loop is None:
                self._loop = asyncio.create_task(self._run(), name=f"fake-{self.name}-engine")
            return await request.future
        except asyncio.CancelledError:  # the client gave up: vLLM aborts the request
            request.finish = request.finish or "cancelled"
            if request in self.queue:
                self.queue.remove(request)
            if request in self.running:
                self.running.remove(request)
            raise

    async def health(self) -> None:
        """As VLLMClient.health: raises while `down` (a replica pool's prober asks this)."""
        self.health_checks += 1
        if self.down:
            raise ServerUnavailableError(self.name, self.url, "GET /health: connection refused (simulated)")

    async def wait_healthy(self, timeout_s: float, poll_s: float = 0.01) -> None:
        """As VLLMClient.wait_healthy: returns once `down` is cleared, raises after `timeout_s`."""
        self.health_checks += 1
        deadline = time.monotonic() + timeout_s
        while self.down:
            if time.monotonic() >= deadline:
                raise ServerUnavailableError(self.name, self.url, "GET /health: connection refused (simulated)")
            await asyncio.sleep(poll_s)

    async def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(i) for i in ids)

    # -- the engine loop ---------------------------------------------------------------

    async def _run(self) -> None:
        try:
            while True:
                if not self.queue and not self.running:
                    self._wake.clear()
                    await self._wake.wait()
                await asyncio.sleep(0)  # requests sent together arrive before the step starts
                for request in list(self.admit(self, list(self.queue))):
                    self.queue.remove(request)
                    self.running.append(request)
                if not self.running:  # the policy held everything back: an idle engine tick
                    await asyncio.sleep(0.002)
                    continue
                await self._step()
                if self.hold_after is not None and self.steps >= self.hold_after:
                    self.holding.set()
                    await self._released.wait()  # (or crash() cancels the loop)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a bug in the fake: fail its requests loudly
            for request in self.queue + self.running:
                if request.future is not None and not request.future.done():
                    request.future.set_exception(exc)
            raise

    async def _step(self) -> None:
        self.steps += 1
        by_address: dict[str, list[FakeRequest]] = {}
        for request in self.running:
            by_address.setdefault(request.address, []).append(request)
        asked = []
        now = time.monotonic()
        flags = self.flags | (wire.FLAG_SHARED if shared(self._links, by_address, now) else 0)
        for address, members in by_address.items():
            k = min(max(r.top_k for r in members), VOCAB_SIZE)
            positions = [r.offset + len(r.generated) + (self.position_skew(r) if self.position_skew else 0)
                         for r in members]
            tops = [self.model.topk(r.prompt + r.generated, k) for r in members]
            link = self._links.get(address) or self._links.setdefault(address, _Link(address))
            link.step += 1
            link.last_report = now
            report = wire.encode_report(
                link.step, flags, self.capacity, np.array([r.id for r in members], dtype=np.int64),
                np.array(positions, dtype=np.int64), np.stack([ids for ids, _ in tops]),
                np.stack([logprobs for _, logprobs in tops]))
            if self.wire_version != wire.VERSION:  # the report header's first field
                report = report[:wire.FRAME.size] + struct.pack("<I", self.wire_version) + report[wire.FRAME.size + 4:]
            await link.send(report)
            asked.append((link, members, positions))
        for link, members, positions in asked:
            timeout_s = self.reply_timeout_s(self) if callable(self.reply_timeout_s) else self.reply_timeout_s
            tokens = await link.receive(timeout_s)
            if tokens is None or len(tokens) != len(members):
                self.timeouts += 1
                tokens = np.full(len(members), wire.END, dtype=np.int64)
            for request, position, token in zip(members, positions, tokens.tolist()):
                self._apply(request, position, token)

    def _apply(self, request: FakeRequest, position: int, token: int) -> None:
        if request.finish == "cancelled":  # aborted by its client while the step ran
            return
        request.answers.append((position, token))
        if token == wire.END or not 0 <= token < VOCAB_SIZE:
            request.generated.append(request.stop_token)
            self._end(request, "stop")
            return
        request.generated.append(token)
        if token == request.stop_token:
            self._end(request, "stop")
        elif len(request.generated) >= request.max_tokens:
            self._end(request, "length")
        elif self.end_when is not None and self.end_when(request):
            self._end(request, "length")
        elif self.fail_when is not None and self.fail_when(request):
            self._end(request, "error")

    def _end(self, request: FakeRequest, finish: str) -> None:
        request.finish = finish
        if request in self.running:
            self.running.remove(request)
        assert request.future is not None
        if request.future.done():
            return
        if finish == "error":
            request.future.set_exception(ServerUnavailableError(self.name, self.url, "connection reset (simulated)"))
        else:
            request.future.set_result(finish)

    # -- test helpers ------------------------------------------------------------------

    def release(self) -> None:
        """The engine held by `hold_after` runs on."""
        self.hold_after = None
        self._released.set()

    async def crash(self) -> None:
        """The server dies: every request it holds breaks, and it refuses connections and
        fails /health until `down` is cleared (restarted: empty, as a new process is)."""
        self.down = True
        self.hold_after = None
        if self._loop is not None:
            self._loop.cancel()
            await asyncio.gather(self._loop, return_exceptions=True)
            self._loop = None
        for request in self.queue + self.running:
            self._end(request, "error")
        self.queue.clear()
        for link in self._links.values():
            link.close()
        self._links = {}

    @property
    def idle(self) -> bool:
        """No request queued or running, and every request received has ended."""
        return not self.queue and not self.running and all(r.finish is not None for r in self.requests)

    def requests_of(self, key: int) -> list[FakeRequest]:
        return [r for r in self.requests if r.key == key]

    async def close(self) -> None:
        if self._loop is not None:
            self._loop.cancel()
            try:
                await self._loop
            except asyncio.CancelledError:
                pass
        for link in self._links.values():
            link.close()
