"""The learner's weights as vLLM's trainer engines read them: a `WeightSource`.

Both in-memory pushes read it: the shared-memory engine (dualvllm.training.weight_transfer)
and vLLM's NCCL engine (dualvllm.training.nccl_push). vLLM's NCCL trainer sizes the
servers' receive buffers from `metadata()` and then sends what iteration yields, checking
the two against each other name for name, dtype for dtype, shape for shape
(`NCCLTrainerWeightTransferEngine._checked_iter`): so every tensor is cast to the wire
dtype as it is yielded, on the learner's own device, and the metadata announces exactly
that. It imports no other push module, so each push module can import it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from vllm.distributed.weight_transfer import ParamMeta, WeightSource
from vllm.distributed.weight_transfer.base import layerwise_groups

from dualvllm.training import lora


class LearnerSource(WeightSource):
    """The learner's weights under checkpoint names, in `dtype` (the wire's: the server's), in
    the order vLLM's groups expect.

    A LoRA model yields its merged weights (W + scale * B A, computed one module at a time, never
    all at once). Tensors that share storage (tied embeddings) are yielded once, as the
    checkpoint on disk would hold them. `only` restricts the stream to whole decoder layers
    (vLLM's `layerwise_groups`) that hold one of these names. Each tensor is yielded on the
    learner's device, cast to `dtype` (a copy only when the dtypes differ), so what is
    iterated is what `metadata()` announces.
    """

    def __init__(self, model: Any, dtype: torch.dtype, only: set[str] | None = None) -> None:
        self._model, self._dtype = model, dtype
        names = [name for name, _ in self._tensors(merge=False)]
        self._names = names
        if only is not None:
            keep = {n for group in layerwise_groups(names) if only & set(group) for n in group}
            self._names = [n for n in names if n in keep]

    @property
    def dtype(self) -> torch.dtype:
        """The wire dtype every tensor is sent in."""
        return self._dtype

    def reads(self, model: Any) -> bool:
        """Whether this source reads `model` (the very object: a source follows its training)."""
        return model is self._model

    def metadata(self) -> list[ParamMeta]:
        wanted = set(self._names)
        return [
            ParamMeta(name, self._dtype, tuple(tensor.shape))
            for name, tensor in self._tensors(merge=False)
            if name in wanted
        ]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        wanted = set(self._names)
        return ((name, tensor.to(self._dtype)) for name, tensor in self._tensors(merge=True) if name in wanted)

    def _tensors(self, *, merge: bool) -> Iterator[tuple[str, torch.Tensor]]:
        if lora.is_lora(self._model):
            yield from lora.merged_items(self._model, merge=merge)
            return
        seen = set()
        for name, tensor in self._model.state_dict().items():
            key = (tensor.data_ptr(), tuple(tensor.shape))
            if key not in seen:
                seen.add(key)
                yield name, tensor.detach()
