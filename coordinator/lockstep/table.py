"""The lockstep table: lockstep mode's state machine, without I/O (sans-IO, as h11 under httpx).

Reports in; decisions to make, replies, resubmissions and finished sequences out, as data.
No sockets, no clock (callers pass `now`), no tasks: every rule here is tested synchronously
(tests/unit/coordinator/test_lockstep_table.py), and the asyncio shell (coordinator/lockstep/scheduler.py)
only moves messages between it and the servers.

The rules, per plugin report (one per server decode step):
- each row is (stream, position). A row at the sequence's next position waits until the
  other role's row for the same position has arrived; the pair is then *ready*, the shell
  decides its token (coordinator/step.py) and `decided` answers both rows with it, or END
  when that token finished the sequence. Rows of finished, failed or unknown streams get
  END; a row at a position already decided (a preempted request come back) gets the same
  token; a row past the agreed tokens, or a second row of a stream still waiting, is a
  divergence and fails its sequence only.
- a report is answered when all of its rows are decided: the server waits for all of them
  anyway, so one server may run a step ahead of the other on some sequences.
- a *parked* report has its undecided rows answered END and their sequences resent from
  their agreed tokens: how a deadlock or a stall is broken (coordinator/lockstep/waits.py
  finds them, `park` carries it out).

How it is stored: in arrays indexed by a slot per placed sequence (coordinator/lockstep/rows.py).
A report whose rows are all regular (known active streams of one role at their next
positions: every row of a steady batch) goes in through one compiled pass; any other report
goes through the rules row by row (`_report_rows`), which read and write the same arrays.
"""

from __future__ import annotations

import itertools
import operator
from collections import Counter, deque
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dualvllm.coordinator.lockstep.rows import ROLES, THETA, T, Rows
from dualvllm.coordinator.sequence import SequenceState
from dualvllm.engines.protocol import TopKBatch
from dualvllm.engines.vllm_plugin import wire

__all__ = ["ROLES", "THETA", "T", "UNSET", "Blocked", "Live", "LockstepTable", "Stream", "gather"]

UNSET = -2  # a report row not decided yet


@dataclass(eq=False)
class Blocked:
    """A server's report, waiting for its reply."""

    identity: bytes
    report: wire.Report
    answers: np.ndarray  # int64 [n], UNSET until decided
    arrived: float
    server: str | None  # the server the rows belong to (None: no known rows)
    role: int = -1  # its role (THETA or T) once `server` is known
    # The other server's reports whose rows were paired with these: more than one means that
    # server reported these sequences over several of its steps (one server ran ahead).
    partners: set[Blocked] = field(default_factory=set)
    # The servers its rows' other halves run on, taken as the rows arrived: a superset of what
    # its undecided rows wait on, enough to rule a deadlock out without a pass over the rows.
    needs: set[str] = field(default_factory=set)
    number: int = -1  # how the table's row arrays refer to it

    def undecided(self) -> np.ndarray:
        return np.flatnonzero(self.answers == UNSET)


@dataclass(eq=False)
class Live:
    """A sequence placed on one server per role: its two streams and their waiting rows."""

    seq: SequenceState
    # The server of each role it runs on (the shell's client: anything with a `.url`).
    engines: list[Any] = field(default_factory=lambda: [None, None])
    streams: list[Stream | None] = field(default_factory=lambda: [None, None])
    resubmissions: int = 0  # requests the servers ended on their own (parks are not counted)
    request_failures: int = 0  # requests that broke and were resent
    done: bool = False  # finished, failed or cancelled, and handed to the caller
    # Its last token's stop strings are being checked (a detokenization): its next pair waits.
    checking: bool = False
    placed: bool = False  # counted in the table's loads (on its servers, not suspended)
    slot: int = -1  # its index in the table's arrays while placed
    table: LockstepTable | None = None

    @property
    def rows(self) -> tuple[tuple[Blocked, int] | None, tuple[Blocked, int] | None]:
        """Its waiting row of each role: (the report, the row's index in it), or None."""
        if self.table is None or self.slot < 0:
            return None, None
        return self.table.rows.row(self, THETA), self.table.rows.row(self, T)


@dataclass(eq=False)
class Stream:
    """One lockstep request on one server."""

    id: int
    live: Live
    role: int
    engine: Any
    offset: int
    retired: bool = False  # parked, ended or replaced: its rows get END, its end is expected


@dataclass
class LockstepCounters:
    reports: int = 0
    parks: int = 0  # rows parked to break a deadlock or a stall
    resubmissions: int = 0  # requests resent from their agreed tokens (parks, early ends)
    split_reports: int = 0  # replied reports whose rows the other server sent over 2+ of its steps
    suspensions: int = 0  # sequences taken off both servers (a broken request, a pause) and restarted
    wait_s: float = 0.0  # summed time reports waited here for their reply
    replies: int = 0
    regular_reports: int = 0  # reports taken in whole by the vectorized path

    def summary(self, tokens: int) -> dict[str, float]:
        per_1k = 1000.0 / tokens if tokens else float("nan")
        return {
            "lockstep_reports": self.reports,
            "lockstep_parks": self.parks,
            "lockstep_suspensions": self.suspensions,
            "lockstep_resubmissions_per_1k_tokens": self.resubmissions * per_1k,
            "lockstep_split_report_share": self.split_reports / self.replies if self.replies else float("nan"),
            "lockstep_server_wait_ms_mean": 1e3 * self.wait_s / self.replies if self.replies else float("nan"),
            "lockstep_regular_report_share": self.regular_reports / self.reports if self.reports else float("nan"),
        }


@dataclass
class Outbox:
    """What the table decided that the shell must carry out; the shell empties it after each call."""

    finished: list[SequenceState] = field(default_factory=list)  # over (a finish reason set): to the caller
    resubmit: list[tuple[Live, int]] = field(default_factory=list)  # (sequence, role) to resend from its agreed tokens
    unknown: list[tuple[int, wire.Report]] = field(default_factory=list)  # rows of ids not in the table (probes)


_FINISH = operator.attrgetter("seq.finish_reason")
STEP_WINDOW = 64  # server steps remembered (LockstepTable.server_steps_s)
MAX_CONNECTIONS = 4096  # replies remembered per connection before the memory is cleared


class LockstepTable:
    """Pairs rows, answers reports, finds deadlocks and stalls; see the module docstring."""

    def __init__(self) -> None:
        self._live: dict[Live, None] = {}  # placed and not done, in the order they started
        self.streams: dict[int, Stream] = {}
        self.blocked: dict[bytes, Blocked] = {}
        self.loads: Counter[str] = Counter()  # placed sequences per server url
        self.counters = LockstepCounters()
        self.out = Outbox()
        self.closing = False  # every row gets END from now on
        self.rows = Rows(self.streams)  # where the rows wait (coordinator/lockstep/rows.py)
        # How long servers took from a reply to their next report (their step, and any wait on
        # other coordinators), the most recent first: what a normal wait on a server looks like.
        self.server_steps_s: deque[float] = deque(maxlen=STEP_WINDOW)
        self._replied_at: dict[bytes, float] = {}  # per connection: its last reply's time

    @property
    def live(self) -> list[Live]:
        return list(self._live)

    def __len__(self) -> int:
        return len(self._live)

    # -- sequences and streams -----------------------------------------------------------

    def add(self, live: Live) -> None:
        """`live` starts on its placed engines (one per role)."""
        assert all(engine is not None for engine in live.engines), "a sequence starts only once placed"
        self._live[live] = None
        live.placed = True
        live.table = self
        self.loads.update(engine.url for engine in live.engines)
        self.rows.place(live)

    def open_stream(self, live: Live, role: int, stream_id: int, offset: int) -> Stream:
        stream = Stream(id=stream_id, live=live, role=role, engine=live.engines[role], offset=offset)
        live.streams[role] = stream
        self.streams[stream_id] = stream
        self.rows.index_stale = True
        return stream

    def stream_ended(self, stream: Stream) -> bool:
        """The server request of `stream` ended. True when that was unexpected and its sequence
        must go on (the shell resends, suspends or fails it); False when it was retired."""
        self.streams.pop(stream.id, None)
        self.rows.index_stale = True
        if stream.retired or self.closing:
            return False
        stream.retired = True
        live = stream.live
        live.streams[stream.role] = None
        if live.done:
            return False
        # A row of this stream still waits here although its request ended: the plugin gave up
        # waiting (its timeout ended the row there, and its next report comes from a new
        # socket, so the replaced report's rows are never forgotten). Drop the row, or the
        # resent stream's first report would be taken for a divergence.
        self.rows.end_row(live, stream.role)
        return True

    def finish(self, live: Live) -> None:
        """`live`'s sequence is over: END its waiting rows (its streams get END when they report
        next) and hand it to its caller."""
        if live.done:
            return
        live.done = True
        self._release(live)
        if live.seq.finish_reason is None:
            live.seq.fail("the sequence ended without a finish reason")  # never expected
        self.out.finished.append(live.seq)

    def fail(self, live: Live, reason: str) -> None:
        if not live.done:
            live.seq.fail(reason)
            self.finish(live)

    def fail_all(self, reason: str) -> None:
        for live in self.live:
            self.fail(live, reason)

    def take_off(self, live: Live) -> list[Stream]:
        """End `live`'s streams (each at its next report) and its waiting rows, to start it again
        later from its agreed tokens -> the streams retired."""
        retired = [stream for stream in live.streams if stream is not None]
        self._release(live)
        self.counters.suspensions += 1
        return retired

    def _release(self, live: Live) -> None:
        for role in ROLES:
            self.rows.end_row(live, role)
        for stream in live.streams:
            if stream is not None:
                stream.retired = True
        live.streams = [None, None]
        self.rows.index_stale = True
        if live.placed:
            live.placed = False
            self.loads.subtract(engine.url for engine in live.engines)
            self._live.pop(live, None)
            self.rows.free(live)

    # -- reports -------------------------------------------------------------------------

    def report(self, identity: bytes, report: wire.Report, now: float) -> tuple[Blocked, list[Live]]:
        """Take in one server's step -> (its waiting report, the sequences now ready to decide)."""
        self.counters.reports += 1
        replied = self._replied_at.pop(identity, None)
        if replied is not None:
            self.server_steps_s.appendleft(now - replied)
        n = len(report.ids)
        blocked = Blocked(identity, report, np.full(n, UNSET, dtype=np.int64), now, server=None)
        stale = self.blocked.pop(identity, None)
        if stale is not None:  # the plugin gave up on it (timeout): its rows were ended there
            self.rows.drop_report(stale, forget_rows=True)
        self.blocked[identity] = blocked
        self.rows.add_report(blocked)
        if self.closing:
            blocked.answers[:] = wire.END
            return blocked, []
        ready = self.rows.take_regular(blocked)
        if ready is not None:
            self.counters.regular_reports += 1
            return blocked, ready
        return blocked, self._report_rows(blocked)

    def _report_rows(self, blocked: Blocked) -> list[Live]:
        """The rules, row by row (see the module docstring)."""
        report = blocked.report
        n = len(report.ids)
        ready: list[Live] = []
        ended: list[int] = []  # rows answered END
        failed = False  # a sequence failed here, which may have been counted ready before
        needs = blocked.needs
        last = None
        rows = self.rows
        for i, stream, position in zip(range(n), map(self.streams.get, report.ids.tolist()), report.positions.tolist()):
            if stream is None:
                self.out.unknown.append((int(report.ids[i]), report))
                ended.append(i)
                continue
            live = stream.live
            if stream.retired or live.done:
                ended.append(i)
                continue
            last, role, seq = stream, stream.role, live.seq
            agreed = len(seq.tokens)
            if position == agreed and rows.row(live, role) is None and not seq.cancelled:
                rows.set_row(live, role, blocked, i)
                if rows.row(live, 1 - role) is not None and not live.checking:
                    ready.append(live)
                else:
                    needs.add(live.engines[1 - role].url)
            elif seq.cancelled:
                self.fail(live, "cancelled by the caller")
                ended.append(i)
                failed = True
            elif position < agreed:  # a preempted request come back: decided already
                blocked.answers[i] = seq.tokens[position]
            else:  # past the agreed tokens, or a second row of the stream while one waits
                self.fail(
                    live,
                    f"{stream.engine.name} server reported position {position} of a sequence agreed "
                    f"up to {agreed} tokens: the two servers diverged",
                )
                ended.append(i)
                failed = True
        if ended:
            blocked.answers[ended] = wire.END
        if last is not None:  # a report's rows all come from one server
            blocked.server, blocked.role = last.engine.url, last.role
        return [live for live in ready if not live.done] if failed else ready

    def decided(self, ready: list[Live], tokens: list[int] | np.ndarray) -> None:
        """Answer both rows of each ready sequence with its token (END if the token finished it);
        the tokens are recorded in the sequences already."""
        if not ready:
            return
        finished = np.fromiter((reason is not None for reason in map(_FINISH, ready)), np.bool_, len(ready))
        self.rows.answer(ready, np.where(finished, wire.END, np.asarray(tokens, dtype=np.int64)))
        if finished.any():
            for live in itertools.compress(ready, finished.tolist()):
                self.finish(live)

    def hold(self, lives: list[Live]) -> None:
        """Their stop strings are being checked: their next pair is not ready until `release`."""
        for live in lives:
            live.checking = True
            self.rows.hold(live, True)

    def release(self, lives: list[Live]) -> list[Live]:
        """Their stop strings were checked: finish those that stopped -> those now ready."""
        ready = []
        for live in lives:
            live.checking = False
            self.rows.hold(live, False)
            if live.done:
                continue
            if live.seq.finish_reason is not None:
                self.finish(live)
            elif self.rows.paired(live):
                ready.append(live)
        return ready

    def end_undecided(self) -> None:
        """END every undecided row (after an internal error, so no server waits on it)."""
        for blocked in self.blocked.values():
            blocked.answers[blocked.answers == UNSET] = wire.END
        self.rows.end_all()

    def replies(self, now: float, only: Collection[bytes] | None = None) -> list[tuple[bytes, int, np.ndarray]]:
        """(identity, step, answers) of every report (of those from `only`) whose rows are all
        decided; they leave the table."""
        if len(self._replied_at) > MAX_CONNECTIONS:  # connections gone without a last report
            self._replied_at.clear()
        out = []
        for identity, blocked in list(self.blocked.items()):
            if (only is not None and identity not in only) or (blocked.answers == UNSET).any():
                continue
            self._replied_at[identity] = now
            del self.blocked[identity]
            self.rows.drop_report(blocked)
            self.counters.replies += 1
            self.counters.split_reports += len(blocked.partners) > 1
            self.counters.wait_s += now - blocked.arrived
            out.append((identity, blocked.report.step, blocked.answers))
        return out

    # -- parks (coordinator/lockstep/waits.py finds what to park) -------------------------

    def park(self, blocked: Blocked) -> None:
        """END the undecided rows of `blocked` and resend their sequences from the agreed tokens."""
        for i in blocked.undecided().tolist():
            blocked.answers[i] = wire.END
            stream = self.streams.get(int(blocked.report.ids[i]))
            if stream is None:
                continue
            stream.retired = True
            self.rows.index_stale = True
            live = stream.live
            self.rows.set_row(live, stream.role, None)
            self.counters.parks += 1
            if not live.done:
                self.out.resubmit.append((live, stream.role))


def gather(ready: list[Live], role: int) -> TopKBatch:
    """The waiting rows of `role` of the ready sequences (see Rows.gather)."""
    table = ready[0].table
    assert table is not None, "a ready sequence is placed in a table"
    return table.rows.gather(ready, role)
