"""The lockstep messages between the vLLM plugin and the coordinator: one zmq frame each, raw
little-endian numpy buffers one after the other, no JSON.

Report (plugin -> coordinator), one per decode step and coordinator, rows in batch order:

    header     struct <IIIIII version, step, rows n, k, flags, capacity (the server's
                              max_num_seqs: the most requests it runs at once)
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

One frame, not one per array: each frame costs a send, a receive and a "more?" test on both
sides whatever its size. The end-to-end gain was too small to show beside the noise of
coordinator_capacity.py (benchmarks/README.md: a few percent at batch 1 at most).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

VERSION = 2  # 2: one frame per message (1: one frame per array)
END = -1  # reply token: end this request (the plugin forces its stop token)
FLAG_CHUNKED_PREFILL = 1  # the server may split prompts over steps: lockstep is unsafe there

# vllm_xargs keys of a lockstep request (values must be str, int or float for vLLM)
ARG_ADDRESS = "dualvllm_address"  # the coordinator's zmq address, tcp://host:port or ipc://path
ARG_ID = "dualvllm_id"  # the stream id the coordinator knows this request by
ARG_OFFSET = "dualvllm_offset"  # position of the request's first generated token
ARG_TOP_K = "dualvllm_top_k"
ARG_STOP = "dualvllm_stop"  # the stop token id forced for END (in the request's stop_token_ids)
ARGS = (ARG_ADDRESS, ARG_ID, ARG_OFFSET, ARG_TOP_K, ARG_STOP)

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
    return {ARG_ADDRESS: tag.address, ARG_ID: tag.id, ARG_OFFSET: tag.offset, ARG_TOP_K: tag.top_k,
            ARG_STOP: tag.stop}


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


def encode_report(step: int, flags: int, capacity: int, ids: np.ndarray, positions: np.ndarray,
                  token_ids: np.ndarray, logprobs: np.ndarray) -> list[bytes]:
    """The report's frames (one)."""
    n, k = token_ids.shape
    return [b"".join((_REPORT_HEADER.pack(VERSION, step, n, k, flags, capacity),
                      np.ascontiguousarray(ids, dtype="<i8").data, np.ascontiguousarray(positions, dtype="<i8").data,
                      np.ascontiguousarray(token_ids, dtype="<i4").data,
                      np.ascontiguousarray(logprobs, dtype="<f4").data))]


def decode_report(frames: list[bytes]) -> Report:
    """A report from its frames (the sender's identity removed); WireError if malformed."""
    if len(frames) != 1 or len(frames[0]) < _REPORT_HEADER.size:
        raise WireError(f"a report is one frame of at least {_REPORT_HEADER.size} bytes; got {len(frames)} frames "
                        f"of {[len(f) for f in frames]} bytes")
    frame = frames[0]
    version, step, n, k, flags, capacity = _REPORT_HEADER.unpack_from(frame)
    _check_version(version)
    expected = _REPORT_HEADER.size + 16 * n + 8 * n * k
    if len(frame) != expected:
        raise WireError(f"a report of {n} rows of top-{k} has {expected} bytes; got {len(frame)}")
    at = _REPORT_HEADER.size
    return Report(step=step, flags=flags, capacity=capacity,
                  ids=np.frombuffer(frame, dtype="<i8", count=n, offset=at),
                  positions=np.frombuffer(frame, dtype="<i8", count=n, offset=at + 8 * n),
                  token_ids=np.frombuffer(frame, dtype="<i4", count=n * k, offset=at + 16 * n).reshape(n, k),
                  logprobs=np.frombuffer(frame, dtype="<f4", count=n * k, offset=at + 16 * n + 4 * n * k).reshape(n, k))


def encode_reply(step: int, tokens: np.ndarray) -> list[bytes]:
    """The reply's frames (one)."""
    return [_REPLY_HEADER.pack(VERSION, step, len(tokens)) + np.ascontiguousarray(tokens, dtype="<i8").tobytes()]


def decode_reply(frames: list[bytes]) -> tuple[int, np.ndarray]:
    """(step, tokens int64 [n]); WireError if malformed."""
    if len(frames) != 1 or len(frames[0]) < _REPLY_HEADER.size:
        raise WireError(f"a reply is one frame of at least {_REPLY_HEADER.size} bytes; got {len(frames)} frames "
                        f"of {[len(f) for f in frames]} bytes")
    frame = frames[0]
    version, step, n = _REPLY_HEADER.unpack_from(frame)
    _check_version(version)
    if len(frame) != _REPLY_HEADER.size + 8 * n:
        raise WireError(f"a reply of {n} rows has {_REPLY_HEADER.size + 8 * n} bytes; got {len(frame)}")
    return step, np.frombuffer(frame, dtype="<i8", count=n, offset=_REPLY_HEADER.size)


def _check_version(version: int) -> None:
    if version != VERSION:
        raise WireError(f"lockstep message version {version}, this side speaks {VERSION}: "
                        "the servers and the coordinator run different dualvllm versions")
