"""The coordinator's end of lockstep decoding: a TCP listener the servers' plugins dial.

Every lockstep request carries this listener's address; the plugin in that server connects
to it on first use (engines/vllm_plugin/link.py) and sends one report per decode step
(dualvllm.engines.vllm_plugin.wire). The listener binds to a random port on `host` (loopback by
default; the plugin refuses other hosts unless the server lists them in
DUALVLLM_LOCKSTEP_ALLOWED_HOSTS).

Each connection is one peer: its identity names it in replies, and a plugin that gave up on a
step reconnects, so its next report comes from a new identity. Reports are decoded as they
arrive, in the event loop's read callback, and queued for the one reader (the scheduler, or
a start-up probe), which takes every queued report at once. A reply to a peer that went away
is dropped. A stream that cannot be followed (another dualvllm version, another program) is
handed over as a WireError and the connection is closed.

Plain TCP through asyncio's transports, not zmq: zmq moved every message through its own I/O
thread, which cost as much coordinator CPU again as the rest of the messaging
(benchmarks/README.md, "the messaging floor").
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import socket

import numpy as np

from dualvllm.engines.vllm_plugin import wire

# Reports handed over per wake-up at most: two per server step is the usual (one per role);
# more pile up only behind a slow step, and the scheduler then settles once for all of them.
MAX_BATCH = 64

Received = tuple[bytes, "wire.Report | wire.WireError"]


class LockstepChannel:
    def __init__(self, host: str = "127.0.0.1") -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # Bound now, served from the first wait on: a plugin that dials in between waits in
        # the listen backlog.
        self._listener = socket.create_server((host, 0), family=family)
        self._listener.setblocking(False)
        port = self._listener.getsockname()[1]
        self.address = f"tcp://[{host}]:{port}" if family == socket.AF_INET6 else f"tcp://{host}:{port}"
        self._server: asyncio.Server | None = None
        self._peers: dict[bytes, _Peer] = {}
        self._names = itertools.count(1)
        self._received: collections.deque[Received] = collections.deque()
        self._woken: asyncio.Future[None] | None = None  # the reader's wait, while it waits
        self._closed = False

    async def receive(self) -> tuple[bytes, wire.Report]:
        """(the sending peer's identity, its report); raises wire.WireError on a malformed one."""
        await self._readable()
        identity, report = self._received.popleft()
        if isinstance(report, wire.WireError):
            raise report
        return identity, report

    async def receive_many(self) -> list[Received]:
        """The next report, waited for, and those already queued behind it (MAX_BATCH in all at
        most), in arrival order: (identity, report), or (identity, the WireError of a malformed one)."""
        await self._readable()
        queued = self._received
        if len(queued) <= MAX_BATCH:
            received = list(queued)
            queued.clear()
            return received
        return [queued.popleft() for _ in range(MAX_BATCH)]

    def reply(self, identity: bytes, step: int, tokens: np.ndarray) -> None:
        peer = self._peers.get(identity)
        if peer is not None:  # (a peer that went away gets nothing: it ended the rows itself)
            peer.transport.write(wire.encode_reply(step, tokens))

    def close(self) -> None:
        """Stop listening and drop every connection (their plugins end their rows)."""
        self._closed = True
        for peer in list(self._peers.values()):
            peer.transport.abort()
        self._peers.clear()
        if self._server is not None:
            self._server.close()
        self._listener.close()

    async def _readable(self) -> None:
        """Until a report (or a WireError) is queued."""
        if self._received:
            return
        if self._woken is not None:
            raise RuntimeError("two tasks wait on one lockstep channel: it has one reader (the scheduler, or a probe)")
        if self._closed:
            raise RuntimeError("the lockstep channel is closed")
        loop = asyncio.get_running_loop()
        if self._server is None:
            self._server = await loop.create_server(lambda: _Peer(self), sock=self._listener)
        self._woken = loop.create_future()
        try:
            await self._woken
        finally:
            self._woken = None

    def _queue(self, identity: bytes, item: wire.Report | wire.WireError) -> None:
        self._received.append((identity, item))
        if self._woken is not None and not self._woken.done():
            self._woken.set_result(None)


class _Peer(asyncio.Protocol):
    """One plugin's connection: splits its stream into reports and queues them on the channel."""

    def __init__(self, channel: LockstepChannel) -> None:
        self._channel = channel
        self._splitter = wire.Splitter()
        self.identity = b"%d" % next(channel._names)
        self.transport: asyncio.Transport

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._channel._peers[self.identity] = self

    def connection_lost(self, exc: Exception | None) -> None:
        self._channel._peers.pop(self.identity, None)

    def data_received(self, data: bytes) -> None:
        try:
            messages = self._splitter.feed(data)
        except wire.WireError as err:  # the stream cannot be followed: hand the reason over, hang up
            self._channel._queue(self.identity, err)
            self.transport.abort()
            return
        for message in messages:
            try:
                report: wire.Report | wire.WireError = wire.decode_report(message)
            except wire.WireError as err:
                report = err
            self._channel._queue(self.identity, report)
