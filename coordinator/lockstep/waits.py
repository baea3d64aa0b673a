"""Who waits on whom: the lockstep table's deadlocks and stalls, without I/O (as table.py).

Every server with a report in the table waits here for its reply. A deadlock is a set of
such servers each of which waits on a row that must come from a server in the set: none of
them can report that row before it is answered, so nothing will arrive (exact). Breaking it
parks the report with the fewest undecidable rows (`LockstepTable.park`: answered END, its
sequences resent from their agreed tokens). A report left waiting past the stall limit on a
server that is not waiting here (its batch busy with other work) is parked the same way.
"""

from __future__ import annotations

from dualvllm.coordinator.lockstep.table import UNSET, LockstepTable


def blocked_servers(table: LockstepTable) -> set[str]:
    """Servers waiting here for a reply."""
    return {blocked.server for blocked in table.blocked.values() if blocked.server is not None}


def busy_servers(table: LockstepTable) -> set[str]:
    """Servers running a stream of this coordinator."""
    return {stream.engine.url for stream in table.streams.values() if not stream.retired}


def deadlocked(table: LockstepTable) -> set[str]:
    """Servers waiting here that nothing will free: each waits on a row that must come from a
    server that is itself waiting here, and so cannot report it before it is answered. Exact.
    With one server per role: both servers wait with undecided rows."""
    waiting = [
        blocked for blocked in table.blocked.values() if blocked.server is not None and (blocked.answers == UNSET).any()
    ]
    if not waiting:
        return set()
    needs: dict[str, set[str | None]] = {}
    for blocked in waiting:
        needs.setdefault(blocked.server, set()).update(blocked.needs)  # type: ignore[arg-type]
    if not _stuck(needs):  # the rows' servers as they arrived (a superset) free every server
        return set()
    waits_on: dict[str, set[str | None]] = {}  # waiting server -> servers its undecided rows need
    for blocked in waiting:
        needed = waits_on.setdefault(blocked.server, set())  # type: ignore[arg-type]
        for i in blocked.undecided().tolist():
            stream = table.streams.get(int(blocked.report.ids[i]))
            if stream is not None and stream.live.checking:  # decided once its check ends, by no server
                continue
            other = stream.live.streams[1 - stream.role] if stream is not None else None
            needed.add(other.engine.url if other is not None and not other.retired else None)
    return _stuck(waits_on)


def break_deadlock(table: LockstepTable) -> bool:
    """Park the report with the fewest undecidable rows among deadlocked servers -> whether
    there was a deadlock."""
    stuck = deadlocked(table)
    if not stuck:
        return False
    undecided = {identity: b.undecided().size for identity, b in table.blocked.items() if b.server in stuck}
    identity = min((i for i in undecided if undecided[i]), key=undecided.__getitem__)
    table.park(table.blocked[identity])
    return True


def park_stalled(table: LockstepTable, now: float, limit_s: float) -> list[float]:
    """Park every report waiting longer than `limit_s` on undecided rows -> how long each waited."""
    stalled = [b for b in table.blocked.values() if now - b.arrived > limit_s and b.undecided().size]
    for blocked in stalled:
        table.park(blocked)
    return [now - blocked.arrived for blocked in stalled]


def _stuck(waits_on: dict[str, set[str | None]]) -> set[str]:
    """The waiting servers left after freeing, again and again, every one all of whose rows
    need servers that are not (or no longer) stuck."""
    stuck = set(waits_on)
    while True:
        free = {server for server in stuck if not waits_on[server] & stuck}
        if not free:
            return stuck
        stuck -= free
