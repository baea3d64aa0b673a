"""Who waits on whom: the lockstep table's deadlocks and stalls, without I/O (as table.py).

Every server with a report in the table waits here for its reply. A deadlock is a set of
such servers each of which waits on a row that must come from a server in the set: none of
them can report that row before it is answered, so nothing will arrive (exact). Breaking it
parks the report with the fewest undecidable rows (`LockstepTable.park`: answered END, its
sequences resent from their agreed tokens). A report left waiting past the stall limit on a
server that is not waiting here (its batch busy with other work) is parked the same way.

Servers shared with other coordinators (`serve --workers`, data-parallel ranks: reports flagged
wire.FLAG_SHARED) can deadlock across coordinators, which none of them sees whole: coordinator
A holds the base server on a row that needs the teacher's next step, while the teacher waits on
coordinator B for a row that needs the base server's next step. Every such cycle runs through
a base server and a teacher in turn (a row waits on the other role's server), so it is broken
by the coordinators that hold a shared base server, after a few typical steps
(`shared_stall_limit`), while those that hold a teacher wait the full limit. Both sides parking
at once swaps the two halves of the same deadlock: in the two-rank TRL example that repeated
every 6.2 s for minutes, each report parked after waiting the 5 s limit.
"""

from __future__ import annotations

import itertools

import numpy as np

from dualvllm.coordinator.lockstep.table import THETA, UNSET, Blocked, LockstepTable
from dualvllm.engines.vllm_plugin import wire

# A shared base server's report waits this many typical steps (the median of the most recent
# SHARED_STALL_WINDOW) before it is parked, and never less than SHARED_STALL_MIN_S: a partner
# still computing its step must not be taken for one blocked on another coordinator.
SHARED_STALL_STEPS = 4.0
SHARED_STALL_WINDOW = 32
SHARED_STALL_MIN_S = 0.02


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


def park_stalled(table: LockstepTable, now: float, limit_s: float, shared_limit_s: float | None = None) -> list[float]:
    """Park every report waiting longer than `limit_s` on undecided rows, and every shared base
    server's report waiting longer than `shared_limit_s` on servers none of which waits here
    (None: no such parks now) -> how long each waited."""
    blocked_here = blocked_servers(table)

    def limit(blocked: Blocked) -> float:
        if shared_limit_s is not None and _holds_shared_base(blocked) and not blocked.needs & blocked_here:
            return shared_limit_s
        return limit_s

    stalled = [b for b in table.blocked.values() if now - b.arrived > limit(b) and b.undecided().size]
    for blocked in stalled:
        table.park(blocked)
    return [now - blocked.arrived for blocked in stalled]


def shared_stall_limit(table: LockstepTable, limit_s: float) -> float:
    """How long a shared base server's report may wait on servers that wait elsewhere: a few of
    the servers' recent steps (from a reply to their next report), within the limits."""
    recent = list(itertools.islice(table.server_steps_s, SHARED_STALL_WINDOW))
    if not recent:
        return limit_s
    return min(limit_s, max(SHARED_STALL_MIN_S, SHARED_STALL_STEPS * float(np.median(recent))))


def held_too_long(table: LockstepTable, now: float, limit_s: float) -> list[bytes]:
    """Shared base servers' reports, all decided, that the admission gate has held longer than
    `limit_s` while the servers their rows pair with wait elsewhere: held on, they would hold
    another coordinator's gate, which holds the partner (a deadlock across gates)."""
    here = blocked_servers(table)
    return [
        identity
        for identity, blocked in table.blocked.items()
        if _holds_shared_base(blocked)
        and now - blocked.arrived > limit_s
        and not blocked.needs & here
        and not (blocked.answers == UNSET).any()
    ]


def any_shared(table: LockstepTable) -> bool:
    """A shared base server waits here: the watchdog must look at it often."""
    return any(map(_holds_shared_base, table.blocked.values()))


def _holds_shared_base(blocked: Blocked) -> bool:
    return blocked.role == THETA and bool(blocked.report.flags & wire.FLAG_SHARED)


def _stuck(waits_on: dict[str, set[str | None]]) -> set[str]:
    """The waiting servers left after freeing, again and again, every one all of whose rows
    need servers that are not (or no longer) stuck."""
    stuck = set(waits_on)
    while True:
        free = {server for server in stuck if not waits_on[server] & stuck}
        if not free:
            return stuck
        stuck -= free
