"""The wire format of dualvllm's in-memory weight push, shared by the trainer and the server.

vLLM's native weight transfer runs four phases on the server (`init_weight_transfer_engine`,
`start_weight_update`, `update_weights` once per chunk, `finish_weight_update`; HTTP routes
behind VLLM_SERVER_DEV_MODE=1) and moves the bytes through a registered engine. Its built-in
engines (nccl, ipc, ...) need CUDA, so on CPU servers dualvllm registers its own, under
BACKEND: the trainer writes each chunk of the weights, already in the server's dtype, into a
shared-memory segment under /dev/shm, and `update_weights` tells the server where each tensor
lies in it. The server loads them from there with its own `load_weights` (the layerwise reload
vLLM's NCCL engine uses), so no checkpoint touches the disk.

Each chunk goes through a new segment, unlinked once the server has loaded it: neither side
ever holds a second full copy of the model, and a layer the server keeps views of until
`finish_weight_update` (vLLM defers some) is never overwritten by the next chunk. A chunk
holds whole decoder layers (vLLM's `layerwise_groups`), so a transfer cut short leaves every
layer either new or old, never half of each.

Shared memory needs the trainer and the server on one machine (one /dev/shm): the init phase
proves it with a token the trainer writes and the server reads back. Servers on other machines
take the NCCL engine on GPUs, or the disk reload through a shared filesystem.

This module imports only the standard library: the server-side engine is
engines/vllm_plugin/weight_transfer.py, the trainer side training/weight_transfer.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

BACKEND = "dualvllm_shm"
SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "dualvllm-push-"
_SEGMENT_NAME = re.compile(rf"^{re.escape(SEGMENT_PREFIX)}[0-9a-f]{{8,64}}$")
# Each tensor starts on a cache line, so the server reads it in place, aligned for every dtype.
ALIGN = 64


@dataclass
class ShmInitInfo:
    """`init_weight_transfer_engine`: a segment the trainer created and the token it wrote at
    its start, which the server must read back (it proves both see one /dev/shm)."""

    segment: str
    token: str


@dataclass
class ShmUpdateInfo:
    """One `update_weights` chunk: tensor i is `names[i]`, of dtype `dtype_names[i]` (a torch
    dtype's name) and shape `shapes[i]`, at byte `offsets[i]` of the segment."""

    segment: str
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    offsets: list[int]

    def __post_init__(self) -> None:
        if len({len(self.names), len(self.dtype_names), len(self.shapes), len(self.offsets)}) != 1:
            raise ValueError(
                f"a chunk's names, dtype_names, shapes and offsets must have one entry per tensor; "
                f"got {len(self.names)}, {len(self.dtype_names)}, {len(self.shapes)}, "
                f"{len(self.offsets)}"
            )


def segment_path(name: str) -> Path:
    """The path of segment `name` under /dev/shm; a name not of this module's making is refused
    (the server opens only segments a dualvllm trainer created, never an arbitrary file)."""
    if not _SEGMENT_NAME.match(name):
        raise ValueError(f"{name!r} is not a dualvllm weight-push segment name ({SEGMENT_PREFIX}<hex>)")
    return SHM_DIR / name


def aligned(offset: int) -> int:
    """`offset` rounded up to ALIGN bytes."""
    return -(-offset // ALIGN) * ALIGN
