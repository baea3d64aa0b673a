"""The coordinator's end of lockstep decoding: a zmq ROUTER socket the servers' plugins dial.

Every lockstep request carries this socket's address; the plugin in that server connects
to it on first use and sends one report per decode step (engines.vllm_plugin.wire). The
socket binds to a random port on `host` (loopback by default; the plugin refuses other
hosts unless the server lists them in DUALVLLM_LOCKSTEP_ALLOWED_HOSTS).

The socket is a plain (synchronous) one: the event loop only tells when its file descriptor
becomes readable, and every queued report is then read, and every reply sent, without a
future and a callback per message as zmq.asyncio makes (about 40-60 µs of coordinator CPU
each, measured in benchmarks/coordinator_capacity.py). zmq's descriptor signals a change of
the socket's state, not a message: after every wake-up the socket's EVENTS say whether a
message is queued, and reading them re-arms the signal. A ROUTER's send never blocks: a
reply to a plugin that went away is dropped.
"""

from __future__ import annotations

import asyncio

import numpy as np
import zmq

from engines.vllm_plugin import wire

# Reports read per wake-up at most: two per server step is the usual (one per role); more
# pile up only behind a slow step, and the scheduler then settles once for all of them.
MAX_BATCH = 64
# ints: zmq's enums cost a microsecond per test, and send_multipart combines them per frame
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
_NOBLOCK, _SNDMORE = int(zmq.NOBLOCK), int(zmq.SNDMORE)


class LockstepChannel:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._fd = self._socket.getsockopt(zmq.FD)
        self._woken: asyncio.Future[None] | None = None  # the reader's wait, while it waits
        self._watcher: asyncio.AbstractEventLoop | None = None  # the loop watching the descriptor

    async def receive(self) -> tuple[bytes, wire.Report]:
        """(the sending plugin's identity, its report); raises wire.WireError on a malformed one."""
        await self._readable()
        identity, *frames = self._socket.recv_multipart(zmq.NOBLOCK)
        return identity, wire.decode_report(frames)

    async def receive_many(self) -> list[tuple[bytes, wire.Report | wire.WireError]]:
        """The next report, waited for, and those already queued behind it (MAX_BATCH in all at
        most), in arrival order: (identity, report), or (identity, the WireError of a malformed one)."""
        await self._readable()
        received = [_decoded(self._socket.recv_multipart(zmq.NOBLOCK))]
        while len(received) < MAX_BATCH and self._socket.getsockopt(_EVENTS) & _POLLIN:
            received.append(_decoded(self._socket.recv_multipart(zmq.NOBLOCK)))
        return received

    def reply(self, identity: bytes, step: int, tokens: np.ndarray) -> None:
        # Frame by frame with int flags (send_multipart combines zmq's flag enums per frame),
        # copied (a reply is 8 bytes a row: zero-copy frames cost more to set up than to copy).
        (message,) = wire.encode_reply(step, tokens)
        self._socket.send(identity, _NOBLOCK | _SNDMORE)
        self._socket.send(message, _NOBLOCK)

    def close(self) -> None:
        if self._watcher is not None and not self._watcher.is_closed():
            self._watcher.remove_reader(self._fd)
        self._watcher = None
        self._socket.close(linger=0)
        self._context.term()

    async def _readable(self) -> None:
        """Until a whole message is queued.

        The descriptor stays watched between waits (registering it costs a few system calls
        and asyncio bookkeeping per wake-up); `_wake` stops watching it when it signals while
        nobody waits, since a signal nobody reads would wake the loop at every turn."""
        if self._socket.getsockopt(_EVENTS) & _POLLIN:  # also re-arms the descriptor's signal
            return
        if self._woken is not None:
            raise RuntimeError("two tasks wait on one lockstep channel: it has one reader (the scheduler, or a probe)")
        loop = asyncio.get_running_loop()
        try:
            while True:
                if self._watcher is not loop:
                    if self._watcher is not None and not self._watcher.is_closed():
                        self._watcher.remove_reader(self._fd)
                    loop.add_reader(self._fd, self._wake)
                    self._watcher = loop
                self._woken = loop.create_future()
                await self._woken
                if self._socket.getsockopt(_EVENTS) & _POLLIN:
                    return
        finally:
            self._woken = None

    def _wake(self) -> None:
        if self._woken is not None:  # (woken already, the waiter has not run yet: it reads the signal next)
            if not self._woken.done():
                self._woken.set_result(None)
        elif self._watcher is not None:  # nobody waits: watch again at the next wait
            self._watcher.remove_reader(self._fd)
            self._watcher = None


def _decoded(frames: list[bytes]) -> tuple[bytes, wire.Report | wire.WireError]:
    identity, *rest = frames
    try:
        return identity, wire.decode_report(rest)
    except (wire.WireError, ValueError) as err:
        return identity, wire.WireError(str(err))
