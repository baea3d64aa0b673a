"""The lockstep plugin for Model Runner V2 (engines/vllm_plugin/processor_v2.py) driven directly.

Model Runner V2 needs Triton, which the CPU build lacks, so no server here runs it: these
tests call the processor as V2's sampler would (add_request per slot, apply with the step's
row -> slot mapping) against the real coordinator channel in a thread of its own.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from vllm import SamplingParams  # noqa: E402

from dualvllm.engines.vllm_plugin import processor, wire  # noqa: E402
from dualvllm.engines.vllm_plugin.processor_v2 import LockstepProcessorV2  # noqa: E402
from tests.unit.engines.test_vllm_plugin import STOP, coordinator, lockstep_params  # noqa: E402,F401

VOCAB = 10


def plugin(monkeypatch, **config) -> LockstepProcessorV2:
    monkeypatch.setenv(processor.TIMEOUT_ENV, "5")
    vllm_config = SimpleNamespace(scheduler_config=SimpleNamespace(enable_chunked_prefill=False, max_num_seqs=7),
                                  parallel_config=SimpleNamespace(tensor_parallel_size=1), **config)
    return LockstepProcessorV2(vllm_config, req_states=None)


def step(slots: list[int]) -> SimpleNamespace:
    """A step's layout as V2 passes it: batch row -> request slot (the fields this plugin reads)."""
    return SimpleNamespace(idx_mapping_np=np.array(slots, dtype=np.int32))


def test_rows_are_found_through_their_slots_and_emit_exactly_the_chosen_token(monkeypatch, coordinator):
    proc = plugin(monkeypatch)
    c = coordinator(lambda report: [4 + int(i) for i in report.ids])  # stream i must emit 4 + i
    assert proc.add_request(5, lockstep_params(c.address, 1, offset=3))
    assert not proc.add_request(2, SamplingParams())
    assert proc.add_request(0, lockstep_params(c.address, 2))
    logits = torch.randn(3, VOCAB)
    out = proc.apply(logits.clone(), step([0, 2, 5]))  # rows in slot order 0, 2, 5
    [report] = c.reports
    assert report.ids.tolist() == [2, 1] and report.positions.tolist() == [0, 3]
    expected = torch.topk(torch.log_softmax(logits[[0, 2]], dim=-1), 3)
    assert report.token_ids.tolist() == expected.indices.tolist()
    assert out[0].argmax().item() == 6 and torch.isinf(out[0]).sum().item() == VOCAB - 1
    assert out[2].argmax().item() == 5 and torch.isinf(out[2]).sum().item() == VOCAB - 1
    assert torch.equal(out[1], logits[1])  # the ordinary request is untouched
    proc.apply(torch.randn(2, VOCAB), step([5, 0]))  # rows reordered, as V2 does every step
    assert c.reports[1].ids.tolist() == [1, 2] and c.reports[1].positions.tolist() == [4, 1]


def test_a_recycled_slot_forgets_its_last_lockstep_request(monkeypatch, coordinator):
    proc = plugin(monkeypatch)
    c = coordinator(lambda report: [wire.END] * len(report.ids))
    proc.add_request(3, lockstep_params(c.address, 9))
    out = proc.apply(torch.randn(1, VOCAB), step([3]))
    assert out[0].argmax().item() == STOP  # END: the request's stop token
    assert not proc.add_request(3, SamplingParams())  # an ordinary request gets the slot
    logits = torch.randn(1, VOCAB)
    assert torch.equal(proc.apply(logits.clone(), step([3])), logits) and len(c.reports) == 1


def test_a_preempted_request_keeps_counting_from_where_it_was(monkeypatch, coordinator):
    proc = plugin(monkeypatch)
    c = coordinator(lambda report: [7] * len(report.ids))
    proc.add_request(1, lockstep_params(c.address, 4, offset=2))
    proc.apply(torch.randn(1, VOCAB), step([1]))
    proc.add_request(6, lockstep_params(c.address, 4, offset=2))  # back in another slot
    proc.apply(torch.randn(1, VOCAB), step([6]))
    assert [r.positions.tolist() for r in c.reports] == [[2], [3]]


def test_speculative_decoding_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="speculative decoding"):
        plugin(monkeypatch, speculative_config=SimpleNamespace(num_speculative_tokens=2))
    with pytest.raises(ValueError, match="must be in stop_token_ids"):
        LockstepProcessorV2.validate_params(SamplingParams(extra_args=wire.request_args(
            wire.Tagged("tcp://127.0.0.1:5555", 1, offset=0, top_k=3, stop=STOP))))
