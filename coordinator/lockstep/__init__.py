"""Lockstep mode: both servers decode natively, the coordinator picks every token.

- table.py: the state machine, without I/O (pairing rows, replies, deadlocks, parks);
- scheduler.py: its asyncio shell (streams, the channel, admission, recovery);
- probe.py: whether a server can run lockstep sequences (start-up and rejoin).
"""

from coordinator.lockstep.scheduler import LockstepScheduler

__all__ = ["LockstepScheduler"]
