"""Lockstep admission: which waiting sequence starts when, so that both servers admit it in
the same step.

A sequence started while one server is mid-step and the other blocked here is admitted a
step apart: the first server's row waits here a whole step for the other's (and more
sequences make a deadlock likelier). So new sequences start while both servers are blocked
here, and their replies are held a moment (`coordinator/admission.py`'s gate sizes it) so
that both servers take the new requests in before their next step. A server that is idle
never blocks here: the first sequence starts alone (a pilot). Sequences taken off their
servers (a broken request, a pause) start again first, from their agreed tokens.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

from dualvllm.coordinator.admission import MAX_HOLD_S, AdmissionGate
from dualvllm.coordinator.config import CoordinatorConfig
from dualvllm.coordinator.delivery import Delivery
from dualvllm.coordinator.lockstep.placement import Placement
from dualvllm.coordinator.lockstep.requests import Requests
from dualvllm.coordinator.lockstep.shell import Shell
from dualvllm.coordinator.lockstep import waits
from dualvllm.coordinator.lockstep.table import ROLES, Live, LockstepTable, Stream
from dualvllm.coordinator.sequence import SequenceState

log = logging.getLogger("dualvllm.coordinator")


class Admission:
    def __init__(
        self,
        table: LockstepTable,
        placement: Placement,
        requests: Requests,
        delivery: Delivery,
        *,
        config: CoordinatorConfig,
        max_live: int,
        shell: Shell,
        holding: Callable[[], bool],
    ) -> None:
        """`max_live`: sequences in flight at once; `holding()`: nothing may start now (a server
        is coming back, a caller paused generation)."""
        self._table = table
        self._placement = placement
        self._requests = requests
        self._delivery = delivery
        self._aligned = config.lockstep_aligned_admission
        self._max_live = max_live
        self._shell = shell
        self._holding = holding
        self._waiting: deque[SequenceState] = deque()
        self._suspended: deque[Live] = deque()  # taken off their servers; first to start again
        # Admission rounds whose hold has not ended: replies wait.
        self.held_rounds = 0
        self.gate = AdmissionGate()

    def queue(self, sequences: list[SequenceState]) -> None:
        self._waiting.extend(sequences)

    def requeue(self, live: Live) -> None:
        """`live` was taken off its servers: it starts again first, from its agreed tokens.
        Nothing starts before the hold ends, so no server may be held meanwhile."""
        self._suspended.append(live)
        self.gate.disarm()

    @property
    def suspended(self) -> int:
        return len(self._suspended)

    def fail_waiting(self, reason: str) -> None:
        for seq in [*self._waiting, *(live.seq for live in self._suspended)]:
            if not seq.cancelled:
                seq.fail(reason)
                self._delivery.deliver(seq, text="")
        self._waiting.clear()
        self._suspended.clear()

    def room(self) -> bool:
        """A sequence waits, and both roles have a server with room for it."""
        while self._waiting and self._waiting[0].cancelled:
            self._waiting.popleft()
        while self._suspended and self._suspended[0].seq.cancelled:
            self._suspended.popleft().done = True
        return (
            bool(self._waiting or self._suspended) and len(self._table) < self._max_live and self._placement.has_slot()
        )

    def admit(self) -> None:
        """Start waiting sequences when there is room: through the gate while the servers run,
        the first one alone (a pilot) on a server that is idle."""
        if self._table.closing or self._holding() or not self.room():
            return
        if not self._aligned:
            while self.room():
                self._start()
            return
        targets = self._placement.servers()
        if not targets <= waits.blocked_servers(self._table) | waits.busy_servers(
            self._table
        ):  # one would never block here
            self._start()
        if self.room() and not self.gate.armed:
            self.gate.arm()
            self._shell.spawn(self._open_after(MAX_HOLD_S, self.gate.armed_at))

    def open_gate(self, *, force: bool = False) -> None:
        """Start the waiting sequences if both servers are blocked here (or `force`), and hold
        the servers' replies (`_hold`)."""
        if not self.gate.armed or not (force or self._placement.servers() <= waits.blocked_servers(self._table)):
            return
        started = []
        while self.room() and not self._holding():
            started.append(self._start())
        pairs = []
        for live in started:
            theta, t = live.streams
            assert theta is not None and t is not None, "_start opened both streams"
            pairs.append(((theta.engine.url, theta.id), (t.engine.url, t.id)))
        hold_s = self.gate.opened(pairs)
        streams = [stream for live in started for stream in live.streams if stream is not None]
        if streams:
            self.held_rounds += 1
            self._shell.spawn(self._hold(streams, hold_s))

    def _start(self) -> Live:
        """Start the sequence that waited longest (a suspended one first) on its servers."""
        live = self._suspended.popleft() if self._suspended else Live(self._waiting.popleft())
        self._placement.place(live)
        self._table.add(live)
        for role in ROLES:
            self._requests.start(live, role)
        return live

    async def _hold(self, streams: list[Stream], hold_s: float) -> None:
        """Keep the servers waiting (their replies held) until both have taken every new request
        in, and `hold_s` more for the requests to reach their engines; then answer them."""
        try:
            sent = time.perf_counter()
            await asyncio.wait(self._requests.accepted(streams), timeout=MAX_HOLD_S)
            self.gate.counters.accept_s += time.perf_counter() - sent
            await asyncio.sleep(hold_s)
        finally:
            async with self._shell.lock:
                self.held_rounds -= 1
                self._shell.settle()

    async def _open_after(self, delay_s: float, armed_at: float | None) -> None:
        """A server that does not block here within `delay_s` (its batch busy with other work)
        must not hold the other one longer: start the waiting sequences unaligned."""
        await asyncio.sleep(delay_s)
        async with self._shell.lock:
            if self.gate.armed_at == armed_at and not self._table.closing:
                log.info("lockstep: a server did not reach a step boundary within %.2f s; admitting unaligned", delay_s)
                self.gate.counters.forced += 1
                self.open_gate(force=True)
                self._shell.send_ready()
