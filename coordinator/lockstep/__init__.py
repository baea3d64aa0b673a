"""Lockstep mode: both servers decode natively, the coordinator picks every token.

- table.py: the state machine, without I/O (pairing rows, replies, parks);
- waits.py: who waits on whom, without I/O (deadlocks, stalls);
- scheduler.py: its asyncio shell (the channel, decisions, stop strings, pauses, close);
- admission.py, recovery.py: when sequences start, and what follows a stream that ended early;
- requests.py, placement.py: the servers' streams, and which replica runs a sequence;
- probe.py: whether a server can run lockstep sequences (start-up and rejoin).
"""

from dualvllm.coordinator.lockstep.scheduler import LockstepScheduler

__all__ = ["LockstepScheduler"]
