"""Where the lockstep table keeps its rows: arrays indexed by a slot per placed sequence.

Per slot: the report and row each role's waiting row is in (NO_ROW when none), the agreed
length (len(seq.tokens)), whether a stop-string check holds the sequence, and each role's
server (as a code). Beside them, the reports waiting for a reply by number, and a sorted index
of the active streams' ids. A report whose rows are all regular (known active streams of one
role, each at its sequence's next position, its role's slot free: every row of a steady batch)
is taken in by one compiled pass (`take_regular`, numba); the table's rules row by row
(LockstepTable._report_rows) read and write the same arrays through `row`/`set_row`. At batch
256 the compiled pass took 0.8 µs of coordinator CPU per token where the rules row by row took
2.9 (`python benchmarks/lockstep_step.py --paths`, 2-core AMD EPYC under load).
"""

from __future__ import annotations

import itertools
import operator
from typing import TYPE_CHECKING, cast

import numba
import numpy as np

from dualvllm.engines.protocol import PAD_TOKEN_ID, TopKBatch
from dualvllm.engines.vllm_plugin import wire

if TYPE_CHECKING:
    from dualvllm.coordinator.lockstep.table import Blocked, Live, Stream

THETA, T = 0, 1
ROLES = (THETA, T)
NO_ROW = -1  # a slot's role has no waiting row
FIRST_SLOTS = 64  # the arrays start this long and double when full

_SLOT = operator.attrgetter("slot")
_CANCELLED = operator.attrgetter("seq.cancelled")
_TOKENS = operator.attrgetter("seq.tokens")


class Rows:
    """The table's per-slot arrays, its waiting reports by number and its stream index."""

    def __init__(self, streams: dict[int, Stream]) -> None:
        self._streams = streams  # the table's: read when the index is rebuilt
        self._at_slot: list[Live | None] = [None] * FIRST_SLOTS
        self._free = list(range(FIRST_SLOTS - 1, -1, -1))  # popped from the end: lowest first
        self._row_report = np.full((2, FIRST_SLOTS), NO_ROW, dtype=np.int64)  # Blocked.number
        self._row_index = np.zeros((2, FIRST_SLOTS), dtype=np.int64)
        self._agreed = np.zeros(FIRST_SLOTS, dtype=np.int64)
        self._checking = np.zeros(FIRST_SLOTS, dtype=np.bool_)
        self._server = np.full((2, FIRST_SLOTS), -1, dtype=np.int64)
        self._codes: dict[str, int] = {}
        self._urls: list[str] = []
        self._reports: dict[int, Blocked] = {}
        self._numbers = itertools.count()
        self.index_stale = True  # set by the table whenever a stream starts, ends or retires
        self._ids = np.empty(0, dtype=np.int64)
        self._id_slot = np.empty(0, dtype=np.int64)
        self._id_role = np.empty(0, dtype=np.int64)

    # -- slots ---------------------------------------------------------------------------

    def place(self, live: Live) -> None:
        """Give `live` a slot (it starts on its servers)."""
        if not self._free:
            self._grow()
        slot = live.slot = self._free.pop()
        self._at_slot[slot] = live
        self._row_report[:, slot] = NO_ROW
        self._agreed[slot] = len(live.seq.tokens)
        self._checking[slot] = live.checking
        for role in ROLES:
            self._server[role, slot] = self._code(live.engines[role].url)
        self.index_stale = True

    def free(self, live: Live) -> None:
        """Take `live`'s slot back (its rows were ended)."""
        self._at_slot[live.slot] = None
        self._free.append(live.slot)
        live.slot = -1
        self.index_stale = True

    def hold(self, live: Live, checking: bool) -> None:
        if live.slot >= 0:
            self._checking[live.slot] = checking

    # -- reports and rows ------------------------------------------------------------------

    def add_report(self, blocked: Blocked) -> None:
        blocked.number = next(self._numbers)
        self._reports[blocked.number] = blocked

    def drop_report(self, blocked: Blocked, *, forget_rows: bool = False) -> None:
        """`blocked` leaves (replied, or replaced by its server's next report: `forget_rows`, as
        the plugin ended its rows itself)."""
        del self._reports[blocked.number]
        if forget_rows:
            self._row_report[self._row_report == blocked.number] = NO_ROW

    def row(self, live: Live, role: int) -> tuple[Blocked, int] | None:
        """`live`'s waiting row of `role`: (its report, its index there), or None."""
        if live.slot < 0 or self._row_report[role, live.slot] == NO_ROW:
            return None
        return self._reports[int(self._row_report[role, live.slot])], int(self._row_index[role, live.slot])

    def set_row(self, live: Live, role: int, blocked: Blocked | None, index: int = 0) -> None:
        """Record row `index` of `blocked` as `live`'s waiting row of `role` (None: it has none)."""
        if live.slot >= 0:
            self._row_report[role, live.slot] = NO_ROW if blocked is None else blocked.number
            self._row_index[role, live.slot] = index

    def end_row(self, live: Live, role: int) -> None:
        """Answer `live`'s waiting row of `role` END and forget it."""
        row = self.row(live, role)
        if row is not None:
            row[0].answers[row[1]] = wire.END
            self._row_report[role, live.slot] = NO_ROW

    def end_all(self) -> None:
        self._row_report[:] = NO_ROW

    def paired(self, live: Live) -> bool:
        """Both of `live`'s rows wait here."""
        return live.slot >= 0 and bool((self._row_report[:, live.slot] != NO_ROW).all())

    def still_ready(self, ready: list[Live]) -> list[Live]:
        """Those of `ready` that are placed with both rows waiting still."""
        slots = np.fromiter(map(_SLOT, ready), np.int64, len(ready))
        placed = slots >= 0  # a finished or failed sequence left its slot
        keep = placed.copy()
        keep[placed] = (self._row_report[:, slots[placed]] != NO_ROW).all(axis=0)
        return list(itertools.compress(ready, keep.tolist()))

    def take_regular(self, blocked: Blocked) -> list[Live] | None:
        """Take every row of `blocked` in at once if each is a known active stream's row at its
        sequence's next position, its role's slot free, all of one role and none cancelled ->
        the sequences now ready; None (nothing changed) if any row is not."""
        ids, positions = blocked.report.ids, blocked.report.positions
        n = len(ids)
        if self.index_stale:
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
        lives = cast("list[Live]", list(map(self._at_slot.__getitem__, slots.tolist())))
        if any(map(_CANCELLED, lives)):  # the rules fail it: undo, and go row by row
            self._row_report[role, slots] = NO_ROW
            return None
        blocked.server, blocked.role = self._urls[self._server[role, slots[0]]], role
        blocked.needs.update(map(self._urls.__getitem__, np.flatnonzero(waiting).tolist()))
        return list(itertools.compress(lives, ready.tolist()))

    def answer(self, ready: list[Live], answers: np.ndarray) -> None:
        """Write each ready sequence's answer into both rows' reports (one vectorized write per
        pair of reports, usually one), link each pair, and clear the rows; the sequences'
        tokens are recorded already, which sets their agreed lengths."""
        slots = np.fromiter(map(_SLOT, ready), np.int64, len(ready))
        theta_numbers, t_numbers = self._row_report[THETA, slots], self._row_report[T, slots]
        groups: list[tuple[tuple[int, int], slice | np.ndarray]]
        if (theta_numbers == theta_numbers[0]).all() and (t_numbers == t_numbers[0]).all():
            groups = [((int(theta_numbers[0]), int(t_numbers[0])), slice(None))]
        else:  # rows of several pairs of reports (replicas, or one server ran ahead)
            unique, codes = np.unique(np.stack((theta_numbers, t_numbers), axis=1), axis=0, return_inverse=True)
            groups = [((a, b), np.flatnonzero(codes.reshape(-1) == k)) for k, (a, b) in enumerate(unique.tolist())]
        for (theta_number, t_number), group in groups:
            theta_blocked, t_blocked = self._reports[theta_number], self._reports[t_number]
            theta_blocked.answers[self._row_index[THETA, slots[group]]] = answers[group]
            t_blocked.answers[self._row_index[T, slots[group]]] = answers[group]
            theta_blocked.partners.add(t_blocked)
            t_blocked.partners.add(theta_blocked)
        self._row_report[:, slots] = NO_ROW
        self._agreed[slots] = np.fromiter(map(len, map(_TOKENS, ready)), np.int64, len(ready))

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

    # -- the arrays themselves ---------------------------------------------------------------

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
        active = [s for s in self._streams.values() if not s.retired and s.live.slot >= 0 and not s.live.done]
        ids = np.fromiter((s.id for s in active), np.int64, len(active))
        order = np.argsort(ids, kind="stable")
        self._ids = ids[order]
        self._id_slot = np.fromiter((s.live.slot for s in active), np.int64, len(active))[order]
        self._id_role = np.fromiter((s.role for s in active), np.int64, len(active))[order]
        self.index_stale = False


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
    """Rows.take_regular's pass over the rows, compiled (a numpy call per rule cost as
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
