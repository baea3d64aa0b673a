"""The lockstep messages between the vLLM plugin and the coordinator, over one TCP connection
per plugin and coordinator: raw little-endian numpy buffers one after the other, no JSON.

Every message starts with a frame header, struct <4sI: the magic b"DVLS" and the length of
the rest. A reader of the byte stream splits it into messages with it (`Splitter`); a stream
that does not start with the magic is not a dualvllm lockstep stream (wire version 2 and
older spoke zmq, whose greeting starts 0xFF) and is refused at once.

Report (plugin -> coordinator), one per decode step and coordinator, rows in batch order:

    header     struct <IIIIII version, step, rows n, k, flags (FLAG_*), capacity (the
                              server's max_num_seqs: the most requests it runs at once)
    ids        int64 [n]      the request's lockstep id (the coordinator's stream id)
    positions  int64 [n]      the position whose token this row decides (0 = first generated)
    token_ids  int32 [n, k]   top-k token ids, best first
    logprobs   float32 [n, k] their raw log-softmax values (temperature 1, no processors)

Reply (coordinator -> plugin), answering one report:

    header     struct <IIIxxxx version, step (echoed), rows n, 4 bytes of padding (so that
                               the tokens start 8-byte aligned)
    tokens     int64 [n]      the token each row must emit, or END (-1): emit the
                              request's stop token, which ends it

`step` counts a plugin's reports to one coordinator; a reply to an older step (one that
arrived after the plugin gave up waiting) is recognised and dropped.

Plain TCP, not zmq (version 3; version 2 was one zmq frame per message): zmq moves every
message through its own I/O thread, which cost about as much coordinator CPU again as the
reading and writing themselves (benchmarks/README.md, "the messaging floor").
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

VERSION = 3  # 3: plain TCP with frame headers (2: one zmq frame per message, 1: one zmq frame per array)
END = -1  # reply token: end this request (the plugin forces its stop token)
FLAG_CHUNKED_PREFILL = 1  # the server may split prompts over steps: lockstep is unsafe there
# The server has reported to another coordinator within SHARED_WINDOW_S: its steps also wait on
# that one, so a wait here may be a deadlock across coordinators (coordinator/lockstep/waits.py).
# Each coordinator's start-up check reports from both servers, so coordinators that start
# together are known to share them from their first sequence; past the window, the first
# deadlock waits the stall limit once.
FLAG_SHARED = 2
SHARED_WINDOW_S = 600.0

# vllm_xargs keys of a lockstep request (values must be str, int or float for vLLM)
ARG_ADDRESS = "dualvllm_address"  # the coordinator's address, tcp://host:port
ARG_ID = "dualvllm_id"  # the stream id the coordinator knows this request by
ARG_OFFSET = "dualvllm_offset"  # position of the request's first generated token
ARG_TOP_K = "dualvllm_top_k"
ARG_STOP = "dualvllm_stop"  # the stop token id forced for END (in the request's stop_token_ids)
ARGS = (ARG_ADDRESS, ARG_ID, ARG_OFFSET, ARG_TOP_K, ARG_STOP)

MAGIC = b"DVLS"
FRAME = struct.Struct("<4sI")  # magic, length of the rest of the message
# A report of 4,096 rows of top-256 is 8.4 MB: a longer frame is a corrupt stream, not a message.
MAX_MESSAGE = 1 << 26
_REPORT_HEADER = struct.Struct("<IIIIII")
_REPLY_HEADER = struct.Struct("<IIIxxxx")


@dataclass(frozen=True)
class Tagged:
    """What a lockstep request's vllm_xargs say: built by `request_args`, read back by the plugin
    (processor.tagged), so the two ends cannot spell a key differently."""

    address: str
    id: int
    offset: int
    top_k: int
    stop: int

    @property
    def key(self) -> tuple[str, int]:
        return self.address, self.id


def request_args(tag: Tagged) -> dict[str, str | int]:
    """The vllm_xargs of a lockstep request (the coordinator's side of processor.tagged)."""
    return {ARG_ADDRESS: tag.address, ARG_ID: tag.id, ARG_OFFSET: tag.offset, ARG_TOP_K: tag.top_k, ARG_STOP: tag.stop}


class WireError(ValueError):
    """A message that does not follow this format (another version, truncated frames)."""


@dataclass(frozen=True)
class Report:
    step: int
    flags: int
    capacity: int
    ids: np.ndarray  # int64 [n]
    positions: np.ndarray  # int64 [n]
    token_ids: np.ndarray  # int32 [n, k]
    logprobs: np.ndarray  # float32 [n, k]


def encode_report(
    step: int,
    flags: int,
    capacity: int,
    ids: np.ndarray,
    positions: np.ndarray,
    token_ids: np.ndarray,
    logprobs: np.ndarray,
) -> bytes:
    """The report as one message, frame header included."""
    n, k = token_ids.shape
    header = _REPORT_HEADER.pack(VERSION, step, n, k, flags, capacity)
    return b"".join(
        (
            FRAME.pack(MAGIC, len(header) + 16 * n + 8 * n * k),
            header,
            np.ascontiguousarray(ids, dtype="<i8").data,
            np.ascontiguousarray(positions, dtype="<i8").data,
            np.ascontiguousarray(token_ids, dtype="<i4").data,
            np.ascontiguousarray(logprobs, dtype="<f4").data,
        )
    )


def decode_report(message: bytes) -> Report:
    """A report from its message (frame header included); WireError if malformed. The arrays
    are views of `message`."""
    _check_frame(message, _REPORT_HEADER.size, "report")
    version, step, n, k, flags, capacity = _REPORT_HEADER.unpack_from(message, FRAME.size)
    _check_version(version)
    expected = FRAME.size + _REPORT_HEADER.size + 16 * n + 8 * n * k
    if len(message) != expected:
        raise WireError(f"a report of {n} rows of top-{k} has {expected} bytes; got {len(message)}")
    at = FRAME.size + _REPORT_HEADER.size
    return Report(
        step=step,
        flags=flags,
        capacity=capacity,
        ids=np.frombuffer(message, dtype="<i8", count=n, offset=at),
        positions=np.frombuffer(message, dtype="<i8", count=n, offset=at + 8 * n),
        token_ids=np.frombuffer(message, dtype="<i4", count=n * k, offset=at + 16 * n).reshape(n, k),
        logprobs=np.frombuffer(message, dtype="<f4", count=n * k, offset=at + 16 * n + 4 * n * k).reshape(n, k),
    )


def encode_reply(step: int, tokens: np.ndarray) -> bytes:
    """The reply as one message, frame header included."""
    return (
        FRAME.pack(MAGIC, _REPLY_HEADER.size + 8 * len(tokens))
        + _REPLY_HEADER.pack(VERSION, step, len(tokens))
        + np.ascontiguousarray(tokens, dtype="<i8").tobytes()
    )


def decode_reply(message: bytes) -> tuple[int, np.ndarray]:
    """(step, tokens int64 [n]) from the reply's message (frame header included); WireError if malformed."""
    _check_frame(message, _REPLY_HEADER.size, "reply")
    version, step, n = _REPLY_HEADER.unpack_from(message, FRAME.size)
    _check_version(version)
    expected = FRAME.size + _REPLY_HEADER.size + 8 * n
    if len(message) != expected:
        raise WireError(f"a reply of {n} rows has {expected} bytes; got {len(message)}")
    return step, np.frombuffer(message, dtype="<i8", count=n, offset=FRAME.size + _REPLY_HEADER.size)


def message_length(frame_header: bytes | bytearray) -> int:
    """The whole length of the message that starts with this frame header (FRAME.size bytes);
    WireError if the stream is not a dualvllm lockstep stream or the length cannot be a message."""
    magic, length = FRAME.unpack_from(frame_header)
    if magic != MAGIC:
        raise WireError(
            f"not a dualvllm lockstep stream (it starts {bytes(frame_header[:4])!r}, not {MAGIC!r}): "
            "the peer runs another dualvllm version (version 2 and older spoke zmq) or another program"
        )
    if length > MAX_MESSAGE:
        raise WireError(f"a lockstep message of {length:,} bytes (at most {MAX_MESSAGE:,}): a corrupt stream")
    return FRAME.size + length


class Splitter:
    """Splits a byte stream, fed as it arrives, into whole messages (frame headers included).
    After a WireError the stream cannot be followed any more: drop the connection."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        buffer = self._buffer
        if not buffer and len(data) >= FRAME.size and message_length(data) == len(data):
            return [data]  # the usual case: one read, one whole message, no copy
        buffer += data
        messages = []
        at = 0
        while len(buffer) - at >= FRAME.size:
            end = at + message_length(buffer[at : at + FRAME.size])
            if end > len(buffer):
                break
            messages.append(bytes(buffer[at:end]))
            at = end
        del buffer[:at]
        return messages


def _check_frame(message: bytes, header_size: int, what: str) -> None:
    if len(message) < FRAME.size + header_size:
        raise WireError(f"a {what} has at least {FRAME.size + header_size} bytes; got {len(message)}")
    if message_length(message[: FRAME.size]) != len(message):
        raise WireError(
            f"a {what} whose frame header says {message_length(message[: FRAME.size])} bytes has {len(message)}"
        )


def _check_version(version: int) -> None:
    if version != VERSION:
        raise WireError(
            f"lockstep message version {version}, this side speaks {VERSION}: "
            "the servers and the coordinator run different dualvllm versions"
        )
