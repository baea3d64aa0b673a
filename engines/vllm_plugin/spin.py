"""A vLLM general plugin: a lockstep server's engine core stops spinning while its worker waits.

vLLM's engine core reads its worker's output through a shared-memory queue whose reader
busy-waits (`sched_yield` in a loop) for `busy_loop_s` = 1 s after every read before it
parks in a zmq poll (`SpinCondition` in vllm/distributed/device_communicators/
shm_broadcast.py; hard-coded, no setting). In lockstep the worker waits for the
coordinator at every step, so the engine core spins through every wait and takes a core
from the other server and the coordinator. Lowering only the spin is not enough: the
writer's wake-up ping can be dropped (PUB, SNDHWM=1), and a parked reader then rechecks
only every SHM_READER_RECHECK_INTERVAL_MS = 5,000 ms, which stalled plain requests ~5 s
(measured in issue 25). So both are lowered together.

Active only where the launcher asks for it: it sets DUALVLLM_ENGINE_SPIN_S (and
DUALVLLM_ENGINE_RECHECK_MS) in the environment of the lockstep servers it starts. vLLM
loads every installed `vllm.general_plugins` entry point into every server, so without
the variable this does nothing; with a vLLM version it was not written against, it logs
a warning and does nothing.
"""

from __future__ import annotations

import logging
import os

SPIN_ENV = "DUALVLLM_ENGINE_SPIN_S"
RECHECK_ENV = "DUALVLLM_ENGINE_RECHECK_MS"
DEFAULT_RECHECK_MS = 20
PATCHED_VERSIONS = ("0.32.0",)  # read shm_broadcast.py of these before adding one

log = logging.getLogger("vllm.dualvllm_spin")

# Set on vLLM's SpinCondition class: the spin its patched __init__ passes, and the mark that it is patched.
# Through getattr/setattr: an attribute of our own on a class vLLM's types do not declare.
_SPIN_ATTR = "_dualvllm_spin_s"


def register() -> None:
    """The entry point (pyproject.toml: vllm.general_plugins); vLLM calls it once per process."""
    spin = os.environ.get(SPIN_ENV)
    if spin is None:
        return
    import vllm
    from vllm.distributed.device_communicators import shm_broadcast

    if vllm.__version__ not in PATCHED_VERSIONS or not hasattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS"):
        log.warning(
            "dualvllm: %s is set, but vLLM %s is not one this plugin was written for (%s); the engine "
            "keeps its own spin",
            SPIN_ENV,
            vllm.__version__,
            ", ".join(PATCHED_VERSIONS),
        )
        return
    spin_s = float(spin)
    recheck_ms = int(os.environ.get(RECHECK_ENV, DEFAULT_RECHECK_MS))
    shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = recheck_ms  # read at call time
    condition = shm_broadcast.SpinCondition
    if getattr(condition, _SPIN_ATTR, None) is None:
        original = condition.__init__

        def __init__(self, is_reader, context, notify_address, busy_loop_s: float = 1) -> None:
            original(self, is_reader, context, notify_address, busy_loop_s=getattr(condition, _SPIN_ATTR))

        condition.__init__ = __init__  # type: ignore[method-assign]
    setattr(condition, _SPIN_ATTR, spin_s)
    log.info(
        "dualvllm: the engine busy-waits %g s after a read (vLLM: 1 s), rechecks every %d ms (vLLM: 5000)",
        spin_s,
        recheck_ms,
    )
