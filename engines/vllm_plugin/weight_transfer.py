"""The server side of dualvllm's in-memory weight push: a vLLM weight-transfer engine for CPU.

Registered under dualvllm.engines.weight_transfer.BACKEND by `register`, a `vllm.general_plugins` entry
point that vLLM runs in every server process; a server uses it when started with
`--weight-transfer-config '{"backend": "dualvllm_shm"}'` (the launcher adds it to dev-mode base
servers on the CPU build). The wire format and why shared memory: engines/weight_transfer.py.

Each phase, run by vLLM's worker:
- init: open the trainer's segment and read back its token (one machine, one /dev/shm);
- start: vLLM's layerwise reload (`initialize_layerwise_reload`), as its NCCL engine does;
- update (per chunk): map the segment, hand the chunk's tensors, views into it, to the
  model's own `load_weights`, which copies each into place (the mapping goes with the last
  view);
- finish: `finalize_layerwise_reload`, which puts back the old tensors of any layer that
  received nothing.
Every tensor handed to `load_weights` is digested from the segment's bytes on the way
(dualvllm.engines.weight_digest, reset at start); the digest of the last finished update is
`last_digest`, which the worker extension (worker_extension.py) reports to the trainer. A
failed update leaves no digest: the server then holds a mix of old and new layers.
A chunk that fails to load finalizes the reload before it raises: vLLM's worker drops the
session on an error without finalizing it, which would leave layers on the meta device and
kill the engine at its next forward pass.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol, cast

from dualvllm.engines.weight_digest import PushDigest
from dualvllm.engines.weight_transfer import BACKEND, ShmInitInfo, ShmUpdateInfo, segment_path

if TYPE_CHECKING:
    import torch

log = logging.getLogger("vllm.dualvllm_weight_transfer")


class _LoadsWeights(Protocol):
    """A vLLM model: every one has `load_weights`, which vLLM's engines' `model` (an nn.Module) is typed without."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> object: ...


def register() -> None:
    """The entry point (pyproject.toml: vllm.general_plugins): the engine under BACKEND, loaded
    lazily (nothing is imported until a server asks for it)."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:  # vLLM runs plugins once per process, tests twice
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "SharedMemoryWeightTransferEngine")


def _engine_class() -> type:
    import torch
    from vllm.distributed.weight_transfer.base import WeightTransferEngine
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    # Any, Any: ShmInitInfo and ShmUpdateInfo are plain dataclasses, outside the info classes vLLM's type
    # parameters are bound to, so that engines/weight_transfer.py imports only the standard library.
    class SharedMemoryWeightTransferEngine(WeightTransferEngine[Any, Any]):
        """Receives chunks of checkpoint-format weights through a /dev/shm segment."""

        init_info_cls = ShmInitInfo
        update_info_cls = ShmUpdateInfo
        supports_draft_weight_update = False

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._ready = False  # the trainer proved it shares this machine's /dev/shm
            self._active = False
            self._digest = PushDigest()  # of the update in progress
            self.last_digest: str | None = None  # of the last finished update; None: none finished

        def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
            path = segment_path(init_info.segment)
            try:
                with open(path, "rb") as segment:
                    token = segment.read(len(init_info.token.encode())).decode(errors="replace")
            except OSError as err:
                raise RuntimeError(
                    f"dualvllm weight transfer: this server cannot open the trainer's segment {path} "
                    f"({err}): the trainer runs on another machine or in another container. "
                    "Push through the disk instead (--weights-via disk), with the push directory "
                    "on a filesystem both see"
                ) from err
            if token != init_info.token:
                raise RuntimeError(
                    f"dualvllm weight transfer: {path} does not hold the trainer's token: it is "
                    "another machine's segment of the same name; push through the disk instead"
                )
            self._ready = True
            log.info("dualvllm weight transfer: the trainer's segments are readable here (%s)", path)

        def start_weight_update(self) -> None:
            initialize_layerwise_reload(self.model)
            self._active = True
            self._digest = PushDigest()
            self.last_digest = None  # until this update finishes, the model is neither the old step nor the new

        def update_weights(self, update_info: dict[str, Any]) -> None:
            # vLLM's base class synchronizes an accelerator here; on CPU the copies are done on return.
            self.receive_weights(self.parse_update_info(update_info))

        def receive_weights(self, update_info: ShmUpdateInfo) -> None:
            try:
                self._load(update_info)
            except BaseException:
                self._abandon()
                raise

        def _load(self, info: ShmUpdateInfo) -> None:
            if not self._ready:
                raise RuntimeError("dualvllm weight transfer: update_weights before init_weight_transfer_engine")
            fd = os.open(segment_path(info.segment), os.O_RDWR)  # writable: torch.frombuffer warns on read-only
            try:
                buffer = mmap.mmap(fd, 0)
            finally:
                os.close(fd)  # the mapping stays valid without it
            # Never closed here: load_weights copies most tensors into the model at once, but a layer
            # that waits for finalize (vLLM defers attention layers, and layers not loaded whole) keeps
            # views into the segment until finish_weight_update, and torch.frombuffer does not stop a
            # close (a copy from an unmapped view segfaults). Each view holds the mapping; it is
            # unmapped when the last one goes. The trainer writes every chunk to a new segment, so
            # nothing overwrites what they see.
            cast(_LoadsWeights, self.model).load_weights(_views(buffer, info, self._digest))

        def _abandon(self) -> None:
            """Put the model back together after a failed chunk: layers that got nothing keep their
            old tensors (vLLM's worker ends the session on the error without finalizing it)."""
            if self._active:
                self._active = False
                try:
                    finalize_layerwise_reload(self.model, self.model_config)
                except Exception:  # the original error is the one to report
                    log.exception("dualvllm weight transfer: could not restore the model after a failed chunk")

        def finish_weight_update(self) -> None:
            self._active = False
            finalize_layerwise_reload(self.model, self.model_config)
            self.last_digest = self._digest.hexdigest()

        def shutdown(self) -> None:
            self._ready = False

    def _views(buffer: mmap.mmap, info: ShmUpdateInfo, digest: PushDigest) -> Iterator[tuple[str, torch.Tensor]]:
        """The chunk's tensors as views into the mapped segment, without a copy, each digested from
        the segment's bytes as it is handed on (the bytes load_weights copies into the model)."""
        raw = memoryview(buffer)
        for name, dtype_name, shape, offset in zip(info.names, info.dtype_names, info.shapes, info.offsets):
            dtype = getattr(torch, dtype_name)
            count = int(torch.Size(shape).numel())
            digest.add(name, dtype_name, shape, raw[offset : offset + count * dtype.itemsize])
            flat = torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset)
            yield name, flat.view(shape)

    return SharedMemoryWeightTransferEngine


def __getattr__(name: str) -> Any:
    # The class is built on first access (by vLLM's factory, inside a server), so importing this
    # module needs neither torch nor vLLM.
    if name == "SharedMemoryWeightTransferEngine":
        cls = _engine_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
