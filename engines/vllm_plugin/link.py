"""The plugin's connection to one coordinator: blocking TCP, every wait bounded by a deadline.

Used inside vLLM's engine loop (processor.py), so nothing here may raise on a coordinator
that is gone or slow: `send` and `receive` report failure as a value and keep the reason in
`problem`, and the caller ends that coordinator's rows. After any failure the connection is
dropped, so that a late reply or a half-read message cannot reach the next step; the next
`send` connects again (the coordinator sees a new peer). Imports only numpy and wire, so
benchmark clients can speak to a coordinator exactly as the plugin does.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Collection, Mapping
from typing import Protocol
from urllib.parse import urlsplit

import numpy as np

from dualvllm.engines.vllm_plugin import wire

_READ_SIZE = 1 << 16


class CoordinatorLink:
    """One connection to the coordinator at `address` (tcp://host:port), with the step counter
    of the reports sent over it."""

    def __init__(self, address: str) -> None:
        parts = urlsplit(address)
        self.address = address
        self._host, self._port = parts.hostname, parts.port
        self.step = 0
        self.last_report = float("-inf")  # time.monotonic() of the last report sent over it
        self.problem = ""  # why the last send or receive failed
        self._socket: socket.socket | None = None
        self._splitter = wire.Splitter()
        self._pending: list[bytes] = []  # whole messages read past the one wanted

    def send(self, message: bytes, deadline: float) -> bool:
        """Send one message (wire.encode_report); False, with `problem` set, if it could not be."""
        try:
            if self._socket is None:
                self._socket = socket.create_connection((self._host, self._port), timeout=_left(deadline))
                self._socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._socket.settimeout(_left(deadline))
            self._socket.sendall(message)
            return True
        except OSError as err:
            self._fail(f"could not be reached ({err!r})")
            return False

    def receive(self, deadline: float) -> np.ndarray | None:
        """The reply to the last report (its tokens), or None, with `problem` set, if none came
        by `deadline` (time.monotonic) or the connection broke."""
        if self._socket is None:
            return None  # the send failed: `problem` says why
        try:
            while True:
                while not self._pending:
                    self._socket.settimeout(_left(deadline))
                    data = self._socket.recv(_READ_SIZE)
                    if not data:
                        self._fail("closed the connection")
                        return None
                    self._pending = self._splitter.feed(data)
                step, tokens = wire.decode_reply(self._pending.pop(0))
                if step == self.step:
                    return tokens
                # A late reply to a report this side gave up on: not for this step.
        except TimeoutError:
            self._fail("did not answer in time")
            return None
        except (OSError, wire.WireError) as err:
            self._fail(f"broke the connection ({err})")
            return None

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
        self._socket = None
        self._splitter = wire.Splitter()
        self._pending = []

    def _fail(self, problem: str) -> None:
        self.problem = problem
        self.close()


def _left(deadline: float) -> float:
    """Seconds until `deadline`; a past deadline still gives a blocking call a moment (0 would
    make it non-blocking, None would make it wait forever)."""
    return max(deadline - time.monotonic(), 1e-3)


class _Reported(Protocol):
    last_report: float


def shared(links: Mapping[str, _Reported], asking: Collection[str], now: float) -> bool:
    """Whether a step that asks the coordinators at `asking` is shared: it asks more than one,
    or another of `links` was sent a report within wire.SHARED_WINDOW_S (time.monotonic). A
    coordinator's rows may then wait on a step that waits on another coordinator's: a
    deadlock none of them sees whole (coordinator/lockstep/waits.py breaks it)."""
    if len(asking) > 1:
        return True
    recent = now - wire.SHARED_WINDOW_S
    return any(link.last_report > recent for address, link in links.items() if address not in asking)
