"""Aligned admission for lockstep mode: both servers start a new sequence in the same step.

Why: a server's step is answered only when every row in it is decided, and a row needs the
other server's row at the same position. A sequence that one server admits a step before
the other puts every later step of that server behind the other's next one: the servers
then run strictly in turn (measured: 64% of reports completed over two of the partner's
steps at batch 8 and 64, benchmarks/README.md "Lockstep mode").

vLLM admits a request at the first scheduling pass after the request reaches its engine
core, and a server blocked in the plugin's wait cannot schedule. So new sequences are
sent while both servers are blocked here, and the blocked reports are answered only once
both servers have taken every new request in (their streamed answers have started: vLLM
starts one just before it hands the request to its engine) and a moment more for the
hand-over. Both servers then admit them in their next step.

The hand-over is not observable from outside vLLM, so that last moment adapts. After a
gate opens, the reports show in which of its steps each server admitted each new
sequence; a sequence the two servers admitted in different steps is a *miss*. A round
with a miss doubles the wait (up to MAX_DELAY_S); a round without shrinks it (down to
MIN_DELAY_S). Steps are counted from the gate on each server, so a scheduler that plans
a step ahead (vLLM's async scheduling on GPUs) delays both servers alike and is no miss.
A miss costs speed only: misaligned sequences are still decided correctly
(coordinator/lockstep/).

Idle servers have no blocked step to hold, so the first sequence starts alone (a *pilot*)
and the gate opens once both servers have reported it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

# The wait after sending: at least a front end's quickest hand-over, at most a bound that
# keeps a slow front end from stalling both servers for long.
MIN_DELAY_S = 0.001
INITIAL_DELAY_S = 0.002
MAX_DELAY_S = 0.05
# A server busy with other clients' work may not reach a step boundary for long, and a
# loaded front end may take long to take requests in; the other server is held at most
# this long for either before the waiting sequences start unaligned.
MAX_HOLD_S = 1.0
# Per round without a miss: slowly (14 rounds undo a doubling), as a misaligned sequence
# costs far more than a few held milliseconds.
SHRINK = 0.95
# A pair not seen on both servers within this many reports of either is settled as a miss.
LOOK_AHEAD_REPORTS = 4


@dataclass
class AdmissionCounters:
    rounds: int = 0  # gates opened with new sequences
    admitted: int = 0  # new sequences whose admission steps were compared
    misses: int = 0  # of those, sequences the two servers admitted in different steps
    forced: int = 0  # gates opened after MAX_HOLD_S without both servers blocked
    held_s: float = 0.0  # time from arming a gate to opening it, summed
    accept_s: float = 0.0  # time from sending a round's requests until the servers took all in, summed

    def summary(self) -> dict[str, float]:
        return {
            "lockstep_admission_rounds": self.rounds,
            "lockstep_admission_miss_share": self.misses / self.admitted if self.admitted else float("nan"),
            "lockstep_admission_hold_ms_mean": 1e3 * self.held_s / self.rounds if self.rounds else float("nan"),
            "lockstep_admission_forced": self.forced,
            "lockstep_admission_accept_ms_mean": 1e3 * self.accept_s / self.rounds if self.rounds else float("nan"),
        }


@dataclass
class AdmissionGate:
    """When the waiting sequences may start, and how long to hold the servers afterwards.

    A new sequence is a pair of requests, each a (server, lockstep request id)."""

    delay_s: float = INITIAL_DELAY_S
    armed_at: float | None = None  # waiting sequences are held until every busy server blocks
    counters: AdmissionCounters = field(default_factory=AdmissionCounters)
    # The last round: its pairs not resolved yet, and per server its reports since opening
    # and the report (1 = the first) in which each of its new requests first appeared.
    _pending: list[tuple[tuple[str, int], tuple[str, int]]] = field(default_factory=list)
    _reports: dict[str, int] = field(default_factory=dict)
    _first_seen: dict[tuple[str, int], int] = field(default_factory=dict)
    _missed: bool = False

    @property
    def armed(self) -> bool:
        return self.armed_at is not None

    def arm(self) -> None:
        if self.armed_at is None:
            self.armed_at = time.perf_counter()

    def disarm(self) -> None:
        self.armed_at = None

    def opened(self, pairs: list[tuple[tuple[str, int], tuple[str, int]]]) -> float:
        """The gate opened and started these sequences; returns how long to hold the servers.
        A round still unresolved is dropped: its late requests say nothing about this one's."""
        assert self.armed_at is not None, "opened() without arm()"
        self.counters.held_s += time.perf_counter() - self.armed_at
        self.armed_at = None
        if not pairs:
            return 0.0
        self.counters.rounds += 1
        self._pending = list(pairs)
        self._reports = {server: 0 for pair in pairs for server, _ in pair}
        self._first_seen = {}
        self._missed = False
        return self.delay_s

    @property
    def watching(self) -> bool:
        """A round is unresolved: reports must be observed (else `observe` may be skipped)."""
        return bool(self._reports)

    def observe(self, server: str | None, reported: set[int]) -> None:
        """A report from `server` (the ids of its lockstep rows) after the last opening."""
        if server not in self._reports:
            return
        self._reports[server] += 1
        n = self._reports[server]
        for pair in self._pending:
            for request in pair:
                if request[0] == server and request[1] in reported:
                    self._first_seen.setdefault(request, n)
        still: list[tuple[tuple[str, int], tuple[str, int]]] = []
        for pair in self._pending:
            seen = [self._first_seen.get(request) for request in pair]
            if None not in seen:
                self._resolve(seen[0] != seen[1])
            elif any(self._reports[request[0]] >= LOOK_AHEAD_REPORTS for request in pair):
                self._resolve(True)  # one server admitted it, the other not within as many steps
            else:
                still.append(pair)
        self._pending = still
        if not still and self._reports:  # the round is resolved: adapt the wait
            self.delay_s = (
                min(2 * self.delay_s, MAX_DELAY_S) if self._missed else max(SHRINK * self.delay_s, MIN_DELAY_S)
            )
            self._reports = {}

    def forget(self, request: tuple[str, int]) -> None:
        """`request` ended or broke before it was seen: its pair tells nothing."""
        self._pending = [pair for pair in self._pending if request not in pair]

    def _resolve(self, missed: bool) -> None:
        self.counters.admitted += 1
        self.counters.misses += missed
        self._missed |= missed
