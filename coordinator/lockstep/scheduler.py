"""Lockstep mode's asyncio shell: both servers decode natively, the coordinator picks every token.

Each sequence is one long completion request per server (a *stream*), tagged with this
coordinator's address, so the server's plugin (engines/vllm_plugin) asks here for the
token of every position. No request per token: vLLM's per-request work (front end,
scheduling set-up, logprob serialization) is paid once per sequence.

The parts:
- table.py: the rules (pairing rows, answering reports, parks, divergence), sans-IO;
- waits.py: who waits on whom (deadlocks, stalls), sans-IO;
- requests.py: the servers' streams; placement.py: which replica runs a sequence;
- admission.py: when a waiting sequence starts (both servers admit it in the same step);
- recovery.py: a stream that ended before its sequence (resubmission, failover, restarts);
- this shell: reports in from the channel, decisions (coordinator/step.py), replies out,
  stop strings, the stall watchdog, pauses and close. A report left waiting longer than
  `lockstep_stall_timeout` on a server that is not waiting (its batch is full of other
  work) is parked.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import operator
import time
from typing import Any
from collections.abc import AsyncIterator, Coroutine

from dualvllm.common.errors import LifecycleError
from dualvllm.common.tasks import bounded, stop
from dualvllm.coordinator.config import CoordinatorConfig
from dualvllm.coordinator.delivery import Delivery
from dualvllm.coordinator.lockstep.admission import Admission
from dualvllm.coordinator.lockstep.placement import Placement
from dualvllm.coordinator.lockstep.probe import probe_plugin
from dualvllm.coordinator.lockstep.recovery import Recovery
from dualvllm.coordinator.lockstep.requests import Requests
from dualvllm.coordinator.lockstep import waits
from dualvllm.coordinator.lockstep.table import THETA, T, Live, LockstepTable
from dualvllm.coordinator.scheduler import record_rows, sample_rows
from dualvllm.coordinator.sequence import SamplingParams, SequenceState
from dualvllm.coordinator.stats import Statistics, StepTiming
from dualvllm.engines.lockstep_channel import LockstepChannel
from dualvllm.engines.pool import ReplicaPool
from dualvllm.engines.vllm_client import VLLMClient
from dualvllm.engines.vllm_plugin import wire

log = logging.getLogger("dualvllm.coordinator")

_SEQ = operator.attrgetter("seq")
_STOPS = operator.attrgetter("seq.params.stop")
# After close, reports are answered END for this long, so that no server waits out its
# plugin timeout on a coordinator that has gone.
DRAIN_S = 5.0
# close() waits at most this long for each of: the step in progress, its tasks to end, the
# last outputs' detokenization (an HTTP call, itself bounded by request_timeout).
CLOSE_STEP_S = 60.0


class LockstepScheduler:
    mode = "lockstep"

    def __init__(
        self,
        theta: VLLMClient | ReplicaPool,
        t: VLLMClient | ReplicaPool,
        *,
        config: CoordinatorConfig,
        eos_ids: frozenset[int],
        max_len: int,
        stats: Statistics,
        channel: LockstepChannel,
        stop_token: int,
        capacity: int | None = None,
        vocab_size: int | None = None,
    ) -> None:
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
        self._recovery: Recovery  # built below, after the parts it drives; the callbacks before it read it later
        self._delivery = Delivery(theta, stats)
        self._table = LockstepTable()
        self.counters = self._table.counters
        # More sequences than a server runs at once would wait in its queue while the other
        # server runs them: a park at every step.
        self._placement = Placement(theta, t, per_server=capacity or config.max_batch_size, loads=self._table.loads)
        self._max_live = min(config.max_batch_size, self._placement.per_server * self._placement.fewest_replicas)
        self._requests = Requests(
            self._table,
            address=channel.address,
            top_k=config.top_k,
            stop_token=stop_token,
            max_len=max_len,
            on_end=lambda stream, task: self._recovery.stream_ended(stream, task),
        )
        self._admission = Admission(
            self._table,
            self._placement,
            self._requests,
            self._delivery,
            config=config,
            max_live=self._max_live,
            shell=self,
            holding=lambda: self._recovery.holding,
        )
        self._recovery = Recovery(
            self._table, self._placement, self._requests, self._admission, config=config, shell=self
        )
        self.gate = self._admission.gate
        self._probes: dict[int, asyncio.Future[wire.Report]] = {}  # check_plugin's requests: their reports
        self._loop_task: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._last_decision: float | None = None
        self.lock = asyncio.Lock()  # never held across a server call or a sleep (shell.py)
        self._background: set[asyncio.Task[None]] = set()

    @property
    def max_len(self) -> int:
        return self._max_len

    @property
    def capacity(self) -> int:
        """Sequences in flight at once: max_batch_size, or fewer if the servers run fewer."""
        return self._max_live

    def statistics(self) -> dict[str, float]:
        return {**self.counters.summary(self._stats.tokens), **self.gate.counters.summary()}

    def check(self, params: SamplingParams) -> None:
        return None  # every per-token setting is available

    async def check_plugin(self, engine: VLLMClient) -> None:
        """Raise LockstepUnavailableError unless `engine`'s plugin reports here and passes the
        start-up probe's checks (coordinator/lockstep/probe.py) against what this coordinator
        places on a server: a replica that rejoins its pool may have been restarted without
        the plugin, or with settings the coordinator was not sized for."""
        if self._table.closing:  # nobody reads the channel: every server would look like one without the plugin
            raise LifecycleError("the coordinator is closing: it checks no replica's plugin")
        self._listen()
        probe_id = self._requests.new_id()
        reported = self._probes[probe_id] = asyncio.get_running_loop().create_future()
        roles = self._placement.roles_on(engine)
        try:
            await probe_plugin(
                engine,
                address=self._channel.address,
                probe_id=probe_id,
                reported=reported,
                prompt_ids=[self._stop_token],
                stop_token=self._stop_token,
                timeout_s=self._config.request_timeout,
                needed=roles * min(self._placement.per_server, self._config.max_batch_size),
            )
        finally:
            del self._probes[probe_id]

    # -- lifecycle ---------------------------------------------------------------------

    def submit(self, sequences: list[SequenceState]) -> None:
        if self._table.closing:
            raise LifecycleError("the coordinator is closing")
        self._admission.queue(sequences)
        if self._recovery.dead:  # a server did not come back: nothing can run
            self._admission.fail_waiting(next(iter(self._recovery.dead.values())))
        self._listen()
        self._admission.admit()

    def _listen(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._receive_loop(), name="dualvllm-lockstep")
            self._watchdog = asyncio.create_task(self._watch_stalls(), name="dualvllm-lockstep-watchdog")

    async def close(self) -> None:
        """Fail what is unfinished, end every server request, then stop listening. Every wait
        is bounded: ShutdownTimeoutError names what did not end."""
        # A step in progress holds the lock for a decision, never across I/O.
        await bounded(self.lock.acquire(), what="the lockstep step in progress (its lock)", timeout_s=CLOSE_STEP_S)
        try:
            self._table.closing = True
            self._table.fail_all("the coordinator was closed before this sequence finished")
            self._admission.fail_waiting("the coordinator was closed before this sequence finished")
            self.send_ready()
        finally:
            self.lock.release()
        await self._requests.drain(DRAIN_S)  # each ends at its server's next report, answered END here
        try:
            await stop(
                self._watchdog,
                self._loop_task,
                *self._requests.tasks(),
                *self._background,
                what="the lockstep scheduler's tasks",
                timeout_s=CLOSE_STEP_S,
            )
        finally:
            self._channel.close()
        await bounded(self._delivery.aclose(), what="the detokenization of finished outputs", timeout_s=CLOSE_STEP_S)

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """Hold generation while the caller changes a server (a weight push): every sequence
        is taken off both servers at its agreed tokens and their requests end; after the
        block they start again from there, on whatever the servers then serve, as per-token
        mode's next step would."""
        async with self.lock:
            self._recovery.pauses += 1
        try:  # from here on the pause is undone on every path: a cancel during the drain included
            async with self.lock:
                for live in self._table.live:
                    self._recovery.take_off(live)
                self.send_ready()
            await self._requests.drain(DRAIN_S)  # each ends at its server's next step: END is the answer now
            yield
        finally:
            async with self.lock:
                self._recovery.pauses -= 1
                self.settle()

    def spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- reports -----------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        while True:
            received = await self._channel.receive_many()
            async with self.lock:
                try:
                    self._on_reports(received)
                    self.settle()
                except Exception as exc:  # a bug must not hang the servers or the callers
                    log.exception("lockstep step failed")
                    self._table.fail_all(f"internal error in the lockstep coordinator: {exc!r}")
                    self._table.end_undecided()
                    self.gate.disarm()
                    self.send_ready()

    def _on_reports(self, received: list[tuple[bytes, wire.Report | wire.WireError]]) -> None:
        """Take in the reports that arrived together (usually one per server), then decide
        every sequence they made ready in one step."""
        ready: list[Live] = []
        for identity, report in received:
            if isinstance(report, wire.WireError):
                log.error("dropping a malformed lockstep report: %s", report)
                for probe in self._probes.values():  # most likely the replica being checked (another dualvllm)
                    if not probe.done():
                        probe.set_exception(report)
                continue
            blocked, now_ready = self._table.report(identity, report, time.perf_counter())
            ready += now_ready
            for stream_id, probed in self._table.out.unknown:
                waiting = self._probes.get(stream_id)
                if waiting is not None and not waiting.done():
                    waiting.set_result(probed)
            self._table.out.unknown.clear()
            if self.gate.watching:
                self.gate.observe(blocked.server, set(report.ids.tolist()))
        if len(received) > 1:  # a later report may have failed one, or replaced a report whose
            # row it held (a plugin that gave up waiting and reported again)
            ready = self._table.rows.still_ready(ready)
        if ready:
            self._decide(ready)

    def settle(self) -> None:
        """After any change: break a deadlock, start what can start, answer what is decided.
        While an admission round holds the servers they wait on us, not on each other."""
        if not self._admission.held_rounds and waits.break_deadlock(self._table):
            self._recovery.resubmit_parked()
        self._admission.admit()
        self._admission.open_gate()
        self.send_ready()

    def _decide(self, ready: list[Live]) -> None:
        """Sample the next token of every sequence whose two rows are in, and answer both rows."""
        started = time.perf_counter()
        theta, t = self._table.rows.gather(ready, THETA), self._table.rows.gather(ready, T)
        sequences = list(map(_SEQ, ready))
        step = sample_rows(sequences, theta, t, self._config, self._vocab_size)
        record_rows(sequences, step, self._eos_ids, self._max_len, theta, t)
        self._table.decided(ready, step.token_ids)
        checking = [live for live in ready if live.seq.params.stop and not live.done] if any(map(_STOPS, ready)) else []
        if checking:  # most checks are settled here, from the tokens' own texts (coordinator/stop_filter.py)
            unsettled = self._delivery.unsettled([live.seq for live in checking])
            checking = [live for live, needs_check in zip(checking, unsettled) if needs_check]
        if checking:  # the servers have the token already; the sequence's next one waits for the check
            self._table.hold(checking)
            self.spawn(self._check_stop_strings(checking))
        now = time.perf_counter()
        merge_s, alpha_s, sample_s = step.phase_s
        # A "step" here is the time between two decisions: about one server decode step.
        interval = now - self._last_decision if self._last_decision is not None else now - started
        self._last_decision = now
        timing = StepTiming(
            batch=len(ready),
            theta_s=0.0,
            t_s=0.0,
            servers_s=max(interval - (now - started), 0.0),
            merge_s=merge_s,
            alpha_s=alpha_s,
            sample_s=sample_s,
            bookkeeping_s=(now - started) - (merge_s + alpha_s + sample_s),
            total_s=interval,
        )
        self._stats.record_step(
            len(ready),
            float(step.alpha.sum()),
            interval,
            float(step.coverage_theta.sum()),
            float(step.coverage_t.sum()),
            timing,
        )

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
            async with self.lock:
                ready = self._table.release(lives)
                if ready:
                    self._decide(ready)
                self.settle()

    def send_ready(self) -> None:
        """Hand finished sequences to their callers, and reply to every report whose rows are
        all decided, unless the admission gate holds them."""
        finished, self._table.out.finished = self._table.out.finished, []
        for seq in finished:
            self._delivery.retire(seq)
        if (self.gate.armed or self._admission.held_rounds) and not self._table.closing:
            return
        self._reply()

    def _reply(self, only: list[bytes] | None = None) -> None:
        """Send the replies of every decided report (of those from `only`)."""
        for identity, step, answers in self._table.replies(time.perf_counter(), only):
            self._channel.reply(identity, step, answers)

    async def _watch_stalls(self) -> None:
        """Park reports that wait too long on a server that is busy with other work; start
        sequences that wait for a replica that has since rejoined its pool (no report would)."""
        limit = self._config.lockstep_stall_timeout
        every = min(limit / 4, self._config.replica_probe_interval)
        pause = every
        while True:
            await asyncio.sleep(pause)
            async with self.lock:
                if not self._recovery.holding and self._admission.room():
                    self.settle()
                # Servers shared with other coordinators: a deadlock across them is broken here
                # within a few steps (waits.py), not after `limit`; never while our own admission
                # round holds the servers.
                now = time.perf_counter()
                shared = waits.any_shared(self._table)
                shared_limit = waits.shared_stall_limit(self._table, limit) if shared else limit
                pause = min(every, shared_limit / 2)
                held = self._admission.held_rounds > 0
                if (
                    shared
                    and not held
                    and self.gate.armed
                    and (released := waits.held_too_long(self._table, now, shared_limit))
                ):
                    self._reply(released)  # the gate stays armed: it opens once both servers block here
                waited = waits.park_stalled(self._table, now, limit, shared_limit if shared and not held else None)
                for wait_s in waited:
                    log.info(
                        "a lockstep report waited %.2f s on rows the other server has not reached; parking them", wait_s
                    )
                if waited:
                    self._recovery.resubmit_parked()
                    self.send_ready()
