"""The coordinator's end of lockstep decoding: a zmq ROUTER socket the servers' plugins dial.

Every lockstep request carries this socket's address; the plugin in that server connects
to it on first use and sends one report per decode step (engines.vllm_plugin.wire). The
socket binds to a random port on `host` (loopback by default; the plugin refuses other
hosts unless the server lists them in DUALVLLM_LOCKSTEP_ALLOWED_HOSTS).

Only the wait for a first report goes through zmq.asyncio: the reports queued behind it are
read, and every reply sent, on a synchronous shadow of the same socket, without a future
and an event-loop callback per message (about 40-60 µs of coordinator CPU each, measured
in benchmarks/coordinator_capacity.py). A ROUTER's send never blocks: a reply to a plugin
that went away is dropped, as the asyncio send would drop it.
"""

from __future__ import annotations

import numpy as np
import zmq
import zmq.asyncio

from engines.vllm_plugin import wire

# Reports read per wake-up at most: two per server step is the usual (one per role); more
# pile up only behind a slow step, and the scheduler then settles once for all of them.
MAX_BATCH = 64


class LockstepChannel:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._now = zmq.Socket.shadow(self._socket.underlying)  # the same socket, without futures

    async def receive(self) -> tuple[bytes, wire.Report]:
        """(the sending plugin's identity, its report); raises wire.WireError on a malformed one."""
        identity, *frames = await self._socket.recv_multipart()
        return identity, wire.decode_report(frames)

    async def receive_many(self) -> list[tuple[bytes, wire.Report | wire.WireError]]:
        """The next report, waited for, and those already queued behind it (MAX_BATCH in all at
        most), in arrival order: (identity, report), or (identity, the WireError of a malformed one)."""
        received = [_decoded(await self._socket.recv_multipart())]
        # POLLIN means a whole message is queued (zmq delivers multipart messages atomically);
        # asking is cheaper than the zmq.Again a read of an empty queue raises.
        while len(received) < MAX_BATCH and self._now.get(zmq.EVENTS) & zmq.POLLIN:
            received.append(_decoded(self._now.recv_multipart(zmq.NOBLOCK)))
        return received

    def reply(self, identity: bytes, step: int, tokens: np.ndarray) -> None:
        self._now.send_multipart([identity, *wire.encode_reply(step, tokens)], zmq.NOBLOCK, copy=False)

    def close(self) -> None:
        self._socket.close(linger=0)  # the shadow's too: closing a shadow closes the socket itself
        self._context.term()


def _decoded(frames: list[bytes]) -> tuple[bytes, wire.Report | wire.WireError]:
    identity, *rest = frames
    try:
        return identity, wire.decode_report(rest)
    except (wire.WireError, ValueError) as err:
        return identity, wire.WireError(str(err))
