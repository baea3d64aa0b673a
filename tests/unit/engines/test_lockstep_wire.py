"""The lockstep wire format (engines/vllm_plugin/wire.py) and its two ends: the coordinator's
channel (engines/lockstep_channel.py) and the plugin's link (engines/vllm_plugin/link.py),
over real loopback TCP."""

from __future__ import annotations

import asyncio
import socket
import struct
import time

import numpy as np
import pytest

from dualvllm.engines.lockstep_channel import LockstepChannel
from dualvllm.engines.vllm_plugin import wire
from dualvllm.engines.vllm_plugin.link import CoordinatorLink
from tests.fake_lockstep import read_message
from tests.waiting import eventually


def report(step: int, stream_id: int = 1, rows: int = 1, k: int = 2) -> bytes:
    return wire.encode_report(step, 0, 8, np.arange(stream_id, stream_id + rows), np.zeros(rows, np.int64),
                              np.zeros((rows, k), np.int32), np.zeros((rows, k), np.float32))


def test_report_and_reply_round_trip():
    ids = np.array([5, 2**50 + 3], dtype=np.int64)
    positions = np.array([0, 17], dtype=np.int64)
    token_ids = np.array([[3, 1, 4], [1, 5, 9]], dtype=np.int32)
    logprobs = np.array([[-0.1, -2.5, -3.0], [-0.5, -1.0, -7.25]], dtype=np.float32)
    decoded = wire.decode_report(wire.encode_report(9, wire.FLAG_CHUNKED_PREFILL, 512, ids, positions, token_ids,
                                                    logprobs))
    assert decoded.step == 9 and decoded.flags == wire.FLAG_CHUNKED_PREFILL and decoded.capacity == 512
    np.testing.assert_array_equal(decoded.ids, ids)
    np.testing.assert_array_equal(decoded.positions, positions)
    np.testing.assert_array_equal(decoded.token_ids, token_ids)
    np.testing.assert_array_equal(decoded.logprobs, logprobs)

    step, tokens = wire.decode_reply(wire.encode_reply(9, np.array([7, wire.END, 0])))
    assert step == 9 and tokens.tolist() == [7, wire.END, 0]
    step, tokens = wire.decode_reply(wire.encode_reply(1, np.array([], dtype=np.int64)))
    assert step == 1 and tokens.tolist() == []


def other_version(message: bytes) -> bytes:
    """The same message with the next version number (the first field after the frame header)."""
    return message[:wire.FRAME.size] + struct.pack("<I", wire.VERSION + 1) + message[wire.FRAME.size + 4:]


def reframed(message: bytes, body: bytes) -> bytes:
    """`body` behind a frame header that tells its true length: a well-framed malformed message."""
    return wire.FRAME.pack(wire.MAGIC, len(body)) + body


def test_malformed_messages_raise_wire_errors():
    good, reply = report(1, rows=2, k=3), wire.encode_reply(1, np.array([4, 5]))
    body = good[wire.FRAME.size:]
    with pytest.raises(wire.WireError, match="this side speaks"):
        wire.decode_report(other_version(good))
    with pytest.raises(wire.WireError, match="this side speaks"):
        wire.decode_reply(other_version(reply))
    with pytest.raises(wire.WireError, match="at least"):
        wire.decode_report(reframed(good, body[:23]))  # a short header
    with pytest.raises(wire.WireError, match="2 rows of top-3"):
        wire.decode_report(reframed(good, body[:-4]))  # truncated logprobs
    with pytest.raises(wire.WireError, match="2 rows of top-3"):
        wire.decode_report(reframed(good, body + b"\0" * 8))  # a row too many
    with pytest.raises(wire.WireError, match="frame header says"):
        wire.decode_reply(reply[:-8])  # the frame says more than there is
    with pytest.raises(wire.WireError, match="not a dualvllm lockstep stream"):
        wire.decode_report(b"\xff" + b"\0" * 8 + b"\x7f" + good[10:])  # a zmq greeting (wire version 2)
    with pytest.raises(wire.WireError, match="corrupt stream"):
        wire.message_length(wire.FRAME.pack(wire.MAGIC, wire.MAX_MESSAGE + 1))


def test_the_splitter_cuts_a_stream_into_its_messages_however_it_arrives():
    messages = [report(1, rows=3), wire.encode_reply(2, np.array([1, 2])), report(3), report(4, rows=2, k=5)]
    stream = b"".join(messages)
    for chunk in (1, 7, 24, len(messages[0]), len(stream)):
        splitter, out = wire.Splitter(), []
        for at in range(0, len(stream), chunk):
            out += splitter.feed(stream[at:at + chunk])
        assert out == messages, chunk
    with pytest.raises(wire.WireError, match="not a dualvllm lockstep stream"):
        wire.Splitter().feed(b"GET / HTTP/1.1\r\n\r\n")


async def test_the_channel_reads_queued_reports_in_order_and_routes_each_reply_to_its_sender():
    """receive_many hands over every queued report in arrival order, a malformed one as its
    WireError (the others are not lost), and a reply reaches the plugin that sent the report."""
    channel = LockstepChannel()
    host, port = channel.address.removeprefix("tcp://").split(":")
    plugins = [await asyncio.open_connection(host, int(port)) for _ in range(2)]
    try:
        plugins[0][1].write(report(1, 10) + other_version(report(9, 99)) + report(2, 11))
        await plugins[0][1].drain()
        plugins[1][1].write(report(5, 20))
        received: list = []
        while len(received) < 4:
            received += await asyncio.wait_for(channel.receive_many(), 10)
        # Which connection the event loop reads first is not fixed: tell them by their reports.
        peer = {int(r.ids[0]): identity for identity, r in received if isinstance(r, wire.Report)}
        assert peer[10] == peer[11] != peer[20]
        first = [entry for entry in received if entry[0] == peer[10]]  # plugin 0's, in its order
        assert [type(r).__name__ for _, r in first] == ["Report", "WireError", "Report"]
        assert [r.step for _, r in first if isinstance(r, wire.Report)] == [1, 2]
        (other,) = [entry for entry in received if entry[0] == peer[20]]
        assert isinstance(other[1], wire.Report) and other[1].ids.tolist() == [20]

        channel.reply(other[0], 5, np.array([7]))
        channel.reply(first[0][0], 1, np.array([wire.END]))
        for (reader, _), expected in zip(plugins, [(1, [wire.END]), (5, [7])]):
            step, tokens = wire.decode_reply(await asyncio.wait_for(read_message(reader), 10))
            assert (step, tokens.tolist()) == expected
    finally:
        for _, writer in plugins:
            writer.close()
        channel.close()


async def hung_up(reader: asyncio.StreamReader) -> bool:
    """The other end closed the connection (a FIN, or a reset if it closed with data unread)."""
    try:
        return await asyncio.wait_for(reader.read(), 10) == b""
    except ConnectionResetError:
        return True


async def test_a_stream_from_another_program_is_handed_over_as_an_error_and_hung_up():
    """A peer whose bytes are not a lockstep stream (an older dualvllm's zmq plugin, anything
    else) gives the reader one WireError, and its connection is closed; other peers go on."""
    channel = LockstepChannel()
    host, port = channel.address.removeprefix("tcp://").split(":")
    stranger = await asyncio.open_connection(host, int(port))
    plugin = await asyncio.open_connection(host, int(port))
    try:
        stranger[1].write(b"\xff\0\0\0\0\0\0\0\x01\x7f")  # zmq's greeting
        (bad,) = await asyncio.wait_for(channel.receive_many(), 10)
        assert isinstance(bad[1], wire.WireError) and "not a dualvllm lockstep stream" in str(bad[1])
        assert await hung_up(stranger[0])
        with pytest.raises(wire.WireError):
            plugin[1].write(b"\xff" * 8)
            await asyncio.wait_for(channel.receive(), 10)
        other = await asyncio.open_connection(host, int(port))
        other[1].write(report(3))
        identity, good = await asyncio.wait_for(channel.receive(), 10)
        assert good.step == 3 and identity not in (bad[0],)
        other[1].close()
    finally:
        stranger[1].close()
        plugin[1].close()
        channel.close()


async def test_a_report_that_arrives_while_nobody_waits_is_read_at_the_next_wait():
    channel = LockstepChannel()
    host, port = channel.address.removeprefix("tcp://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        waiting = asyncio.create_task(channel.receive_many())  # starts serving, then waits
        writer.write(report(1))
        (first,) = await asyncio.wait_for(waiting, 10)
        assert first[1].step == 1
        waiting = asyncio.create_task(channel.receive_many())
        await eventually(lambda: channel._woken is not None, "the channel waits for a report")
        waiting.cancel()  # a wait that ends without a report
        await asyncio.gather(waiting, return_exceptions=True)
        writer.write(report(2))  # nobody waits on the channel now
        (second,) = await asyncio.wait_for(channel.receive_many(), 10)
        assert second[1].step == 2
    finally:
        writer.close()
        channel.close()


# -- the plugin's link, against a plain listening socket -------------------------------------


def serve_once(listener: socket.socket, answer) -> socket.socket:
    """Accept one connection, read one report, send what `answer(report)` gives (bytes)."""
    conn, _ = listener.accept()
    conn.settimeout(10)
    splitter, got = wire.Splitter(), []
    while not got:
        got = splitter.feed(conn.recv(1 << 16))
    conn.sendall(answer(wire.decode_report(got[0])))
    return conn


def read_until_closed(conn: socket.socket) -> bytes:
    data = b""
    while chunk := conn.recv(1 << 16):
        data += chunk
    return data


def test_the_link_skips_late_replies_and_reconnects_after_giving_up():
    listener = socket.create_server(("127.0.0.1", 0))
    link = CoordinatorLink(f"tcp://127.0.0.1:{listener.getsockname()[1]}")
    try:
        link.step = 2
        assert link.send(report(2), time.monotonic() + 10)
        # A late reply to step 1 first, then the one for step 2, in one write.
        conn = serve_once(listener, lambda r: wire.encode_reply(1, np.array([9])) + wire.encode_reply(r.step, np.array([4])))
        assert link.receive(time.monotonic() + 10).tolist() == [4]

        link.step = 3
        assert link.send(report(3), time.monotonic() + 10)
        assert link.receive(time.monotonic() + 0.2) is None and "did not answer in time" in link.problem
        assert read_until_closed(conn) == report(3)  # then the link hung up: nothing late reaches the next step
        link.step = 4
        assert link.send(report(4), time.monotonic() + 10)  # a new connection
        conn2 = serve_once(listener, lambda r: wire.encode_reply(r.step, np.array([5])))
        assert link.receive(time.monotonic() + 10).tolist() == [5]
        conn.close()
        conn2.close()
    finally:
        link.close()
        listener.close()


def test_a_coordinator_that_is_gone_fails_the_link_at_once_with_the_reason():
    listener = socket.create_server(("127.0.0.1", 0))
    address = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    listener.close()  # nothing listens there now
    link = CoordinatorLink(address)
    assert not link.send(report(1), time.monotonic() + 10)
    assert "could not be reached" in link.problem and "ConnectionRefusedError" in link.problem
    assert link.receive(time.monotonic() + 10) is None
