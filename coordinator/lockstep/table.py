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

How it is stored: every placed sequence holds a *slot*, and the per-step state lives in
arrays indexed by slot (the report and row each role's waiting row is in, the agreed length,
whether a stop-string check holds it), beside a sorted index of the active stream ids. A
report whose rows are all regular (known active streams of one role, each at its sequence's
next position, its role's slot free: every row of a steady batch) is taken in by one
compiled pass (`_report_regular`, numba); any other report goes through the rules row by row
(`_report_rows`), which read and write the same arrays. At batch 256 the compiled pass took
0.8 µs of coordinator CPU per token where the rules row by row took 2.9
(`python benchmarks/lockstep_step.py --paths`).
"""

from __future__ import annotations

import itertools
import operator
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, cast

import numba
import numpy as np

from dualvllm.coordinator.sequence import SequenceState
from dualvllm.engines.protocol import PAD_TOKEN_ID, TopKBatch
from dualvllm.engines.vllm_plugin import wire

UNSET = -2  # a report row not decided yet
THETA, T = 0, 1
ROLES = (THETA, T)
NO_ROW = -1  # a slot's role has no waiting row
FIRST_SLOTS = 64  # slot arrays start this long and double when full


@dataclass(eq=False)
class Blocked:
    """A server's report, waiting for its reply."""

    identity: bytes
    report: wire.Report
    answers: np.ndarray  # int64 [n], UNSET until decided
    arrived: float
    server: str | None  # the server the rows belong to (None: no known rows)
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
        return self.table.row(self, THETA), self.table.row(self, T)


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


_CANCELLED = operator.attrgetter("seq.cancelled")
_TOKENS = operator.attrgetter("seq.tokens")
_FINISH = operator.attrgetter("seq.finish_reason")
_SLOT = operator.attrgetter("slot")


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
        # Slot arrays (see the module docstring).
        self._at_slot: list[Live | None] = [None] * FIRST_SLOTS
        self._free = list(range(FIRST_SLOTS - 1, -1, -1))  # popped from the end: lowest first
        self._row_report = np.full((2, FIRST_SLOTS), NO_ROW, dtype=np.int64)  # Blocked.number
        self._row_index = np.zeros((2, FIRST_SLOTS), dtype=np.int64)
        self._agreed = np.zeros(FIRST_SLOTS, dtype=np.int64)  # len(seq.tokens)
        self._checking = np.zeros(FIRST_SLOTS, dtype=np.bool_)
        self._server = np.full((2, FIRST_SLOTS), -1, dtype=np.int64)  # each role's server, as a code
        self._codes: dict[str, int] = {}
        self._urls: list[str] = []
        self._reports: dict[int, Blocked] = {}  # by number: every report in `blocked`
        self._numbers = itertools.count()
        # The active streams, sorted by id, for the vectorized path; rebuilt after any change.
        self._index_stale = True
        self._ids = np.empty(0, dtype=np.int64)
        self._id_slot = np.empty(0, dtype=np.int64)
        self._id_role = np.empty(0, dtype=np.int64)

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
        self.loads.update(engine.url for engine in live.engines)
        if not self._free:
            self._grow()
        slot = live.slot = self._free.pop()
        live.table = self
        self._at_slot[slot] = live
        self._row_report[:, slot] = NO_ROW
        self._agreed[slot] = len(live.seq.tokens)
        self._checking[slot] = live.checking
        for role in ROLES:
            self._server[role, slot] = self._code(live.engines[role].url)
        self._index_stale = True

    def open_stream(self, live: Live, role: int, stream_id: int, offset: int) -> Stream:
        stream = Stream(id=stream_id, live=live, role=role, engine=live.engines[role], offset=offset)
        live.streams[role] = stream
        self.streams[stream_id] = stream
        self._index_stale = True
        return stream

    def stream_ended(self, stream: Stream) -> bool:
        """The server request of `stream` ended. True when that was unexpected and its sequence
        must go on (the shell resends, suspends or fails it); False when it was retired."""
        self.streams.pop(stream.id, None)
        self._index_stale = True
        if stream.retired or self.closing:
            return False
        stream.retired = True
        live = stream.live
        live.streams[stream.role] = None
        if live.done:
            return False
        # A row of this stream still waits here although its request ended: the plugin gave up
        # waiting (its timeout ended the row there, and its next report comes from a new
        # socket, so `_forget` never sees it). Drop the row, or the resent stream's first
        # report would be taken for a divergence.
        self._end_row(live, stream.role)
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
            self._end_row(live, role)
        for stream in live.streams:
            if stream is not None:
                stream.retired = True
        live.streams = [None, None]
        self._index_stale = True
        if live.placed:
            live.placed = False
            self.loads.subtract(engine.url for engine in live.engines)
            self._live.pop(live, None)
            self._at_slot[live.slot] = None
            self._free.append(live.slot)
            live.slot = -1

    # -- rows ----------------------------------------------------------------------------

    def row(self, live: Live, role: int) -> tuple[Blocked, int] | None:
        """`live`'s waiting row of `role`: (its report, its index there), or None."""
        if live.slot < 0 or self._row_report[role, live.slot] == NO_ROW:
            return None
        return self._reports[int(self._row_report[role, live.slot])], int(self._row_index[role, live.slot])

    def paired(self, live: Live) -> bool:
        """Both of `live`'s rows wait here."""
        return live.slot >= 0 and bool((self._row_report[:, live.slot] != NO_ROW).all())

    def still_ready(self, ready: list[Live]) -> list[Live]:
        """Those of `ready` that are placed with both rows waiting still (a later report of the
        same batch may have failed one, or replaced the report whose row it held)."""
        slots = np.fromiter(map(_SLOT, ready), np.int64, len(ready))
        placed = slots >= 0  # a finished or failed sequence left its slot
        keep = placed.copy()
        keep[placed] = (self._row_report[:, slots[placed]] != NO_ROW).all(axis=0)
        return list(itertools.compress(ready, keep.tolist()))

    def _end_row(self, live: Live, role: int) -> None:
        """Answer `live`'s waiting row of `role` END and forget it."""
        row = self.row(live, role)
        if row is not None:
            row[0].answers[row[1]] = wire.END
            self._row_report[role, live.slot] = NO_ROW

    # -- reports -------------------------------------------------------------------------

    def report(self, identity: bytes, report: wire.Report, now: float) -> tuple[Blocked, list[Live]]:
        """Take in one server's step -> (its waiting report, the sequences now ready to decide)."""
        self.counters.reports += 1
        n = len(report.ids)
        blocked = Blocked(identity, report, np.full(n, UNSET, dtype=np.int64), now, server=None)
        blocked.number = next(self._numbers)
        stale = self.blocked.pop(identity, None)
        if stale is not None:  # the plugin gave up on it (timeout): its rows were ended there
            self._forget(stale)
        self.blocked[identity] = blocked
        self._reports[blocked.number] = blocked
        if self.closing:
            blocked.answers[:] = wire.END
            return blocked, []
        ready = self._report_regular(blocked)
        if ready is not None:
            self.counters.regular_reports += 1
            return blocked, ready
        return blocked, self._report_rows(blocked)

    def _report_regular(self, blocked: Blocked) -> list[Live] | None:
        """Take every row of `blocked` in at once if each is a known active stream's row at its
        sequence's next position, its role's slot free, all of one role -> the sequences now
        ready; None (nothing changed) if any row is not, for the row-by-row rules."""
        ids, positions = blocked.report.ids, blocked.report.positions
        n = len(ids)
        if self._index_stale:
            self._rebuild_index()
        slots, ready = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.bool_)
        waiting = np.zeros(len(self._urls), dtype=np.bool_)
        role = _take_regular(
            np.ascontiguousarray(ids, dtype=np.int64),
            np.ascontiguousarray(positions, dtype=np.int64),
            self._ids,
            self._id_slot,
            self._id_role,
            self._agreed,
            self._row_report,
            self._row_index,
            self._checking,
            self._server,
            blocked.number,
            slots,
            ready,
            waiting,
        )
        if role < 0:
            return None
        # Every slot here is placed: the index holds only placed sequences' streams.
        lives = cast(list[Live], list(map(self._at_slot.__getitem__, slots.tolist())))
        if any(map(_CANCELLED, lives)):  # the rules fail it: undo, and go row by row
            self._row_report[role, slots] = NO_ROW
            return None
        blocked.server = self._urls[self._server[role, slots[0]]]
        blocked.needs.update(map(self._urls.__getitem__, np.flatnonzero(waiting).tolist()))
        return list(itertools.compress(lives, ready.tolist()))

    def _report_rows(self, blocked: Blocked) -> list[Live]:
        """The rules, row by row (see the module docstring)."""
        report = blocked.report
        n = len(report.ids)
        ready: list[Live] = []
        ended: list[int] = []  # rows answered END
        failed = False  # a sequence failed here, which may have been counted ready before
        needs = blocked.needs
        last = None
        row_report, row_index = self._row_report, self._row_index
        for i, stream, position in zip(range(n), map(self.streams.get, report.ids.tolist()), report.positions.tolist()):
            if stream is None:
                self.out.unknown.append((int(report.ids[i]), report))
                ended.append(i)
                continue
            live = stream.live
            if stream.retired or live.done:
                ended.append(i)
                continue
            last, role, seq, slot = stream, stream.role, live.seq, live.slot
            agreed = len(seq.tokens)
            if position == agreed and row_report[role, slot] == NO_ROW and not seq.cancelled:
                row_report[role, slot], row_index[role, slot] = blocked.number, i
                if row_report[1 - role, slot] != NO_ROW and not live.checking:
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
            blocked.server = last.engine.url
        return [live for live in ready if not live.done] if failed else ready

    def decided(self, ready: list[Live], tokens: list[int] | np.ndarray) -> None:
        """Answer both rows of each ready sequence with its token (END if the token finished it):
        one vectorized write per pair of reports the rows came in (usually one pair). The
        tokens are recorded in the sequences already."""
        if not ready:
            return
        n = len(ready)
        slots = np.fromiter(map(_SLOT, ready), np.int64, n)
        finished = np.fromiter((reason is not None for reason in map(_FINISH, ready)), np.bool_, n)
        answers = np.where(finished, wire.END, np.asarray(tokens, dtype=np.int64))
        theta_numbers, t_numbers = self._row_report[THETA, slots], self._row_report[T, slots]
        if (theta_numbers == theta_numbers[0]).all() and (t_numbers == t_numbers[0]).all():
            self._answer(int(theta_numbers[0]), int(t_numbers[0]), slots, answers)
        else:  # rows of several pairs of reports (replicas, or one server ran ahead)
            pairs = np.stack((theta_numbers, t_numbers), axis=1)
            unique, codes = np.unique(pairs, axis=0, return_inverse=True)
            for k, (theta_number, t_number) in enumerate(unique.tolist()):
                group = np.flatnonzero(codes.reshape(-1) == k)
                self._answer(theta_number, t_number, slots[group], answers[group])
        self._row_report[:, slots] = NO_ROW
        self._agreed[slots] = np.fromiter(map(len, map(_TOKENS, ready)), np.int64, n)
        if finished.any():
            for live in itertools.compress(ready, finished.tolist()):
                self.finish(live)

    def _answer(self, theta_number: int, t_number: int, slots: np.ndarray, answers: np.ndarray) -> None:
        """Write decided rows' answers into the pair of reports they came in, and link the two."""
        theta_blocked, t_blocked = self._reports[theta_number], self._reports[t_number]
        theta_blocked.answers[self._row_index[THETA, slots]] = answers
        t_blocked.answers[self._row_index[T, slots]] = answers
        theta_blocked.partners.add(t_blocked)
        t_blocked.partners.add(theta_blocked)

    def hold(self, lives: list[Live]) -> None:
        """Their stop strings are being checked: their next pair is not ready until `release`."""
        for live in lives:
            live.checking = True
            if live.slot >= 0:
                self._checking[live.slot] = True

    def release(self, lives: list[Live]) -> list[Live]:
        """Their stop strings were checked: finish those that stopped -> those now ready."""
        ready = []
        for live in lives:
            live.checking = False
            if live.slot >= 0:
                self._checking[live.slot] = False
            if live.done:
                continue
            if live.seq.finish_reason is not None:
                self.finish(live)
            elif self.paired(live):
                ready.append(live)
        return ready

    def end_undecided(self) -> None:
        """END every undecided row (after an internal error, so no server waits on it)."""
        for blocked in self.blocked.values():
            blocked.answers[blocked.answers == UNSET] = wire.END
        self._row_report[:] = NO_ROW

    def replies(self, now: float) -> list[tuple[bytes, int, np.ndarray]]:
        """(identity, step, answers) of every report whose rows are all decided; they leave the table."""
        out = []
        for identity, blocked in list(self.blocked.items()):
            if (blocked.answers == UNSET).any():
                continue
            del self.blocked[identity]
            del self._reports[blocked.number]
            self.counters.replies += 1
            self.counters.split_reports += len(blocked.partners) > 1
            self.counters.wait_s += now - blocked.arrived
            out.append((identity, blocked.report.step, blocked.answers))
        return out

    def _forget(self, blocked: Blocked) -> None:
        self._row_report[self._row_report == blocked.number] = NO_ROW
        del self._reports[blocked.number]

    # -- parks (coordinator/lockstep/waits.py finds what to park) -------------------------

    def park(self, blocked: Blocked) -> None:
        """END the undecided rows of `blocked` and resend their sequences from the agreed tokens."""
        for i in blocked.undecided().tolist():
            blocked.answers[i] = wire.END
            stream = self.streams.get(int(blocked.report.ids[i]))
            if stream is None:
                continue
            stream.retired = True
            self._index_stale = True
            live = stream.live
            if live.slot >= 0:
                self._row_report[stream.role, live.slot] = NO_ROW
            self.counters.parks += 1
            if not live.done:
                self.out.resubmit.append((live, stream.role))

    # -- the steps' arrays ---------------------------------------------------------------

    def gather(self, ready: list[Live], role: int) -> TopKBatch:
        """The waiting rows of `role` of the ready sequences, in their order: one gather per report
        they came in (usually one, and often every row of it in order: no gather)."""
        slots = np.fromiter(map(_SLOT, ready), np.int64, len(ready))
        numbers, rows = self._row_report[role, slots], self._row_index[role, slots]
        if (numbers == numbers[0]).all():
            report = self._reports[int(numbers[0])].report
            if len(rows) == len(report.ids) and (rows == np.arange(len(rows))).all():
                return TopKBatch(
                    token_ids=report.token_ids.astype(np.int64), logprobs=report.logprobs.astype(np.float64)
                )
            return TopKBatch(
                token_ids=report.token_ids[rows].astype(np.int64), logprobs=report.logprobs[rows].astype(np.float64)
            )
        # Rows from several reports (one server ran ahead on some sequences, or replicas).
        reports = {number: self._reports[number].report for number in np.unique(numbers).tolist()}
        width = max(report.token_ids.shape[1] for report in reports.values())
        ids = np.full((len(ready), width), PAD_TOKEN_ID, dtype=np.int64)
        logprobs = np.full((len(ready), width), -np.inf)
        for number, report in reports.items():
            places = np.flatnonzero(numbers == number)
            width_k = report.token_ids.shape[1]
            ids[places, :width_k] = report.token_ids[rows[places]]
            logprobs[places, :width_k] = report.logprobs[rows[places]]
        return TopKBatch(token_ids=ids, logprobs=logprobs)

    # -- slots and the stream index --------------------------------------------------------

    def _code(self, url: str) -> int:
        code = self._codes.get(url)
        if code is None:
            code = self._codes[url] = len(self._urls)
            self._urls.append(url)
        return code

    def _grow(self) -> None:
        size = len(self._at_slot)
        self._at_slot += [None] * size
        self._free = list(range(2 * size - 1, size - 1, -1))
        self._row_report = np.concatenate((self._row_report, np.full((2, size), NO_ROW, dtype=np.int64)), axis=1)
        self._row_index = np.concatenate((self._row_index, np.zeros((2, size), dtype=np.int64)), axis=1)
        self._agreed = np.concatenate((self._agreed, np.zeros(size, dtype=np.int64)))
        self._checking = np.concatenate((self._checking, np.zeros(size, dtype=np.bool_)))
        self._server = np.concatenate((self._server, np.full((2, size), -1, dtype=np.int64)), axis=1)

    def _rebuild_index(self) -> None:
        """The active streams (not retired, of a placed sequence), sorted by id."""
        active = [s for s in self.streams.values() if not s.retired and s.live.slot >= 0 and not s.live.done]
        ids = np.fromiter((s.id for s in active), np.int64, len(active))
        order = np.argsort(ids, kind="stable")
        self._ids = ids[order]
        self._id_slot = np.fromiter((s.live.slot for s in active), np.int64, len(active))[order]
        self._id_role = np.fromiter((s.role for s in active), np.int64, len(active))[order]
        self._index_stale = False


@numba.njit(cache=True, nogil=True)
def _take_regular(
    ids,
    positions,
    index_ids,
    index_slot,
    index_role,
    agreed,
    row_report,
    row_index,
    checking,
    server,
    number,
    slots,
    ready,
    waiting,
):  # pragma: no cover - compiled; tested through LockstepTable.report
    """LockstepTable._report_regular's pass over the rows, compiled (a numpy call per rule cost as
    much as the row-by-row rules at batch 256): each row's stream found in the sorted index
    (binary search), checked regular, then recorded as waiting in `row_report`/`row_index` ->
    the report's role, or -1 with nothing changed when any row is not regular. Fills `slots`
    (each row's slot), `ready` (its pair complete and no check held) and `waiting` (by server
    code: the servers a row not ready waits on)."""
    n, m = ids.shape[0], index_ids.shape[0]
    if n == 0 or m == 0:
        return -1
    role = -1
    for i in range(n):
        lo, hi = 0, m
        while lo < hi:
            mid = (lo + hi) >> 1
            if index_ids[mid] < ids[i]:
                lo = mid + 1
            else:
                hi = mid
        if lo == m or index_ids[lo] != ids[i]:
            return -1
        if role < 0:
            role = index_role[lo]
        elif index_role[lo] != role:
            return -1
        slot = index_slot[lo]
        if positions[i] != agreed[slot] or row_report[role, slot] != NO_ROW:
            return -1
        slots[i] = slot
    for i in range(n):
        if row_report[role, slots[i]] == number:  # a stream twice in one report: undo, row by row
            for j in range(i):
                row_report[role, slots[j]] = NO_ROW
            return -1
        row_report[role, slots[i]] = number
    for i in range(n):
        slot = slots[i]
        row_index[role, slot] = i
        ready[i] = row_report[1 - role, slot] != NO_ROW and not checking[slot]
        if not ready[i]:
            waiting[server[1 - role, slot]] = True
    return role


def gather(ready: list[Live], role: int) -> TopKBatch:
    """The waiting rows of `role` of the ready sequences (see LockstepTable.gather)."""
    table = ready[0].table
    assert table is not None, "a ready sequence is placed in a table"
    return table.gather(ready, role)
