"""Lockstep mode: both servers decode natively, the coordinator picks every token.

Each sequence is one long completion request per server (a *stream*), tagged with this
coordinator's address, so the server's plugin (engines/vllm_plugin) asks here for the
token of every position. No request per token: vLLM's per-request work (front end,
scheduling set-up, logprob serialization) is paid once per sequence.

The state machine, per plugin report (one per server decode step):
- each row is (stream, position). A row at the sequence's next position waits until the
  other role's row for the same position has arrived; then the pair is decided with the
  per-token step's math (coordinator/step.py: merge, alpha*, sample) and both rows get
  the token, or END when that token finishes the sequence (EOS, stop token or string,
  max_tokens, context limit). Rows of finished, failed or unknown streams get END; a row
  at a position already decided (a preempted request come back) gets the same token.
- a report is answered when all of its rows are decided: the server waits for all of
  them anyway, so one server may run a step ahead of the other on some sequences.
- deadlock: every server with streams is waiting, and no report can be completed (server
  A waits on a sequence B has not admitted, while B waits on one A has not). It is exact:
  nothing else will arrive. The report with the fewest undecidable rows has those rows
  *parked*: answered END, which ends those requests, and resubmitted from their agreed
  tokens with the position offset. The prefix cache makes the resubmission cheap. A
  report left waiting longer than `lockstep_stall_timeout` on a server that is not waiting
  (its batch is full of other work) is parked the same way.
- a stream that the server ended on its own while its sequence goes on (its stop token
  sampled as an ordinary token, the server's max_tokens) is resubmitted the same way.
- a stream whose request broke (a connection reset, a server killed or restarting) takes
  its sequence off both servers. With another healthy replica of that role (replica
  pools, engines/pool.py), the server is marked down in its pool, every sequence on it
  is taken off too, and they all start again from their agreed tokens on the healthy
  replicas at once; the pool probes the server and lets it rejoin. Without one, they wait
  until that server answers /health again; a server that does not come back within
  `lockstep_restart_timeout` fails them. Any other request failure fails its sequence only.
- replica pools: each sequence is placed on one replica per role and stays there (its
  KV and prefix cache), on the one with the fewest sequences among those with room. A
  deadlock is then a set of waiting servers each of which waits on a row that must come
  from another in the set; pairs of servers that share no sequence deadlock and are
  parked independently.
- admission: new sequences start while both servers are blocked here, and the reports are
  answered a moment later, so that both servers admit them in the same step
  (coordinator/admission.py).

Positions are counted by the plugin from the offset of each request and checked here
against the sequence's agreed tokens; a mismatch fails that sequence, never silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator

import numpy as np

from common.errors import LifecycleError, LockstepUnavailableError, ServerError
from common.tasks import bounded, stop
from coordinator.admission import MAX_HOLD_S, AdmissionGate
from coordinator.config import CoordinatorConfig
from coordinator.delivery import Delivery
from coordinator.lockstep_setup import refusal
from coordinator.scheduler import record_rows, sample_rows
from coordinator.sequence import SequenceState
from coordinator.stats import Statistics, StepTiming
from engines.lockstep_channel import LockstepChannel
from engines.pool import ReplicaPool
from engines.protocol import TopKBatch
from engines.vllm_client import VLLMClient
from engines.vllm_plugin import wire

log = logging.getLogger("dualvllm.coordinator")

UNSET = -2  # a report row not decided yet
THETA, T = 0, 1
# A sequence whose requests the servers keep ending on their own this often has
# something wrong with it (a server restarting in a loop); it fails instead.
MAX_RESUBMISSIONS = 64
# A sequence's requests may break this often (each already retried per engines.http's
# rules) before it fails: a connection closing under a reused request is worth a resend,
# a server that stays down is not.
MAX_REQUEST_FAILURES = 3
# After close, reports are answered END for this long, so that no server waits out its
# plugin timeout on a coordinator that has gone.
DRAIN_S = 5.0
# close() waits at most this long for each of: the step in progress, its tasks to end, the
# last outputs' detokenization (an HTTP call, itself bounded by request_timeout).
CLOSE_STEP_S = 60.0


@dataclass(eq=False)
class _Blocked:
    """A server's report, waiting for its reply."""

    identity: bytes
    report: wire.Report
    answers: np.ndarray  # int64 [n], UNSET until decided
    arrived: float
    server: str | None  # the engine the rows belong to (None: no known rows)
    # The other server's reports whose rows were paired with these: more than one means that
    # server reported these sequences over several of its steps (one server ran ahead).
    partners: set["_Blocked"] = field(default_factory=set)


@dataclass(eq=False)
class _Live:
    """A sequence being generated in lockstep: its two streams and their waiting rows."""

    seq: SequenceState
    # The server of each role it runs on (a replica of the role's pool), kept while healthy.
    engines: list[VLLMClient | None] = field(default_factory=lambda: [None, None])
    streams: list["_Stream | None"] = field(default_factory=lambda: [None, None])
    rows: list[tuple[_Blocked, int] | None] = field(default_factory=lambda: [None, None])
    resubmissions: int = 0  # requests the servers ended on their own (parks are not counted)
    request_failures: int = 0  # requests that broke and were resent
    done: bool = False  # finished, failed or cancelled, and handed to delivery


@dataclass(eq=False)
class _Stream:
    """One lockstep request on one server."""

    id: int
    live: _Live
    role: int
    engine: VLLMClient
    offset: int
    retired: bool = False  # parked, ended or replaced: its rows get END, its end is expected
    # Done when the server has taken the request in (its answer started) or the request ended.
    accepted: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    def accept(self) -> None:
        if not self.accepted.done():
            self.accepted.set_result(None)


@dataclass
class LockstepCounters:
    reports: int = 0
    parks: int = 0  # rows parked to break a deadlock or a stall
    resubmissions: int = 0  # requests resent from their agreed tokens (parks, early ends)
    split_reports: int = 0  # replied reports whose rows the other server sent over 2+ of its steps
    suspensions: int = 0  # sequences taken off both servers (a broken request, a pause) and restarted
    wait_s: float = 0.0  # summed time reports waited here for their reply
    replies: int = 0

    def summary(self, tokens: int) -> dict[str, float]:
        per_1k = 1000.0 / tokens if tokens else float("nan")
        return {
            "lockstep_reports": self.reports,
            "lockstep_parks": self.parks,
            "lockstep_suspensions": self.suspensions,
            "lockstep_resubmissions_per_1k_tokens": self.resubmissions * per_1k,
            "lockstep_split_report_share": self.split_reports / self.replies if self.replies else float("nan"),
            "lockstep_server_wait_ms_mean": 1e3 * self.wait_s / self.replies if self.replies else float("nan"),
        }


class LockstepScheduler:
    mode = "lockstep"

    def __init__(self, theta: VLLMClient | ReplicaPool, t: VLLMClient | ReplicaPool, *, config: CoordinatorConfig,
                 eos_ids: frozenset[int], max_len: int, stats: Statistics, channel: LockstepChannel,
                 stop_token: int, capacity: int | None = None, vocab_size: int | None = None) -> None:
        """`theta`/`t`: a server's client, or a ReplicaPool of its replicas' clients;
        `stop_token`: the token a stream's plugin forces to end it (an EOS id of both models);
        `capacity`: the most sequences one server runs at once (None: no limit but max_batch_size)."""
        self._pools = tuple(e if isinstance(e, ReplicaPool) else None for e in (theta, t))
        self._replicas: tuple[list[VLLMClient], list[VLLMClient]] = tuple(  # type: ignore[assignment]
            list(e.replicas) if isinstance(e, ReplicaPool) else [e] for e in (theta, t))
        self._config = config
        self._eos_ids = eos_ids
        self._max_len = max_len
        self._stats = stats
        self._channel = channel
        self._stop_token = stop_token
        self._vocab_size = vocab_size
        # More sequences than a server runs at once would wait in its queue while the other
        # server runs them: a park at every step.
        self._per_server = capacity or config.max_batch_size
        fewest = min(len(replicas) for replicas in self._replicas)
        self._max_live = min(config.max_batch_size, self._per_server * fewest)
        self._delivery = Delivery(theta, stats)
        self.counters = LockstepCounters()
        self._waiting: deque[SequenceState] = deque()
        self._suspended: deque[_Live] = deque()  # taken off a server that broke; first to start again
        self._recovering: set[str] = set()  # servers whose requests broke, until /health answers
        self._dead: dict[str, str] = {}  # servers that did not come back: why
        self._pauses = 0  # callers inside paused()
        self._live: list[_Live] = []
        self._streams: dict[int, _Stream] = {}
        self._requests: set[asyncio.Task[str]] = set()
        self._blocked: dict[bytes, _Blocked] = {}
        self._probes: dict[int, asyncio.Future[wire.Report]] = {}  # check_plugin's requests: their reports
        # Ids start at a random point: a plugin that still counts positions for a previous
        # coordinator on the same port must never mistake these streams for its old ones.
        self._ids = itertools.count(secrets.randbits(40) << 20)
        self._loop_task: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._closing = False
        self._last_decision: float | None = None
        # Every change of state (reports, stalls, ended requests) runs under this lock: a
        # decision awaits detokenization for stop strings, and nothing may move under it.
        self._lock = asyncio.Lock()
        self._background: set[asyncio.Task[None]] = set()
        self.gate = AdmissionGate()

    @property
    def max_len(self) -> int:
        return self._max_len

    @property
    def capacity(self) -> int:
        """Sequences in flight at once: max_batch_size, or fewer if the servers run fewer."""
        return self._max_live

    def statistics(self) -> dict[str, float]:
        return {**self.counters.summary(self._stats.tokens), **self.gate.counters.summary()}

    # -- placement on replicas ---------------------------------------------------------

    def _healthy(self, role: int) -> list[VLLMClient]:
        pool = self._pools[role]
        replicas = self._replicas[role]
        return replicas if pool is None else [replicas[i] for i in pool.healthy]

    def _loads(self, role: int) -> dict[str, int]:
        """Live sequences per server of `role`, healthy ones only."""
        loads = {engine.url: 0 for engine in self._healthy(role)}
        for live in self._live:
            engine = live.engines[role]
            if not live.done and engine is not None and engine.url in loads:
                loads[engine.url] += 1
        return loads

    def _has_slot(self) -> bool:
        return all(min(self._loads(role).values(), default=self._per_server) < self._per_server
                   for role in (THETA, T))

    def _place(self, live: _Live) -> None:
        """Keep `live` on its servers while they are healthy and have room; else the healthy
        replica of the role with the fewest sequences (its old one went down: a move)."""
        for role in (THETA, T):
            loads = self._loads(role)
            engine = live.engines[role]
            pool, replicas = self._pools[role], self._replicas[role]
            if pool is not None:  # the pool places, and counts the moves
                by_index = {i: loads[e.url] for i, e in enumerate(replicas) if e.url in loads}
                current = None if engine is None else replicas.index(engine)
                live.engines[role] = replicas[pool.assign(current, by_index, room=self._per_server)]
            elif engine is None:  # one server in this role
                live.engines[role] = replicas[0]

    async def check_plugin(self, engine: VLLMClient) -> None:
        """Raise LockstepUnavailableError unless `engine`'s plugin reports here, and its report
        passes the start-up probe's checks (chunked prefill off, room for the sequences this
        coordinator places on a server): a replica that rejoins its pool may have been restarted
        without the plugin, and would then decode its sequences natively (each ended on its own
        and resent, until it failed), or with settings the coordinator was not sized for."""
        self._listen()
        probe_id = next(self._ids)
        reported = self._probes[probe_id] = asyncio.get_running_loop().create_future()
        args = wire.request_args(wire.Tagged(self._channel.address, probe_id, offset=0, top_k=1, stop=self._stop_token))
        request = asyncio.create_task(engine.forced_generation(
            [self._stop_token], max_tokens=2, stop_token=self._stop_token, lockstep_args=args))
        try:
            await asyncio.wait({request, reported}, timeout=self._config.request_timeout,
                               return_when=asyncio.FIRST_COMPLETED)
            if reported.done():
                # The judgement the start-up probe makes (lockstep_setup.refusal), against what this
                # coordinator places on each server: a replica restarted with other settings stays out.
                roles = sum(engine.url in {e.url for e in replicas} for replicas in self._replicas)
                reason = refusal(reported.result(), roles * min(self._per_server, self._config.max_batch_size))
                if reason is not None:
                    raise LockstepUnavailableError(f"{engine.name} server at {engine.url}: {reason}")
                return
            if request.done():
                request.result()  # a refusal raises its ServerError
                raise LockstepUnavailableError(
                    f"{engine.name} server at {engine.url} answered a lockstep request without asking for its tokens: "
                    "it runs without the dualvllm lockstep plugin (restart it with `dualvllm serve --lockstep`)")
            raise LockstepUnavailableError(f"{engine.name} server at {engine.url}: its lockstep probe got no answer "
                                           f"within {self._config.request_timeout:g} s")
        finally:
            del self._probes[probe_id]
            request.cancel()
            await asyncio.gather(request, return_exceptions=True)

    def _servers(self) -> set[str]:
        """The healthy servers, where new sequences may start."""
        return {engine.url for role in (THETA, T) for engine in self._healthy(role)}

    # -- lifecycle ---------------------------------------------------------------------

    def submit(self, sequences: list[SequenceState]) -> None:
        if self._closing:
            raise LifecycleError("the coordinator is closing")
        self._waiting.extend(sequences)
        self._listen()
        self._admit()

    def _listen(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._receive_loop(), name="dualvllm-lockstep")
            self._watchdog = asyncio.create_task(self._watch_stalls(), name="dualvllm-lockstep-watchdog")

    async def close(self) -> None:
        """Fail what is unfinished, end every server request, then stop listening. Every wait
        is bounded: ShutdownTimeoutError names what did not end."""
        # A step in progress holds the lock across at most a detokenization or a gate's hold.
        await bounded(self._lock.acquire(), what="the lockstep step in progress (its lock)", timeout_s=CLOSE_STEP_S)
        try:
            self._closing = True
            for live in list(self._live):
                if not live.done:
                    live.seq.fail("the coordinator was closed before this sequence finished")
                    self._finish(live)
            for seq in [*self._waiting, *(live.seq for live in self._suspended)]:
                seq.fail("the coordinator was closed before this sequence finished")
                self._delivery.deliver(seq, text="")
            self._waiting.clear()
            self._suspended.clear()
            await self._send_ready()
        finally:
            self._lock.release()
        # The servers end their requests at their next report, answered END here.
        if self._requests:
            await asyncio.wait(list(self._requests), timeout=DRAIN_S)
        try:
            await stop(self._watchdog, self._loop_task, *self._requests, *self._background,
                       what="the lockstep scheduler's tasks", timeout_s=CLOSE_STEP_S)
        finally:
            self._channel.close()
        await bounded(self._delivery.aclose(), what="the detokenization of finished outputs", timeout_s=CLOSE_STEP_S)

    # -- admission and streams ---------------------------------------------------------

    def _admit(self) -> None:
        """Start waiting sequences when there is room, so that both servers admit each in
        the same step (coordinator/admission.py): through the gate while the servers run,
        the first one alone (a pilot) on a server that is idle. Nothing starts while a
        server is coming back from a failure."""
        self._live = [live for live in self._live if not live.done]
        if self._dead:
            self._fail_waiting(next(iter(self._dead.values())))
        if self._closing or self._holding or not self._room():
            return
        if not self._config.lockstep_aligned_admission:
            while self._room():
                self._start(self._next_waiting())
            return
        targets = self._servers()
        if not targets <= self._blocked_servers() | self._busy_servers():  # a server would never block here
            self._start(self._next_waiting())
        if self._room() and not self.gate.armed:
            self.gate.arm()
            self._spawn(self._open_gate_after(MAX_HOLD_S, self.gate.armed_at))

    def _room(self) -> bool:
        while self._waiting and self._waiting[0].cancelled:
            self._waiting.popleft()
        while self._suspended and self._suspended[0].seq.cancelled:
            self._suspended.popleft().done = True
        return bool(self._waiting or self._suspended) and len(self._live) < self._max_live and self._has_slot()

    def _next_waiting(self) -> _Live:
        """A suspended sequence first (it has waited longest), else a new one."""
        return self._suspended.popleft() if self._suspended else _Live(self._waiting.popleft())

    def _start(self, live: _Live) -> _Live:
        self._place(live)
        self._live.append(live)
        for role in (THETA, T):
            self._start_stream(live, role)
        return live

    def _fail_waiting(self, reason: str) -> None:
        for seq in [*self._waiting, *(live.seq for live in self._suspended)]:
            if not seq.cancelled:
                seq.fail(reason)
                self._delivery.deliver(seq, text="")
        self._waiting.clear()
        self._suspended.clear()

    async def _open_gate(self, *, force: bool = False) -> None:
        """Start the waiting sequences if both servers are blocked here (or `force`), then hold
        the servers until both have taken every new request in, and a moment more for the
        requests to reach their engines."""
        if not self.gate.armed or not (force or self._servers() <= self._blocked_servers()):
            return
        started = []
        while self._room() and not self._holding:
            started.append(self._start(self._next_waiting()))
        streams = [stream for live in started for stream in live.streams if stream is not None]
        hold_s = self.gate.opened([tuple((s.engine.url, s.id) for s in live.streams if s is not None)
                                   for live in started])  # type: ignore[misc]
        if streams:
            sent = time.perf_counter()
            await asyncio.wait([stream.accepted for stream in streams], timeout=MAX_HOLD_S)
            self.gate.counters.accept_s += time.perf_counter() - sent
            await asyncio.sleep(hold_s)

    async def _open_gate_after(self, delay_s: float, armed_at: float | None) -> None:
        """A server that does not block here within `delay_s` (its batch busy with other work)
        must not hold the other one longer: start the waiting sequences unaligned."""
        await asyncio.sleep(delay_s)
        async with self._lock:
            if self.gate.armed_at == armed_at and not self._closing:
                log.info("lockstep: a server did not reach a step boundary within %.2f s; admitting unaligned",
                         delay_s)
                self.gate.counters.forced += 1
                await self._open_gate(force=True)
                await self._send_ready()

    def _busy_servers(self) -> set[str]:
        return {stream.engine.url for stream in self._streams.values() if not stream.retired}

    def _blocked_servers(self) -> set[str]:
        return {blocked.server for blocked in self._blocked.values() if blocked.server is not None}

    def _spawn(self, coroutine) -> None:
        task = asyncio.create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _start_stream(self, live: _Live, role: int) -> None:
        """Send `live`'s request to the role's server, continuing from its agreed tokens."""
        seq = live.seq
        prompt = seq.theta_context() if role == THETA else seq.t_context()
        agreed = len(seq.tokens)
        engine = live.engines[role]
        assert engine is not None, "a sequence starts only once placed"
        stream = _Stream(id=next(self._ids), live=live, role=role, engine=engine, offset=agreed)
        live.streams[role] = stream
        self._streams[stream.id] = stream
        # One more than needed: the coordinator ends the request (END) before the server would.
        max_tokens = max(1, min(seq.params.max_tokens - agreed + 1, self._max_len - len(prompt)))
        args = wire.request_args(wire.Tagged(self._channel.address, stream.id, offset=agreed, top_k=self._config.top_k,
                                             stop=self._stop_token))
        task = asyncio.create_task(stream.engine.forced_generation(
            prompt, max_tokens=max_tokens, stop_token=self._stop_token, lockstep_args=args,
            on_accepted=stream.accept))
        self._requests.add(task)
        task.add_done_callback(functools.partial(self._stream_ended, stream))

    def _stream_ended(self, stream: _Stream, task: asyncio.Task[str]) -> None:
        self._requests.discard(task)
        stream.accept()
        if task.cancelled():
            self._streams.pop(stream.id, None)
            return
        task.exception()  # retrieved here: a retired stream's break (a dead server) is expected
        self._spawn(self._on_stream_end(stream, task))

    async def _on_stream_end(self, stream: _Stream, task: asyncio.Task[str]) -> None:
        """A server request finished: expected (retired), or the sequence must go on."""
        async with self._lock:
            self._streams.pop(stream.id, None)
            if stream.retired or self._closing:
                return
            try:
                self.gate.forget((stream.engine.url, stream.id))
                self._continue_after(stream, task)
                await self._settle()
            except Exception as exc:  # a bug must not strand the sequence: fail it, loudly
                log.exception("lockstep: handling the end of a request failed")
                if not stream.live.done:
                    stream.live.seq.fail(f"internal error in the lockstep coordinator: {exc!r}")
                    self._finish(stream.live)

    def _continue_after(self, stream: _Stream, task: asyncio.Task[str]) -> None:
        stream.retired = True
        live = stream.live
        live.streams[stream.role] = None
        if live.done:
            return
        row = live.rows[stream.role]
        if row is not None:
            # A row of this stream still waits here although its request ended: the plugin
            # gave up waiting (its timeout ended the row there, and its next report comes
            # from a new socket, so _forget never sees it). Drop the row, or the
            # resubmitted stream's first report would be taken for a divergence.
            row[0].answers[row[1]] = wire.END
            live.rows[stream.role] = None
        error = task.exception()
        seq = live.seq
        if isinstance(error, ServerError) and error.retryable and live.request_failures < MAX_REQUEST_FAILURES:
            # The request broke (a connection the server was closing, a restart): the
            # sequence waits until the server answers /health, then starts again from its
            # agreed tokens on both servers, under new stream ids (if the broken request did
            # reach the server, its rows are unknown here and answered END).
            live.request_failures += 1
            self._suspend(live, stream.role, stream.engine, error)
        elif error is not None:
            log.warning("%s lockstep request of a sequence failed: %s", stream.engine.name, error)
            seq.fail(f"{stream.engine.name} server: {error}")
            self._finish(live)
        elif live.resubmissions >= MAX_RESUBMISSIONS:
            seq.fail(f"{stream.engine.name} server ended this sequence's request {live.resubmissions} times "
                     f"before the coordinator did (last finish_reason {task.result()!r})")
            self._finish(live)
        else:
            # The server ended it (its stop token sampled as an ordinary token, its own
            # max_tokens): continue from the agreed tokens.
            live.resubmissions += 1
            self._resubmit(live, stream.role)

    def _suspend(self, live: _Live, role: int, engine: VLLMClient, error: ServerError) -> None:
        """Take `live` off both servers until `engine` (its server of `role`) is back, or, when
        the role has another healthy replica, take `engine` out of its pool and move its
        sequences there."""
        self._take_off(live)
        pool = self._pools[role]
        if pool is not None and any(e is not engine for e in self._healthy(role)):
            pool.take_out(self._replicas[role].index(engine), error)
            for other in list(self._live):
                if not other.done and engine in other.engines:
                    self._take_off(other)
            return
        if engine.url in self._dead:
            self._fail_waiting(self._dead[engine.url])
        elif engine.url not in self._recovering:
            log.warning("lockstep: a request to the %s server at %s broke (%s); its sequences resume from their "
                        "agreed tokens once it answers /health (waiting up to %g s)", engine.name, engine.url, error,
                        self._config.lockstep_restart_timeout)
            self._recovering.add(engine.url)
            self._spawn(self._recover(engine))

    def _take_off(self, live: _Live) -> None:
        """End `live`'s streams (each at its next report) and queue it to start again, first,
        like a new sequence from its agreed tokens."""
        for role in (THETA, T):
            row, stream = live.rows[role], live.streams[role]
            if row is not None:
                row[0].answers[row[1]] = wire.END
            if stream is not None:
                stream.retired = True
                self.gate.forget((stream.engine.url, stream.id))
        live.rows, live.streams = [None, None], [None, None]
        self._live.remove(live)
        self._suspended.append(live)
        self.counters.suspensions += 1
        self.gate.disarm()  # nothing starts before the hold ends; no server may be held meanwhile

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """Hold generation while the caller changes a server (a weight push): every sequence
        is taken off both servers at its agreed tokens and their requests end; after the
        block they start again from there, on whatever the servers then serve, as per-token
        mode's next step would."""
        async with self._lock:
            self._pauses += 1
        try:  # from here on the pause is undone on every path: a cancel during the drain included
            async with self._lock:
                for live in list(self._live):
                    if not live.done:
                        self._take_off(live)
                await self._send_ready()
            if self._requests:  # each ends at its server's next step: END is the answer now
                await asyncio.wait(list(self._requests), timeout=DRAIN_S)
            yield
        finally:
            async with self._lock:
                self._pauses -= 1
                await self._settle()

    @property
    def _holding(self) -> bool:
        """Nothing may start: a server is coming back, or a caller paused generation."""
        return bool(self._recovering) or self._pauses > 0

    async def _recover(self, engine: VLLMClient) -> None:
        """Wait for a server whose request broke to answer /health, then let its sequences resume."""
        timeout_s = self._config.lockstep_restart_timeout
        try:
            await engine.wait_healthy(timeout_s)
        except ServerError as err:
            reason = (f"{engine.name} server at {engine.url} broke a lockstep request and did not answer /health "
                      f"within lockstep_restart_timeout={timeout_s:g} s ({err})")
            log.error("lockstep: %s; failing its sequences", reason)
            async with self._lock:
                self._recovering.discard(engine.url)
                self._dead[engine.url] = reason
                self._fail_waiting(reason)
                for live in list(self._live):
                    if not live.done:
                        live.seq.fail(reason)
                        self._finish(live)
                await self._send_ready()
            return
        async with self._lock:
            self._recovering.discard(engine.url)
            log.info("lockstep: %s server at %s answers again; resuming %d sequences", engine.name, engine.url,
                     len(self._suspended))
            await self._settle()

    def _resubmit(self, live: _Live, role: int) -> None:
        self.counters.resubmissions += 1
        self._start_stream(live, role)

    # -- reports -----------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        while True:
            try:
                identity, report = await self._channel.receive()
            except (wire.WireError, ValueError) as err:
                log.error("dropping a malformed lockstep report: %s", err)
                continue
            async with self._lock:
                try:
                    await self._on_report(identity, report)
                except Exception as exc:  # a bug must not hang the servers or the callers
                    log.exception("lockstep step failed")
                    for live in list(self._live):
                        if not live.done:
                            live.seq.fail(f"internal error in the lockstep coordinator: {exc!r}")
                            self._finish(live)
                    for blocked in self._blocked.values():
                        blocked.answers[blocked.answers == UNSET] = wire.END
                    self.gate.disarm()
                    await self._send_ready()

    async def _on_report(self, identity: bytes, report: wire.Report) -> None:
        arrived = time.perf_counter()
        self.counters.reports += 1
        n = len(report.ids)
        blocked = _Blocked(identity, report, np.full(n, UNSET, dtype=np.int64), arrived, server=None)
        stale = self._blocked.pop(identity, None)
        if stale is not None:  # the plugin gave up on it (timeout): its rows were ended there
            self._forget(stale)
        self._blocked[identity] = blocked
        ready: list[_Live] = []
        answers = blocked.answers
        for i, (stream_id, position) in enumerate(zip(report.ids.tolist(), report.positions.tolist())):
            stream = self._streams.get(stream_id)
            if stream is None or stream.retired or stream.live.done or self._closing:
                probe = self._probes.get(stream_id)
                if probe is not None and not probe.done():
                    probe.set_result(report)
                answers[i] = wire.END
                continue
            live, seq = stream.live, stream.live.seq
            blocked.server = stream.engine.url
            agreed = len(seq.tokens)
            if seq.cancelled:
                seq.fail("cancelled by the caller")
                self._finish(live)
                answers[i] = wire.END
            elif position < agreed:  # a preempted request come back: decided already
                answers[i] = seq.tokens[position]
            elif position > agreed or live.rows[stream.role] is not None:
                seq.fail(f"{stream.engine.name} server reported position {position} of a sequence agreed up to "
                         f"{agreed} tokens: the two servers diverged")
                self._finish(live)
                answers[i] = wire.END
            else:
                live.rows[stream.role] = (blocked, i)
                if live.rows[1 - stream.role] is not None:
                    ready.append(live)
        self.gate.observe(blocked.server, set(report.ids.tolist()))
        if ready:
            await self._decide(ready)
        await self._settle()

    async def _settle(self) -> None:
        """After any change: break a deadlock, start what can start, answer what is decided."""
        stuck = self._deadlocked_servers()
        if stuck:
            self._break_deadlock(stuck)
        self._admit()
        await self._open_gate()
        await self._send_ready()

    def _forget(self, blocked: _Blocked) -> None:
        for live in self._live:
            for role in (THETA, T):
                row = live.rows[role]
                if row is not None and row[0] is blocked:
                    live.rows[role] = None

    async def _decide(self, ready: list[_Live]) -> None:
        """Sample the next token of every sequence whose two rows are in, and answer both rows."""
        started = time.perf_counter()
        theta = self._topk([live.rows[THETA] for live in ready])  # type: ignore[misc]
        t = self._topk([live.rows[T] for live in ready])  # type: ignore[misc]
        sequences = [live.seq for live in ready]
        step = sample_rows(sequences, theta, t, self._config, self._vocab_size)
        record_rows(sequences, step, self._eos_ids, self._max_len, theta, t)
        tokens = step.token_ids.tolist()
        await self._delivery.check_stop_strings([seq for seq in sequences if seq.params.stop and seq.error is None])
        for row, live in enumerate(ready):
            answer = tokens[row] if live.seq.finish_reason is None else wire.END
            live.rows[THETA][0].partners.add(live.rows[T][0])  # type: ignore[index]
            live.rows[T][0].partners.add(live.rows[THETA][0])  # type: ignore[index]
            for role in (THETA, T):
                blocked, i = live.rows[role]  # type: ignore[misc]
                blocked.answers[i] = answer
            live.rows = [None, None]
            if live.seq.finish_reason is not None:
                self._finish(live)
        now = time.perf_counter()
        merge_s, alpha_s, sample_s = step.phase_s
        # A "step" here is the time between two decisions: about one server decode step.
        interval = now - self._last_decision if self._last_decision is not None else now - started
        self._last_decision = now
        timing = StepTiming(batch=len(ready), theta_s=0.0, t_s=0.0, servers_s=max(interval - (now - started), 0.0),
                            merge_s=merge_s, alpha_s=alpha_s, sample_s=sample_s,
                            bookkeeping_s=(now - started) - (merge_s + alpha_s + sample_s), total_s=interval)
        self._stats.record_step(len(ready), float(step.alpha.sum()), interval, float(step.coverage_theta.sum()),
                                float(step.coverage_t.sum()), timing)

    @staticmethod
    def _topk(rows: list[tuple[_Blocked, int]]) -> TopKBatch:
        ids = np.stack([blocked.report.token_ids[i] for blocked, i in rows]).astype(np.int64)
        logprobs = np.stack([blocked.report.logprobs[i] for blocked, i in rows]).astype(np.float64)
        return TopKBatch(token_ids=ids, logprobs=logprobs)

    def _finish(self, live: _Live) -> None:
        """`live`'s sequence is over: END its waiting rows (its streams get END when they
        report next) and hand it to its caller."""
        if live.done:
            return
        live.done = True
        for role in (THETA, T):
            row = live.rows[role]
            if row is not None:
                row[0].answers[row[1]] = wire.END
        live.rows = [None, None]
        for stream in live.streams:
            if stream is not None:
                stream.retired = True
        if live.seq.finish_reason is None:
            live.seq.fail("the sequence ended without a finish reason")  # never expected
        self._delivery.retire(live.seq)

    async def _send_ready(self) -> None:
        """Reply to every report whose rows are all decided, unless the admission gate holds them."""
        if self.gate.armed and not self._closing:
            return
        now = time.perf_counter()
        for identity, blocked in list(self._blocked.items()):
            if (blocked.answers == UNSET).any():
                continue
            del self._blocked[identity]
            self.counters.replies += 1
            self.counters.split_reports += len(blocked.partners) > 1
            self.counters.wait_s += now - blocked.arrived
            await self._channel.reply(identity, blocked.report.step, blocked.answers)

    # -- deadlocks and stalls ----------------------------------------------------------

    def _deadlocked_servers(self) -> set[str]:
        """Servers waiting here that nothing will free: each waits on a row that must come
        from a server that is itself waiting here, and so cannot report it before it is
        answered. Exact. With one server per role: both servers wait with undecided rows."""
        waits_on: dict[str, set[str | None]] = {}  # waiting server -> servers its undecided rows need
        for blocked in self._blocked.values():
            undecided = np.flatnonzero(blocked.answers == UNSET)
            if blocked.server is None or undecided.size == 0:
                continue
            needed = waits_on.setdefault(blocked.server, set())
            for i in undecided.tolist():
                stream = self._streams.get(int(blocked.report.ids[i]))
                other = stream.live.streams[1 - stream.role] if stream is not None else None
                needed.add(other.engine.url if other is not None and not other.retired else None)
        stuck = set(waits_on)
        while True:  # free every server all of whose needed rows come from servers not stuck
            free = {server for server in stuck if not waits_on[server] & stuck}
            if not free:
                return stuck
            stuck -= free

    def _break_deadlock(self, stuck: set[str]) -> None:
        undecided = {identity: int((b.answers == UNSET).sum()) for identity, b in self._blocked.items()
                     if b.server in stuck}
        identity = min((i for i in undecided if undecided[i]), key=undecided.__getitem__)
        self._park(self._blocked[identity])

    def _park(self, blocked: _Blocked) -> None:
        """END the undecided rows of `blocked` and resend their sequences from the agreed tokens."""
        for i in np.flatnonzero(blocked.answers == UNSET).tolist():
            blocked.answers[i] = wire.END
            stream = self._streams.get(int(blocked.report.ids[i]))
            if stream is None:
                continue
            stream.retired = True
            live = stream.live
            live.rows[stream.role] = None
            self.counters.parks += 1
            if not live.done:
                self._resubmit(live, stream.role)

    async def _watch_stalls(self) -> None:
        """Park reports that wait too long on a server that is busy with other work; start
        sequences that wait for a replica that has since rejoined its pool (no report would)."""
        limit = self._config.lockstep_stall_timeout
        every = min(limit / 4, self._config.replica_probe_interval)
        while True:
            await asyncio.sleep(every)
            async with self._lock:
                if not self._holding and self._room():
                    await self._settle()
                now = time.perf_counter()
                stalled = [b for b in self._blocked.values()
                           if now - b.arrived > limit and (b.answers == UNSET).any()]
                for blocked in stalled:
                    log.info("a lockstep report waited %.2f s on rows the other server has not reached; "
                             "parking them", now - blocked.arrived)
                    self._park(blocked)
                if stalled:
                    await self._send_ready()
