"""Child processes that never outlive the process that started them."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
from pathlib import Path

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> None:
    """In a child process: receive `sig` when the parent dies, even by SIGKILL. Linux only.

    Call it first thing in the child (a `preexec_fn`, or a process pool's `initializer`),
    with the parent's pid read in the parent (`os.getpid()` before starting the child). A
    parent that died before the call has already left the child to init: comparing
    getppid() with that pid after the call closes the window.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)


def log_tail(path: Path | None, lines: int) -> str:
    """The last `lines` lines of a child's log, for an error that says why it died."""
    try:
        text = path.read_text(errors="replace") if path is not None else ""
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])
