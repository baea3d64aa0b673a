"""The lockstep plugin (engines/vllm_plugin/processor.py) driven directly, without a server:
its argument checks, and apply() against the real coordinator channel (engines/lockstep_channel.py)
in a thread of its own, answering as each test says."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from vllm import SamplingParams  # noqa: E402
from vllm.v1.sample.logits_processor import BatchUpdate  # noqa: E402

from dualvllm.engines.lockstep_channel import LockstepChannel  # noqa: E402
from dualvllm.engines.vllm_plugin import processor, wire  # noqa: E402
from tests.waiting import eventually  # noqa: E402

STOP = 1


def lockstep_params(address: str, stream_id: int, *, offset: int = 0, top_k: int = 3, **changes) -> SamplingParams:
    args = {**wire.request_args(wire.Tagged(address, stream_id, offset=offset, top_k=top_k, stop=STOP)), **changes}
    return SamplingParams(temperature=0.0, stop_token_ids=[STOP], extra_args=args)


def plugin(monkeypatch, timeout_s: float = 5.0, max_num_seqs: int = 7) -> processor.LockstepProcessor:
    monkeypatch.setenv(processor.TIMEOUT_ENV, str(timeout_s))
    config = SimpleNamespace(scheduler_config=SimpleNamespace(enable_chunked_prefill=False, max_num_seqs=max_num_seqs),
                             parallel_config=SimpleNamespace(tensor_parallel_size=1))
    return processor.LockstepProcessor(config, torch.device("cpu"), False)


def add(proc: processor.LockstepProcessor, *rows: tuple[int, SamplingParams | None]) -> None:
    proc.update_state(BatchUpdate(batch_size=len(rows), removed=[],
                                  added=[(i, p or SamplingParams(), [5, 6], []) for i, p in rows], moved=[]))


class Coordinator:
    """The coordinator's channel, in an event loop of its own thread, answering each report with
    the tokens `choose(report)` gives (None: no answer)."""

    def __init__(self, choose) -> None:
        self.channel = LockstepChannel()
        self.address = self.channel.address
        self.reports: list[wire.Report] = []
        self.choose = choose
        self.loop = asyncio.new_event_loop()
        self.serving = self.loop.create_task(self._serve())
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.loop.run_until_complete(self.serving)
        except asyncio.CancelledError:
            pass

    async def _serve(self) -> None:
        try:
            while True:
                identity, report = await self.channel.receive()
                self.reports.append(report)
                tokens = self.choose(report)
                if tokens is not None:
                    self.channel.reply(identity, report.step, np.asarray(tokens))
        finally:
            self.channel.close()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.serving.cancel)
        self.thread.join(10)
        assert not self.thread.is_alive(), "the test coordinator's thread did not stop within 10 s"
        self.loop.close()


@pytest.fixture
def coordinator():
    made = []

    def make(choose):
        made.append(Coordinator(choose))
        return made[-1]

    yield make
    for c in made:
        c.close()


def test_ordinary_requests_are_left_alone(monkeypatch):
    proc = plugin(monkeypatch)
    add(proc, (0, None), (1, SamplingParams(extra_args={"other": 1})))
    logits = torch.randn(2, 10)
    assert torch.equal(proc.apply(logits.clone()), logits)


@pytest.mark.parametrize("changes, message", [
    ({wire.ARG_ADDRESS: "tcp://10.1.2.3:5555"}, "not on a loopback address"),
    ({wire.ARG_ADDRESS: "http://127.0.0.1:5555"}, "must be tcp://HOST:PORT"),
    ({wire.ARG_ADDRESS: "ipc:///tmp/coordinator"}, "must be tcp://HOST:PORT"),
    ({wire.ARG_ADDRESS: "tcp://127.0.0.1:99999"}, "must be tcp://HOST:PORT"),
    ({wire.ARG_ID: "7"}, "must be integers"),
    ({wire.ARG_TOP_K: 0}, "out of range"),
])
def test_malformed_or_remote_coordinators_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        processor.LockstepProcessor.validate_params(lockstep_params("tcp://127.0.0.1:5555", 1, **changes))


def test_an_allow_listed_host_is_accepted_and_stop_must_be_a_stop_token(monkeypatch):
    monkeypatch.setenv(processor.ALLOWED_HOSTS_ENV, "10.1.2.3, 10.9.9.9")
    processor.LockstepProcessor.validate_params(lockstep_params("tcp://10.1.2.3:5555", 1))
    params = SamplingParams(extra_args={wire.ARG_ADDRESS: "tcp://[::1]:5555", wire.ARG_ID: 1, wire.ARG_OFFSET: 0,
                                        wire.ARG_TOP_K: 3, wire.ARG_STOP: STOP})
    with pytest.raises(ValueError, match="must be in stop_token_ids"):
        processor.LockstepProcessor.validate_params(params)
    with pytest.raises(ValueError, match="without"):
        processor.LockstepProcessor.validate_params(SamplingParams(extra_args={wire.ARG_ID: 1}))


def test_rows_report_their_top_k_and_emit_exactly_the_chosen_token(monkeypatch, coordinator):
    proc = plugin(monkeypatch)
    c = coordinator(lambda report: [4 + int(i) for i in report.ids])  # row with id i must emit 4 + i
    add(proc, (0, lockstep_params(c.address, 1, offset=3)), (1, None), (2, lockstep_params(c.address, 2)))
    logits = torch.randn(3, 10)
    out = proc.apply(logits.clone())
    [report] = c.reports
    assert report.ids.tolist() == [1, 2] and report.positions.tolist() == [3, 0] and report.capacity == 7
    expected = torch.topk(torch.log_softmax(logits[[0, 2]], dim=-1), 3)
    assert report.token_ids.tolist() == expected.indices.tolist()
    np.testing.assert_allclose(report.logprobs, expected.values.numpy(), rtol=1e-6)
    assert out[0].argmax().item() == 5 and torch.isinf(out[0]).sum().item() == 9
    assert out[2].argmax().item() == 6 and torch.isinf(out[2]).sum().item() == 9
    assert torch.equal(out[1], logits[1])  # the ordinary row is untouched
    proc.apply(torch.randn(3, 10))
    assert c.reports[1].positions.tolist() == [4, 1]  # positions advance per forced token


def test_end_forces_the_stop_token_and_a_silent_coordinator_ends_its_rows(monkeypatch, coordinator):
    proc = plugin(monkeypatch, timeout_s=0.3)
    ends = coordinator(lambda report: [wire.END] * len(report.ids))
    silent = coordinator(lambda report: None)
    add(proc, (0, lockstep_params(ends.address, 1)), (1, lockstep_params(silent.address, 2)))
    out = proc.apply(torch.randn(2, 10))
    assert out[0].argmax().item() == STOP and out[1].argmax().item() == STOP
    # The silent one may take its report in after the plugin gave up (its thread, a loaded machine).
    asyncio.run(eventually(lambda: len(silent.reports) == 1, "the silent coordinator got its report"))
    assert len(ends.reports) == 1 and len(silent.reports) == 1


def test_the_coordinators_request_args_read_back_as_they_were_built():
    tag = wire.Tagged("tcp://127.0.0.1:5555", 2**61 + 5, offset=7, top_k=20, stop=STOP)
    assert processor.tagged(SamplingParams(stop_token_ids=[STOP], extra_args=wire.request_args(tag))) == tag
    assert set(wire.request_args(tag)) == set(wire.ARGS)  # every key the plugin requires, no other


@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [2, 0], [3]], ids=["whole-batch", "some-rows", "one-row"])
def test_row_topk_is_the_top_k_of_the_rows_log_softmax(rows):
    logits = torch.randn(4, 5_000, generator=torch.Generator().manual_seed(0)) * 4  # [B, V]
    values, ids = processor.row_topk(logits, rows, 7)
    expected_values, expected_ids = torch.topk(torch.log_softmax(logits[rows], dim=-1), 7, dim=-1)
    assert torch.equal(ids, expected_ids)
    assert torch.allclose(values, expected_values, atol=1e-5)
