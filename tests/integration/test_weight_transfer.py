"""In-memory weight pushes into real vLLM servers, through vLLM's weight-transfer API and
dualvllm's shared-memory engine (training/weight_transfer.py, engines/vllm_plugin/weight_transfer.py).

The servers are the bundled tiny models in float32, so a push is verified to 1e-3.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import pytest

from dualvllm import tinymodels
from dualvllm.common.errors import ServerError, WeightSyncError
from dualvllm.coordinator import CoordinatorConfig, DualVLLMCoordinator
from dualvllm.engines.launcher import ServerConfig, VLLMServer
from dualvllm.engines.vllm_admin import VLLMAdmin
from dualvllm.engines.vllm_client import VLLMClient
from dualvllm.engines.weight_digest import PushDigest
from tests.segments import left_behind, record_segments
from tests.waiting import eventually

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from dualvllm.training import weight_transfer  # noqa: E402
from dualvllm.training.weight_sync import BasePusher, learner_logprobs  # noqa: E402

TOKENS = 56  # and the prompts' 6: the bundled models' 64 positions, as long as they go
PROMPTS = ["12+34=", "57+68=", "4+5=", "90+15=", "33+44=", "21+7=", "8+80=", "61+19="]


def probes(tokenizer) -> list[list[int]]:
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS[:4]]


def teacher_model():
    return transformers.AutoModelForCausalLM.from_pretrained(tinymodels.TEACHER_DIR)


def base_model():
    return transformers.AutoModelForCausalLM.from_pretrained(tinymodels.BASE_DIR)


async def test_a_push_goes_through_memory_and_is_served(dev_pair, tmp_path, caplog):
    theta, _ = dev_pair
    tokenizer = transformers.AutoTokenizer.from_pretrained(tinymodels.BASE_DIR)
    learner = teacher_model()
    async with VLLMClient(theta.url, name="theta") as client:
        pusher = BasePusher(client, probes(tokenizer))
        with caplog.at_level(logging.INFO, logger="dualvllm.training"):
            report = await pusher.push(learner, tokenizer, tmp_path / "step-000001")
        assert report.via == "memory" and report.path is None
        assert report.max_abs_diff < 1e-3
        assert report.bytes_moved >= sum(t.numel() * 4 for t in learner.state_dict().values())
        assert {"init", "start", "send", "finish", "reset", "verify", "total"} <= set(report.seconds)
        assert not (tmp_path / "step-000001").exists()  # nothing was written to disk
        assert "pushed in memory" in caplog.text
        assert await client.admin.weight_version() == "step-000001"
        # A second push of changed weights
        with torch.no_grad():
            learner.lm_head.weight.mul_(1.1)
        report = await pusher.push(learner, tokenizer, tmp_path / "step-000002")
        assert report.verified_by == "digest"  # proved by its digest: no probe after the first push
        # and back to the base, so the other tests of this module start from it
        await pusher.push(base_model(), tokenizer, tmp_path / "step-000003")


def independent_digest(model) -> str:
    """The push digest of `model`'s weights in float32 (the servers'), by the definition, from the tensors."""
    digest = PushDigest()
    for name, tensor in weight_transfer.LearnerSource(model, torch.float32):
        digest.add(name, "float32", list(tensor.shape), tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


async def test_the_server_digests_the_weights_it_took_as_the_trainer_does_and_each_step_apart(dev_pair,
                                                                                              tmp_path):
    theta, _ = dev_pair
    tokenizer = transformers.AutoTokenizer.from_pretrained(tinymodels.BASE_DIR)
    learner = teacher_model()
    async with VLLMClient(theta.url, name="theta") as client:
        pusher = BasePusher(client, probes(tokenizer), probe_every=2)
        first = await pusher.push(learner, tokenizer, tmp_path / "step-000001")
        served = await client.admin.weight_digest()
        assert first.verified_by == "digest+probe" and first.max_abs_diff < 1e-3  # the first push is probed too
        assert served.digest == first.digest == independent_digest(learner) and served.missing is None
        with torch.no_grad():
            learner.lm_head.weight.mul_(1.01)
        second = await pusher.push(learner, tokenizer, tmp_path / "step-000002")
        assert (second.verified_by, second.probes, second.max_abs_diff) == ("digest", 0, None)
        assert second.digest == independent_digest(learner) != first.digest
        assert (await client.admin.weight_digest()).digest == second.digest
        third = await pusher.push(base_model(), tokenizer, tmp_path / "step-000003")  # back to the base
        assert third.verified_by == "digest+probe" and third.max_abs_diff < 1e-3  # every 2nd push is probed
        assert third.digest == independent_digest(base_model())
        # A method the worker lacks is answered as a server without the extension answers ours.
        with pytest.raises(ServerError, match="is not implemented"):
            await client.call("POST", "/collective_rpc", {"method": "dualvllm_no_such_method"}, idempotent=False)
        assert await client.admin.weight_digest() == served.__class__(third.digest)  # and the server is unharmed


async def test_a_push_after_a_trainer_died_mid_update_finishes_that_update_first(dev_pair, tmp_path, caplog):
    """A trainer killed between start and finish leaves the server paused with its update open
    (vLLM refuses a second start); the next push finishes it, then pushes and resumes the server."""
    theta, _ = dev_pair
    tokenizer = transformers.AutoTokenizer.from_pretrained(tinymodels.BASE_DIR)
    learner = teacher_model()
    async with VLLMClient(theta.url, name="theta") as client:
        await client.admin.pause(mode="keep")  # what the dead trainer did before it died: pause, init, start
        bridge = weight_transfer.LoopBridge(client, asyncio.get_running_loop())

        def begin() -> None:
            weight_transfer.SharedMemoryTrainerEngine.trainer_init(
                weight_transfer.ShmTrainerInitInfo(rank=0), client=bridge,
                source=weight_transfer.LearnerSource(learner, torch.float32))
            bridge.start_weight_update()

        await asyncio.to_thread(begin)
        with caplog.at_level(logging.WARNING, logger="dualvllm.training"):
            report = await BasePusher(client, probes(tokenizer)).push(learner, tokenizer, tmp_path / "a")
        assert report.max_abs_diff < 1e-3
        assert "started and never finished" in caplog.text
        assert await client.call("GET", "/is_paused") == {"is_paused": False}
        await BasePusher(client, probes(tokenizer)).push(base_model(), tokenizer, tmp_path / "b")  # back to the base


async def test_a_lora_push_moves_only_the_adapted_layers(dev_pair):
    peft = pytest.importorskip("peft")
    theta, _ = dev_pair
    tokenizer = transformers.AutoTokenizer.from_pretrained(tinymodels.BASE_DIR)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], layers_to_transform=[0])
    learner = peft.get_peft_model(base_model(), config)
    with torch.no_grad():  # a trained adapter (B starts at zero)
        for name, param in learner.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
    from dualvllm.training import lora

    only = lora.adapted_names(learner)
    expected = weight_transfer.expected_logprobs(learner, probes(tokenizer), "float32")
    async with VLLMClient(theta.url, name="theta") as client:
        full = await weight_transfer.transfer_and_verify(client, learner, probes(tokenizer), expected,
                                                         dtype="float32", top_k=20, tolerance=1e-3)
        partial = await weight_transfer.transfer_and_verify(client, learner, probes(tokenizer), expected,
                                                            dtype="float32", top_k=20, tolerance=1e-3, only=only)
        assert partial.max_abs_diff < 1e-3  # the layers not sent kept the weights they had
        assert partial.bytes_moved < full.bytes_moved / 2
        await weight_transfer.transfer_and_verify(  # back to the base
            client, base_model(), probes(tokenizer), learner_logprobs(base_model(), probes(tokenizer)),
            dtype="float32", top_k=20, tolerance=1e-3)


async def test_a_push_during_lockstep_decoding_keeps_its_sequences_and_they_continue_on_the_new_weights(
        dev_pair, tmp_path):
    """The base is paused with mode=keep, not drained: the sequences in flight are not ended; the
    tokens decided after the push have the new weights' logprobs, those before it the old ones."""
    theta, t = dev_pair
    tokenizer = transformers.AutoTokenizer.from_pretrained(tinymodels.BASE_DIR)
    old, new = base_model(), teacher_model()
    decided = [0] * len(PROMPTS)

    def on_tokens(index, token_ids, *_):
        decided[index] += len(token_ids)

    # top-k = the whole vocabulary: every sampled token's base logprob is the server's own
    config = CoordinatorConfig(theta_url=theta.url, t_url=t.url, mode="lockstep", top_k=98)
    async with DualVLLMCoordinator(config) as coordinator, VLLMClient(theta.url, name="theta") as client:
        assert coordinator.mode == "lockstep"
        pusher = BasePusher(client, probes(tokenizer))
        assert await pusher.in_memory()  # asked before: the push below starts at once
        generation = asyncio.create_task(coordinator.generate_batch(
            PROMPTS, max_tokens=TOKENS, seed=3, ignore_eos=True, on_tokens=on_tokens))
        await eventually(lambda: min(decided) >= 4, "every sequence decided 4 tokens")
        report = await pusher.push(new, tokenizer, tmp_path / "step-000001")
        at_push = list(decided)  # every token decided by now was decided before the push ended
        assert report.via == "memory"
        outputs = await asyncio.wait_for(generation, 120)
        await pusher.push(old, tokenizer, tmp_path / "step-000002")  # back to the base for other tests
        prompt_ids = [theta_ids for theta_ids, _ in await coordinator.encode(PROMPTS)]
    switched = 0
    for output in outputs:
        assert output.ok, output.error
        assert len(output.generated_tokens) == TOKENS
        ids = prompt_ids[output.index] + output.generated_tokens
        start = len(prompt_ids[output.index])
        with torch.no_grad():
            logits = {name: torch.log_softmax(m(torch.tensor([ids])).logits[0].double(), -1)
                      for name, m in (("old", old), ("new", new))}
        kinds = ""  # per token: o(ld), n(ew), b(oth alike: the two models agree on it), or ? (neither)
        for i, (token, served) in enumerate(zip(output.generated_tokens, output.logprobs_theta)):
            position = start + i - 1
            near = {name: abs(float(lp[position, token]) - served) < 1e-3 for name, lp in logits.items()}
            kinds += "b" if near["old"] and near["new"] else "o" if near["old"] else "n" if near["new"] else "?"
        assert "?" not in kinds, kinds
        first_new = kinds.find("n") if "n" in kinds else len(kinds)
        assert "o" not in kinds[first_new:], (kinds, at_push)  # old weights never again after the push
        assert first_new >= 4, kinds  # the push came after the first tokens
        assert first_new <= at_push[output.index], (kinds, at_push)  # and the tokens after it are new
        switched += first_new < len(kinds)
    assert switched == len(outputs), at_push  # every sequence went on, on the new weights


# Slow (a start and a restart, ~100 s): a chunk the server fails is tests/unit/training/test_weight_transfer.py's.
@pytest.mark.slow
def test_a_server_killed_mid_transfer_fails_the_push_clearly_and_a_restarted_one_takes_the_next(tmp_path,
                                                                                               monkeypatch):
    config = ServerConfig(model=str(tinymodels.BASE_DIR), dev_mode=True, dtype=tinymodels.SERVER_DTYPE,
                          cpu_cores=None, lockstep=False, log_path=tmp_path / "theta.log")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tinymodels.BASE_DIR)
    learner = teacher_model()
    expected = learner_logprobs(learner, probes(tokenizer))
    before = {name: tensor.clone() for name, tensor in learner.state_dict().items()}
    original = VLLMAdmin.update_weights
    chunks = []
    servers = [VLLMServer(config, name="theta")]

    async def kill_on_second_chunk(self, update_info, *, timeout_s):
        chunks.append(update_info)
        if len(chunks) == 2:  # a crash between two chunks: no shutdown, every request to it breaks
            os.killpg(servers[0].pid, signal.SIGKILL)
            await eventually(lambda: not servers[0].running, "the killed server's process is gone")
        return await original(self, update_info, timeout_s=timeout_s)

    made: list[list[str]] = []  # the names of the segments the push makes

    async def killed_mid_transfer():
        async with VLLMClient(servers[0].url, name="theta", request_timeout_s=30) as client:
            with monkeypatch.context() as patch:
                patch.setattr(VLLMAdmin, "update_weights", kill_on_second_chunk)
                made.append(record_segments(patch))
                with pytest.raises(WeightSyncError, match="failed in its update phase"):
                    await weight_transfer.transfer_and_verify(client, learner, probes(tokenizer), expected,
                                                              dtype="float32", top_k=20, tolerance=1e-3,
                                                              chunk_bytes=1)

    async def restarted_takes_the_next_push():
        await servers[-1].start()
        async with VLLMClient(servers[-1].url, name="theta") as client:
            return await weight_transfer.transfer_and_verify(client, learner, probes(tokenizer), expected,
                                                             dtype="float32", top_k=20, tolerance=1e-3)

    try:
        asyncio.run(servers[0].start())
        asyncio.run(killed_mid_transfer())
        assert len(chunks) == 2
        for name, tensor in learner.state_dict().items():  # the learner's weights are untouched
            assert torch.equal(tensor, before[name]), name
        assert not left_behind(made[0])  # no segment left behind
        servers[0].stop()  # reaps it
        servers.append(VLLMServer(config.model_copy(update={"port": servers[0].port,
                                                            "log_path": tmp_path / "theta-restarted.log"}),
                                  name="theta"))
        assert asyncio.run(restarted_takes_the_next_push()).max_abs_diff < 1e-3
    finally:
        for server in servers:
            server.stop()


async def test_a_server_without_a_transfer_engine_is_pushed_through_the_disk(vllm_pair, tmp_path, caplog):
    """The shared pair's teacher is not in dev mode: `auto` falls back (logged), `memory` refuses."""
    _, t = vllm_pair
    async with VLLMClient(t.url, name="t") as client:
        assert await client.admin.weight_transfer_backend() is None
        with pytest.raises(WeightSyncError, match="has no weight-transfer engine"):
            await BasePusher(client, [[1, 2, 3]], via="memory").in_memory()
        with caplog.at_level(logging.INFO, logger="dualvllm.training"):
            assert await BasePusher(client, [[1, 2, 3]]).in_memory() is False
        assert "pushed through the disk" in caplog.text
