"""The coordinator's end of lockstep decoding: a zmq ROUTER socket the servers' plugins dial.

Every lockstep request carries this socket's address; the plugin in that server connects
to it on first use and sends one report per decode step (engines.vllm_plugin.wire). The
socket binds to a random port on `host` (loopback by default; the plugin refuses other
hosts unless the server lists them in DUALVLLM_LOCKSTEP_ALLOWED_HOSTS).
"""

from __future__ import annotations

import numpy as np
import zmq
import zmq.asyncio

from engines.vllm_plugin import wire


class LockstepChannel:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"

    async def receive(self) -> tuple[bytes, wire.Report]:
        """(the sending plugin's identity, its report); raises wire.WireError on a malformed one."""
        identity, *frames = await self._socket.recv_multipart()
        return identity, wire.decode_report(frames)

    async def reply(self, identity: bytes, step: int, tokens: np.ndarray) -> None:
        await self._socket.send_multipart([identity, *wire.encode_reply(step, tokens)], copy=False)

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()
