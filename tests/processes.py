"""Processes that tests start: each one ends, with everything it started, on every path.

A test that fails or times out (pytest-timeout raises in the test, then fixtures tear
down) must not leave a `dualvllm train` behind holding two vLLM servers and a verifier
worker for an hour. `start(...)` records every process it starts; the autouse fixture
in tests/conftest.py ends each at the test's teardown: SIGTERM to the process (its own
clean shutdown stops its servers), then SIGKILL to it and to every descendant still
alive (servers run in their own process groups, so their groups are killed too).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil

# A dualvllm process stops its servers within STOP_GRACE_S (20 s) each on SIGTERM.
TERM_GRACE_S = 60.0
KILL_WAIT_S = 30.0

_started: list[subprocess.Popen] = []
REPO = Path(__file__).resolve().parents[1]


def start(command: list[str], **kw: Any) -> subprocess.Popen:
    """subprocess.Popen(command, **kw), ended at the current test's teardown if still running."""
    process = subprocess.Popen(command, **kw)
    _started.append(process)
    return process


def dualvllm(*args: str, **kw: Any) -> subprocess.Popen:
    """`dualvllm ARGS` in a subprocess (output piped unless `kw` says otherwise), started as above."""
    kw = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, **kw}
    return start([sys.executable, "-m", "dualvllm", *args], cwd=REPO,
                 env={**os.environ, "PYTHONUNBUFFERED": "1"}, **kw)


def end_started() -> list[str]:
    """End every process `start` started (and its descendants); return those that were
    still running, described, so that a caller can tell which test left them."""
    described = []
    while _started:
        process = _started.pop()
        if process.poll() is None:
            described.append(f"{process.pid} {' '.join(map(str, process.args))[:160]}")
        end_tree(process.pid)
        process.wait(timeout=KILL_WAIT_S)
    return described


def end_tree(pid: int) -> None:
    """SIGTERM `pid`, wait up to TERM_GRACE_S, then SIGKILL it and every descendant (and
    their process groups) that is still alive."""
    try:
        root = psutil.Process(pid)
        family = [root, *root.children(recursive=True)]  # before the root dies and they move to init
    except psutil.NoSuchProcess:
        return
    try:
        root.send_signal(signal.SIGTERM)
        root.wait(timeout=TERM_GRACE_S)
    except (psutil.NoSuchProcess, psutil.TimeoutExpired):
        pass
    for process in family:
        try:
            if process.is_running():
                group = os.getpgid(process.pid)
                if group != os.getpgrp():  # never our own group: that is pytest
                    os.killpg(group, signal.SIGKILL)
                process.kill()
        except (psutil.NoSuchProcess, ProcessLookupError):
            continue
    psutil.wait_procs(family, timeout=KILL_WAIT_S)
