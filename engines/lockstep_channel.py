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
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # ints: zmq's enums cost a microsecond per test


class LockstepChannel:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._fd = self._socket.getsockopt(zmq.FD)
        self._waiting = False

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
        self._socket.send_multipart([identity, *wire.encode_reply(step, tokens)], zmq.NOBLOCK, copy=False)

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()

    async def _readable(self) -> None:
        """Until a whole message is queued. The descriptor is watched only while waiting: left
        registered, a signal nobody reads would wake the loop at every turn."""
        if self._socket.getsockopt(_EVENTS) & _POLLIN:  # also re-arms the descriptor's signal
            return
        if self._waiting:
            raise RuntimeError("two tasks wait on one lockstep channel: it has one reader (the scheduler, or a probe)")
        self._waiting = True
        try:
            await self._wait_readable()
        finally:
            self._waiting = False

    async def _wait_readable(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            woken = loop.create_future()
            loop.add_reader(self._fd, _wake, woken)
            try:
                await woken
            finally:
                loop.remove_reader(self._fd)
            if self._socket.getsockopt(_EVENTS) & _POLLIN:
                return


def _wake(woken: asyncio.Future[None]) -> None:
    if not woken.done():
        woken.set_result(None)


def _decoded(frames: list[bytes]) -> tuple[bytes, wire.Report | wire.WireError]:
    identity, *rest = frames
    try:
        return identity, wire.decode_report(rest)
    except (wire.WireError, ValueError) as err:
        return identity, wire.WireError(str(err))
