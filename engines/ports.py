"""Free ports for the servers this machine starts, reserved across processes until they listen.

A free port is found by binding port 0 and closing the socket; vLLM binds it again only after
its imports, 15-25 s later on a small CPU. Within that window another launcher on the same
machine (a second `dualvllm serve`, one rank of several, a parallel test worker) can be handed
the same port by the kernel. One of the two servers then fails to bind, and worse, the other's
health check may be answered by the wrong server. So every port handed out here is also locked
(an exclusive `flock` on a file named after it, in a directory every user's launchers share);
the lock is released when the server answers, and by the kernel if the process dies first.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import tempfile
import threading
from pathlib import Path

# Shared by every launcher on the machine; world-writable with the sticky bit, as /tmp is.
LOCK_DIR = Path(tempfile.gettempdir()) / "dualvllm-ports"
# Ports the kernel offers that another launcher holds are skipped; this many in a row means the
# lock directory is unusable, not that the machine is out of ports.
MAX_TRIES = 64

_held: dict[int, int] = {}  # port -> the descriptor of its lock file, until release()
_guard = threading.Lock()


def reserve_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now and reserved for this process until `release(port)`."""
    for _ in range(MAX_TRIES):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        if _lock(port):
            return port
    raise OSError(f"no free port on {host} could be reserved in {MAX_TRIES} tries (locks in {LOCK_DIR})")


def release(port: int) -> None:
    """Let other launchers have `port` again (its server listens on it now, or never will)."""
    with _guard:
        descriptor = _held.pop(port, None)
    if descriptor is not None:
        os.close(descriptor)  # closing drops the flock


def _lock(port: int) -> bool:
    """Take `port`'s lock file without waiting -> whether this process holds it now."""
    with _guard:
        if port in _held:
            return False  # this process handed it out already
        _ensure_lock_dir()
        descriptor = os.open(LOCK_DIR / f"{port}.lock", os.O_RDONLY | os.O_CREAT, 0o666)  # read: any owner's file
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(descriptor)
            return False
        _held[port] = descriptor
        return True


def _ensure_lock_dir() -> None:
    if not LOCK_DIR.is_dir():
        LOCK_DIR.mkdir(exist_ok=True)
        with contextlib.suppress(PermissionError):  # made by another user meanwhile
            LOCK_DIR.chmod(0o1777)  # other users' launchers lock here too
