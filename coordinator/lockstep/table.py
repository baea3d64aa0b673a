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
"""

from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dualvllm.coordinator.sequence import SequenceState
from dualvllm.engines.protocol import PAD_TOKEN_ID, TopKBatch
from dualvllm.engines.vllm_plugin import wire

UNSET = -2  # a report row not decided yet
THETA, T = 0, 1
ROLES = (THETA, T)


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

    def undecided(self) -> np.ndarray:
        return np.flatnonzero(self.answers == UNSET)


@dataclass(eq=False)
class Live:
    """A sequence placed on one server per role: its two streams and their waiting rows."""

    seq: SequenceState
    # The server of each role it runs on (the shell's client: anything with a `.url`).
    engines: list[Any] = field(default_factory=lambda: [None, None])
    streams: list[Stream | None] = field(default_factory=lambda: [None, None])
    rows: list[tuple[Blocked, int] | None] = field(default_factory=lambda: [None, None])
    resubmissions: int = 0  # requests the servers ended on their own (parks are not counted)
    request_failures: int = 0  # requests that broke and were resent
    done: bool = False  # finished, failed or cancelled, and handed to the caller
    # Its last token's stop strings are being checked (a detokenization): its next pair waits.
    checking: bool = False
    placed: bool = False  # counted in the table's loads (on its servers, not suspended)


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


@dataclass
class Outbox:
    """What the table decided that the shell must carry out; the shell empties it after each call."""

    finished: list[SequenceState] = field(default_factory=list)  # over (a finish reason set): to the caller
    resubmit: list[tuple[Live, int]] = field(default_factory=list)  # (sequence, role) to resend from its agreed tokens
    unknown: list[tuple[int, wire.Report]] = field(default_factory=list)  # rows of ids not in the table (probes)


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

    def open_stream(self, live: Live, role: int, stream_id: int, offset: int) -> Stream:
        stream = Stream(id=stream_id, live=live, role=role, engine=live.engines[role], offset=offset)
        live.streams[role] = stream
        self.streams[stream_id] = stream
        return stream

    def stream_ended(self, stream: Stream) -> bool:
        """The server request of `stream` ended. True when that was unexpected and its sequence
        must go on (the shell resends, suspends or fails it); False when it was retired."""
        self.streams.pop(stream.id, None)
        if stream.retired or self.closing:
            return False
        stream.retired = True
        live = stream.live
        live.streams[stream.role] = None
        if live.done:
            return False
        row = live.rows[stream.role]
        if row is not None:
            # A row of this stream still waits here although its request ended: the plugin
            # gave up waiting (its timeout ended the row there, and its next report comes
            # from a new socket, so `_forget` never sees it). Drop the row, or the resent
            # stream's first report would be taken for a divergence.
            row[0].answers[row[1]] = wire.END
            live.rows[stream.role] = None
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
        for row in live.rows:
            if row is not None:
                row[0].answers[row[1]] = wire.END
        for stream in live.streams:
            if stream is not None:
                stream.retired = True
        live.rows, live.streams = [None, None], [None, None]
        if live.placed:
            live.placed = False
            self.loads.subtract(engine.url for engine in live.engines)
            self._live.pop(live, None)

    # -- reports -------------------------------------------------------------------------

    def report(self, identity: bytes, report: wire.Report, now: float) -> tuple[Blocked, list[Live]]:
        """Take in one server's step -> (its waiting report, the sequences now ready to decide)."""
        self.counters.reports += 1
        n = len(report.ids)
        blocked = Blocked(identity, report, np.full(n, UNSET, dtype=np.int64), now, server=None)
        stale = self.blocked.pop(identity, None)
        if stale is not None:  # the plugin gave up on it (timeout): its rows were ended there
            self._forget(stale)
        self.blocked[identity] = blocked
        if self.closing:
            blocked.answers[:] = wire.END
            return blocked, []
        # Once per row of every step: plain locals, the streams looked up in one C loop (map),
        # and the usual case first (a row at its sequence's next position, its role's slot
        # free), the rules' order kept for the rest.
        ready: list[Live] = []
        ended: list[int] = []  # rows answered END
        failed = False  # a sequence failed here, which may have been counted ready before
        needs = blocked.needs
        last = None
        for i, stream, position in zip(range(n), map(self.streams.get, report.ids.tolist()), report.positions.tolist()):
            if stream is None:
                self.out.unknown.append((int(report.ids[i]), report))
                ended.append(i)
                continue
            live = stream.live
            if stream.retired or live.done:
                ended.append(i)
                continue
            last, role, rows, seq = stream, stream.role, live.rows, live.seq
            agreed = len(seq.tokens)
            if position == agreed and rows[role] is None and not seq.cancelled:
                rows[role] = (blocked, i)
                if rows[1 - role] is not None and not live.checking:
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
        return blocked, [live for live in ready if not live.done] if failed else ready

    def decided(self, ready: list[Live], tokens: list[int]) -> None:
        """Answer both rows of each ready sequence with its token (END if the token finished it):
        one vectorized write per pair of reports the rows came in (usually one pair)."""
        finished: list[Live] = []
        group: tuple[Blocked, Blocked] | None = None  # the reports of the rows being gathered
        theta_rows: list[int] = []
        t_rows: list[int] = []
        answers: list[int] = []
        for live, token in zip(ready, tokens):
            rows = live.rows
            (theta_blocked, theta_row), (t_blocked, t_row) = rows  # type: ignore[misc]
            if group is None or group[0] is not theta_blocked or group[1] is not t_blocked:
                if group is not None:
                    _answer(group, theta_rows, t_rows, answers)
                    theta_rows, t_rows, answers = [], [], []
                group = theta_blocked, t_blocked
            if live.seq.finish_reason is not None:
                token = wire.END
                finished.append(live)
            theta_rows.append(theta_row)
            t_rows.append(t_row)
            answers.append(token)
            rows[THETA] = rows[T] = None
        if group is not None:
            _answer(group, theta_rows, t_rows, answers)
        for live in finished:
            self.finish(live)

    def hold(self, lives: list[Live]) -> None:
        """Their stop strings are being checked: their next pair is not ready until `release`."""
        for live in lives:
            live.checking = True

    def release(self, lives: list[Live]) -> list[Live]:
        """Their stop strings were checked: finish those that stopped -> those now ready."""
        ready = []
        for live in lives:
            live.checking = False
            if live.done:
                continue
            if live.seq.finish_reason is not None:
                self.finish(live)
            elif live.rows[THETA] is not None and live.rows[T] is not None:
                ready.append(live)
        return ready

    def end_undecided(self) -> None:
        """END every undecided row (after an internal error, so no server waits on it)."""
        for blocked in self.blocked.values():
            blocked.answers[blocked.answers == UNSET] = wire.END

    def replies(self, now: float) -> list[tuple[bytes, int, np.ndarray]]:
        """(identity, step, answers) of every report whose rows are all decided; they leave the table."""
        out = []
        for identity, blocked in list(self.blocked.items()):
            if (blocked.answers == UNSET).any():
                continue
            del self.blocked[identity]
            self.counters.replies += 1
            self.counters.split_reports += len(blocked.partners) > 1
            self.counters.wait_s += now - blocked.arrived
            out.append((identity, blocked.report.step, blocked.answers))
        return out

    def _forget(self, blocked: Blocked) -> None:
        for live in self._live:
            for role in ROLES:
                row = live.rows[role]
                if row is not None and row[0] is blocked:
                    live.rows[role] = None

    # -- parks (coordinator/lockstep/waits.py finds what to park) -------------------------

    def park(self, blocked: Blocked) -> None:
        """END the undecided rows of `blocked` and resend their sequences from the agreed tokens."""
        for i in blocked.undecided().tolist():
            blocked.answers[i] = wire.END
            stream = self.streams.get(int(blocked.report.ids[i]))
            if stream is None:
                continue
            stream.retired = True
            live = stream.live
            live.rows[stream.role] = None
            self.counters.parks += 1
            if not live.done:
                self.out.resubmit.append((live, stream.role))


def _answer(reports: tuple[Blocked, Blocked], theta_rows: list[int], t_rows: list[int], answers: list[int]) -> None:
    """Write a run of decided rows' answers into the pair of reports they came in, and link the two."""
    theta_blocked, t_blocked = reports
    theta_blocked.answers[theta_rows] = answers
    t_blocked.answers[t_rows] = answers
    theta_blocked.partners.add(t_blocked)
    t_blocked.partners.add(theta_blocked)


_first, _second = operator.itemgetter(0), operator.itemgetter(1)


def gather(ready: list[Live], role: int) -> TopKBatch:
    """The waiting rows of `role` of the ready sequences, in their order: one gather per report
    they came in (usually one, and often every row of it in order: no gather)."""
    # Two C loops over the rows' (report, index) pairs. Not zip(*pairs): that makes a tuple
    # iterator per row, each a tracked object, and at batch 1,024 those were a third of what
    # the young collections walked.
    pairs = [live.rows[role] for live in ready]
    # A ready sequence has both rows (LockstepTable.report): no None among them, and no check per row here.
    reports, rows = tuple(map(_first, pairs)), tuple(map(_second, pairs))  # type: ignore[arg-type]
    first = reports[0]
    # Blocked compares by identity: count() is one C loop, where all() over a generator is a
    # Python frame per row.
    if reports.count(first) == len(reports):
        report = first.report
        if len(rows) == len(report.ids) and rows == tuple(range(len(rows))):
            return TopKBatch(token_ids=report.token_ids.astype(np.int64), logprobs=report.logprobs.astype(np.float64))
        index = list(rows)
        return TopKBatch(
            token_ids=report.token_ids[index].astype(np.int64), logprobs=report.logprobs[index].astype(np.float64)
        )
    # Rows from several reports (one server ran ahead on some sequences): each report's rows
    # in one fancy index, the report of each row found in C loops (map over a dict).
    order = {blocked: k for k, blocked in enumerate(dict.fromkeys(reports))}
    codes = np.fromiter(map(order.__getitem__, reports), np.int64, len(reports))
    rows_of = np.array(rows, dtype=np.int64)
    width = max(blocked.report.token_ids.shape[1] for blocked in order)
    ids = np.full((len(ready), width), PAD_TOKEN_ID, dtype=np.int64)
    logprobs = np.full((len(ready), width), -np.inf)
    for blocked, k in order.items():
        places = np.flatnonzero(codes == k)
        picked = rows_of[places]
        width_k = blocked.report.token_ids.shape[1]
        ids[places, :width_k] = blocked.report.token_ids[picked]
        logprobs[places, :width_k] = blocked.report.logprobs[picked]
    return TopKBatch(token_ids=ids, logprobs=logprobs)
