"""The lockstep messages between the vLLM plugin and the coordinator: zmq multipart frames
of raw little-endian numpy buffers, no JSON.

Report (plugin -> coordinator), one per decode step and coordinator, rows in batch order:

    header     struct <IIIIII version, step, rows n, k, flags, capacity (the server's
                              max_num_seqs: the most requests it runs at once)
    ids        int64 [n]      the request's lockstep id (the coordinator's stream id)
    positions  int64 [n]      the position whose token this row decides (0 = first generated)
    token_ids  int32 [n, k]   top-k token ids, best first
    logprobs   float32 [n, k] their raw log-softmax values (temperature 1, no processors)

Reply (coordinator -> plugin), answering one report:

    header     struct <III    version, step (echoed), rows n
    tokens     int64 [n]      the token each row must emit, or END (-1): emit the
                              request's stop token, which ends it

`step` counts a plugin's reports to one coordinator; a reply to an older step (one that
arrived after the plugin gave up waiting) is recognised and dropped.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

VERSION = 1
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
_REPLY_HEADER = struct.Struct("<III")


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
                  token_ids: np.ndarray, logprobs: np.ndarray) -> list[bytes | memoryview]:
    n, k = token_ids.shape
    return [_REPORT_HEADER.pack(VERSION, step, n, k, flags, capacity),
            np.ascontiguousarray(ids, dtype="<i8").data, np.ascontiguousarray(positions, dtype="<i8").data,
            np.ascontiguousarray(token_ids, dtype="<i4").data, np.ascontiguousarray(logprobs, dtype="<f4").data]


def decode_report(frames: list[bytes]) -> Report:
    if len(frames) != 5 or len(frames[0]) != _REPORT_HEADER.size:
        raise WireError(f"a report has 5 frames and a {_REPORT_HEADER.size}-byte header; got {len(frames)} frames")
    version, step, n, k, flags, capacity = _REPORT_HEADER.unpack(frames[0])
    _check_version(version)
    sizes = (8 * n, 8 * n, 4 * n * k, 4 * n * k)
    if tuple(len(f) for f in frames[1:]) != sizes:
        raise WireError(f"report frames of {[len(f) for f in frames[1:]]} bytes for {n} rows of top-{k}")
    return Report(step=step, flags=flags, capacity=capacity,
                  ids=np.frombuffer(frames[1], dtype="<i8"), positions=np.frombuffer(frames[2], dtype="<i8"),
                  token_ids=np.frombuffer(frames[3], dtype="<i4").reshape(n, k),
                  logprobs=np.frombuffer(frames[4], dtype="<f4").reshape(n, k))


def encode_reply(step: int, tokens: np.ndarray) -> list[bytes | memoryview]:
    return [_REPLY_HEADER.pack(VERSION, step, len(tokens)), np.ascontiguousarray(tokens, dtype="<i8").data]


def decode_reply(frames: list[bytes]) -> tuple[int, np.ndarray]:
    """(step, tokens int64 [n])."""
    if len(frames) != 2 or len(frames[0]) != _REPLY_HEADER.size:
        raise WireError(f"a reply has 2 frames and a {_REPLY_HEADER.size}-byte header; got {len(frames)} frames")
    version, step, n = _REPLY_HEADER.unpack(frames[0])
    _check_version(version)
    if len(frames[1]) != 8 * n:
        raise WireError(f"reply of {len(frames[1])} bytes for {n} rows")
    return step, np.frombuffer(frames[1], dtype="<i8")


def _check_version(version: int) -> None:
    if version != VERSION:
        raise WireError(f"lockstep message version {version}, this side speaks {VERSION}: "
                        "the servers and the coordinator run different dualvllm versions")
