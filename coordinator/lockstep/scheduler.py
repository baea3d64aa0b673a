"""Lockstep mode's asyncio shell: both servers decode natively, the coordinator picks every token.

Each sequence is one long completion request per server (a *stream*), tagged with this
coordinator's address, so the server's plugin (engines/vllm_plugin) asks here for the
token of every position. No request per token: vLLM's per-request work (front end,
scheduling set-up, logprob serialization) is paid once per sequence.

The rules (pairing rows, answering reports, deadlocks, parks, divergence) live in the
sans-IO table (coordinator/lockstep/table.py). This shell moves messages between it and
the servers, and owns what needs I/O or time:
- a stream that the server ended on its own while its sequence goes on (its stop token
  sampled as an ordinary token, the server's max_tokens) is resubmitted from its agreed
  tokens, with the position offset. The prefix cache makes the resubmission cheap.
- a stream whose request broke (a connection reset, a server killed or restarting) takes
  its sequence off both servers. With another healthy replica of that role (replica
  pools, engines/pool.py), the server is marked down in its pool, every sequence on it
  is taken off too, and they all start again from their agreed tokens on the healthy
  replicas at once; the pool probes the server and lets it rejoin (`check_plugin`, the
  start-up probe's judgement). Without one, they wait until that server answers /health
  again; a server that does not come back within `lockstep_restart_timeout` fails them.
  Any other request failure fails its sequence only.
- replica pools: each sequence is placed on one replica per role and stays there (its
  KV and prefix cache); the pool chooses (`ReplicaPool.assign`).
- admission: new sequences start while both servers are blocked here, and the reports are
  answered a moment later, so that both servers admit them in the same step
  (coordinator/admission.py).
- a report left waiting longer than `lockstep_stall_timeout` on a server that is not
  waiting (its batch is full of other work) is parked (the watchdog).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import AsyncIterator

from common.errors import LifecycleError, ServerError
from common.tasks import bounded, stop
from coordinator.admission import MAX_HOLD_S, AdmissionGate
from coordinator.config import CoordinatorConfig
from coordinator.delivery import Delivery
from coordinator.lockstep.placement import Placement
from coordinator.lockstep.probe import probe_plugin
from coordinator.lockstep.requests import Requests
from coordinator.lockstep.table import ROLES, THETA, T, Live, LockstepTable, Stream
from coordinator.scheduler import record_rows, sample_rows
from coordinator.sequence import SequenceState
from coordinator.stats import Statistics, StepTiming
from engines.lockstep_channel import LockstepChannel
from engines.pool import ReplicaPool
from engines.vllm_client import VLLMClient
from engines.vllm_plugin import wire

log = logging.getLogger("dualvllm.coordinator")

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


class LockstepScheduler:
    mode = "lockstep"

    def __init__(self, theta: VLLMClient | ReplicaPool, t: VLLMClient | ReplicaPool, *, config: CoordinatorConfig,
                 eos_ids: frozenset[int], max_len: int, stats: Statistics, channel: LockstepChannel,
                 stop_token: int, capacity: int | None = None, vocab_size: int | None = None) -> None:
        """`theta`/`t`: a server's client, or a ReplicaPool of its replicas' clients;
        `stop_token`: the token a stream's plugin forces to end it (an EOS id of both models);
        `capacity`: the most sequences one server runs at once (None: no limit but max_batch_size)."""
        self._config = config
        self._eos_ids = eos_ids
        self._max_len = max_len
        self._stats = stats
        self._channel = channel
        self._stop_token = stop_token
        self._vocab_size = vocab_size
        self._delivery = Delivery(theta, stats)
        self._table = LockstepTable()
        self.counters = self._table.counters
        # More sequences than a server runs at once would wait in its queue while the other
        # server runs them: a park at every step.
        self._placement = Placement(theta, t, per_server=capacity or config.max_batch_size, loads=self._table.loads)
        self._max_live = min(config.max_batch_size, self._placement.per_server * self._placement.fewest_replicas)
        self._requests = Requests(self._table, address=channel.address, top_k=config.top_k, stop_token=stop_token,
                                  max_len=max_len, on_end=self._stream_ended)
        self._waiting: deque[SequenceState] = deque()
        self._suspended: deque[Live] = deque()  # taken off a server that broke; first to start again
        self._recovering: set[str] = set()  # servers whose requests broke, until /health answers
        self._dead: dict[str, str] = {}  # servers that did not come back: why
        self._pauses = 0  # callers inside paused()
        self._probes: dict[int, asyncio.Future[wire.Report]] = {}  # check_plugin's requests: their reports
        self._loop_task: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._closing = False
        self._last_decision: float | None = None
        # Admission rounds whose hold has not ended: replies wait (coordinator/admission.py).
        self._held_rounds = 0
        # Every change of state (reports, stalls, ended requests) runs under this lock; it is
        # never held across a server call or a sleep (detokenization and the gate's hold run
        # outside it, in tasks that take it again to apply their result).
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

    # -- replicas ----------------------------------------------------------------------

    async def check_plugin(self, engine: VLLMClient) -> None:
        """Raise LockstepUnavailableError unless `engine`'s plugin reports here and passes the
        start-up probe's checks (coordinator/lockstep/probe.py) against what this coordinator
        places on a server: a replica that rejoins its pool may have been restarted without
        the plugin, or with settings the coordinator was not sized for."""
        if self._closing:  # nobody reads the channel: every server would look like one without the plugin
            raise LifecycleError("the coordinator is closing: it checks no replica's plugin")
        self._listen()
        probe_id = self._requests.new_id()
        reported = self._probes[probe_id] = asyncio.get_running_loop().create_future()
        roles = self._placement.roles_on(engine)
        try:
            await probe_plugin(engine, address=self._channel.address, probe_id=probe_id, reported=reported,
                               prompt_ids=[self._stop_token], stop_token=self._stop_token,
                               timeout_s=self._config.request_timeout,
                               needed=roles * min(self._placement.per_server, self._config.max_batch_size))
        finally:
            del self._probes[probe_id]

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
            self._closing = self._table.closing = True
            self._table.fail_all("the coordinator was closed before this sequence finished")
            self._fail_waiting("the coordinator was closed before this sequence finished")
            await self._send_ready()
        finally:
            self._lock.release()
        await self._requests.drain(DRAIN_S)  # each ends at its server's next report, answered END here
        try:
            await stop(self._watchdog, self._loop_task, *self._requests.tasks(), *self._background,
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
        if self._dead:
            self._fail_waiting(next(iter(self._dead.values())))
        if self._closing or self._holding or not self._room():
            return
        if not self._config.lockstep_aligned_admission:
            while self._room():
                self._start(self._next_waiting())
            return
        targets = self._placement.servers()
        if not targets <= self._table.blocked_servers() | self._table.busy_servers():  # one would never block here
            self._start(self._next_waiting())
        if self._room() and not self.gate.armed:
            self.gate.arm()
            self._spawn(self._open_gate_after(MAX_HOLD_S, self.gate.armed_at))

    def _room(self) -> bool:
        while self._waiting and self._waiting[0].cancelled:
            self._waiting.popleft()
        while self._suspended and self._suspended[0].seq.cancelled:
            self._suspended.popleft().done = True
        return bool(self._waiting or self._suspended) and len(self._table) < self._max_live and self._placement.has_slot()

    def _next_waiting(self) -> Live:
        """A suspended sequence first (it has waited longest), else a new one."""
        return self._suspended.popleft() if self._suspended else Live(self._waiting.popleft())

    def _start(self, live: Live) -> Live:
        self._placement.place(live)
        self._table.add(live)
        for role in ROLES:
            self._requests.start(live, role)
        return live

    def _fail_waiting(self, reason: str) -> None:
        for seq in [*self._waiting, *(live.seq for live in self._suspended)]:
            if not seq.cancelled:
                seq.fail(reason)
                self._delivery.deliver(seq, text="")
        self._waiting.clear()
        self._suspended.clear()

    async def _open_gate(self, *, force: bool = False) -> None:
        """Start the waiting sequences if both servers are blocked here (or `force`), and hold
        the servers' replies (`_hold`)."""
        if not self.gate.armed or not (force or self._placement.servers() <= self._table.blocked_servers()):
            return
        started = []
        while self._room() and not self._holding:
            started.append(self._start(self._next_waiting()))
        streams = [stream for live in started for stream in live.streams if stream is not None]
        hold_s = self.gate.opened([tuple((s.engine.url, s.id) for s in live.streams if s is not None)
                                   for live in started])  # type: ignore[misc]
        if streams:
            self._held_rounds += 1
            self._spawn(self._hold(streams, hold_s))

    async def _hold(self, streams: list[Stream], hold_s: float) -> None:
        """Keep the servers waiting (their replies held) until both have taken every new request
        in, and `hold_s` more for the requests to reach their engines; then answer them."""
        try:
            sent = time.perf_counter()
            await asyncio.wait(self._requests.accepted(streams), timeout=MAX_HOLD_S)
            self.gate.counters.accept_s += time.perf_counter() - sent
            await asyncio.sleep(hold_s)
        finally:
            async with self._lock:
                self._held_rounds -= 1
                await self._settle()

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

    def _spawn(self, coroutine) -> None:
        task = asyncio.create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _stream_ended(self, stream: Stream, task: asyncio.Task[str]) -> None:
        self._spawn(self._on_stream_end(stream, task))

    async def _on_stream_end(self, stream: Stream, task: asyncio.Task[str]) -> None:
        """A server request finished: expected (retired), or the sequence must go on."""
        async with self._lock:
            if not self._table.stream_ended(stream):
                return
            try:
                self.gate.forget((stream.engine.url, stream.id))
                self._continue_after(stream, task)
                await self._settle()
            except Exception as exc:  # a bug must not strand the sequence: fail it, loudly
                log.exception("lockstep: handling the end of a request failed")
                self._table.fail(stream.live, f"internal error in the lockstep coordinator: {exc!r}")
                self._deliver_finished()

    def _continue_after(self, stream: Stream, task: asyncio.Task[str]) -> None:
        live = stream.live
        error = task.exception()
        if isinstance(error, ServerError) and error.retryable and live.request_failures < MAX_REQUEST_FAILURES:
            # The request broke (a connection the server was closing, a restart): the
            # sequence waits until the server answers /health, then starts again from its
            # agreed tokens on both servers, under new stream ids (if the broken request did
            # reach the server, its rows are unknown here and answered END).
            live.request_failures += 1
            self._suspend(live, stream.role, stream.engine, error)
        elif error is not None:
            log.warning("%s lockstep request of a sequence failed: %s", stream.engine.name, error)
            self._table.fail(live, f"{stream.engine.name} server: {error}")
        elif live.resubmissions >= MAX_RESUBMISSIONS:
            self._table.fail(live, f"{stream.engine.name} server ended this sequence's request {live.resubmissions} "
                                   f"times before the coordinator did (last finish_reason {task.result()!r})")
        else:
            # The server ended it (its stop token sampled as an ordinary token, its own
            # max_tokens): continue from the agreed tokens.
            live.resubmissions += 1
            self._resubmit(live, stream.role)

    def _suspend(self, live: Live, role: int, engine: VLLMClient, error: ServerError) -> None:
        """Take `live` off both servers until `engine` (its server of `role`) is back, or, when
        the role has another healthy replica, take `engine` out of its pool and move its
        sequences there."""
        self._take_off(live)
        if self._placement.take_out(role, engine, error):
            for other in self._table.on_servers([engine.url]):
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

    def _take_off(self, live: Live) -> None:
        """End `live`'s streams (each at its next report) and queue it to start again, first,
        like a new sequence from its agreed tokens."""
        for stream in self._table.take_off(live):
            self.gate.forget((stream.engine.url, stream.id))
        self._suspended.append(live)
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
                for live in self._table.live:
                    self._take_off(live)
                await self._send_ready()
            await self._requests.drain(DRAIN_S)  # each ends at its server's next step: END is the answer now
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
                self._table.fail_all(reason)
                await self._send_ready()
            return
        async with self._lock:
            self._recovering.discard(engine.url)
            log.info("lockstep: %s server at %s answers again; resuming %d sequences", engine.name, engine.url,
                     len(self._suspended))
            await self._settle()

    def _resubmit(self, live: Live, role: int) -> None:
        self.counters.resubmissions += 1
        self._requests.start(live, role)

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
                    self._table.fail_all(f"internal error in the lockstep coordinator: {exc!r}")
                    self._table.end_undecided()
                    self.gate.disarm()
                    await self._send_ready()

    async def _on_report(self, identity: bytes, report: wire.Report) -> None:
        blocked, ready = self._table.report(identity, report, time.perf_counter())
        for stream_id, probed in self._table.out.unknown:
            probe = self._probes.get(stream_id)
            if probe is not None and not probe.done():
                probe.set_result(probed)
        self._table.out.unknown.clear()
        self.gate.observe(blocked.server, set(report.ids.tolist()))
        if ready:
            await self._decide(ready)
        await self._settle()

    async def _settle(self) -> None:
        """After any change: break a deadlock, start what can start, answer what is decided.
        While an admission round holds the servers they wait on us, not on each other."""
        if not self._held_rounds and self._table.break_deadlock():
            self._resubmit_parked()
        self._admit()
        await self._open_gate()
        await self._send_ready()

    async def _decide(self, ready: list[Live]) -> None:
        """Sample the next token of every sequence whose two rows are in, and answer both rows."""
        started = time.perf_counter()
        theta, t = self._table.topk(ready, THETA), self._table.topk(ready, T)
        sequences = [live.seq for live in ready]
        step = sample_rows(sequences, theta, t, self._config, self._vocab_size)
        record_rows(sequences, step, self._eos_ids, self._max_len, theta, t)
        self._table.decided(ready, step.token_ids.tolist())
        checking = [live for live in ready if live.seq.params.stop and not live.done]
        if checking:  # the servers have the token already; the sequence's next one waits for the check
            self._table.hold(checking)
            self._spawn(self._check_stop_strings(checking))
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

    async def _check_stop_strings(self, lives: list[Live]) -> None:
        """Detokenize (a server call, outside the lock), then finish the sequences whose text
        reached a stop string (their streams get END at their next report) and decide the
        next token of the others."""
        try:  # a server's failure fails the sequence it was asked for (Delivery.text)
            await self._delivery.check_stop_strings([live.seq for live in lives if live.seq.error is None])
        except Exception as exc:  # a bug must not strand the sequences: fail them, loudly
            log.exception("lockstep: checking stop strings failed")
            for live in lives:
                live.seq.fail(f"internal error in the lockstep coordinator: {exc!r}")
        finally:
            async with self._lock:
                ready = self._table.release(lives)
                if ready:
                    await self._decide(ready)
                await self._settle()

    def _resubmit_parked(self) -> None:
        parked, self._table.out.resubmit = self._table.out.resubmit, []
        for live, role in parked:
            self._resubmit(live, role)

    def _deliver_finished(self) -> None:
        finished, self._table.out.finished = self._table.out.finished, []
        for seq in finished:
            self._delivery.retire(seq)

    async def _send_ready(self) -> None:
        """Hand finished sequences to their callers, and reply to every report whose rows are
        all decided, unless the admission gate holds them."""
        self._deliver_finished()
        if (self.gate.armed or self._held_rounds) and not self._closing:
            return
        for identity, step, answers in self._table.replies(time.perf_counter()):
            await self._channel.reply(identity, step, answers)

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
                waited = self._table.park_stalled(time.perf_counter(), limit)
                for wait_s in waited:
                    log.info("a lockstep report waited %.2f s on rows the other server has not reached; "
                             "parking them", wait_s)
                if waited:
                    self._resubmit_parked()
                    await self._send_ready()
