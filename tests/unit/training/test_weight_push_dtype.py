"""Pushes are written in the server's dtype and verified like with like (dualvllm.training.weight_sync).

A server that computes in bfloat16 serves the checkpoint's weights rounded to bfloat16; the
learner keeps float32 master weights. The expected logprobs are therefore those of the
checkpoint as written, at that dtype, and not the learner's own.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from dualvllm.engines.vllm_client import VLLMClient
from tests.fake_vllm import FakeModel, FakeVLLM
from dualvllm.training.weight_sync import PUSH_TOLERANCE, learner_logprobs, write_push

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROBES = [[1, 2, 3, 4], [5, 6], [7]]


def small_model(tied: bool):
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                      max_position_embeddings=64, tie_word_embeddings=tied)
    model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():  # peaked distributions, as a trained model's, so rounding shows in the logprobs
        model.lm_head.weight.mul_(50.0)
    return model


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_bfloat16_push_is_written_in_bfloat16_and_expected_at_bfloat16(tmp_path, tied):
    model = small_model(tied)
    expected = write_push(model, None, tmp_path / "push", PROBES, dtype="bfloat16")
    config = json.loads((tmp_path / "push" / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["tie_word_embeddings"] is tied
    saved = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "push", dtype=torch.bfloat16)
    for name, tensor in saved.state_dict().items():  # the learner's weights, rounded to bfloat16
        assert torch.equal(tensor, model.state_dict()[name].to(torch.bfloat16)), name
    if tied:
        assert saved.lm_head.weight.data_ptr() == saved.model.embed_tokens.weight.data_ptr()
    assert np.array_equal(expected, learner_logprobs(saved, PROBES))
    # The float32 learner itself is further from its bfloat16 copy than float32 kernels ever are:
    # comparing the server with it would fail a correct push.
    rounding = np.abs(learner_logprobs(model, PROBES) - expected).max()
    assert rounding > PUSH_TOLERANCE["float32"]
    assert model.lm_head.weight.dtype == torch.float32  # the master weights are untouched


def test_a_float32_push_expects_the_learners_own_logprobs(tmp_path):
    model = small_model(tied=False)
    expected = write_push(model, None, tmp_path / "push", PROBES, dtype="float32")
    assert np.array_equal(expected, learner_logprobs(model, PROBES))
    assert json.loads((tmp_path / "push" / "config.json").read_text())["dtype"] == "float32"


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", None], ids=["bfloat16", "float32", "no-route"])
async def test_the_served_dtype_is_read_from_server_info(dtype):
    fake = FakeVLLM(FakeModel(seed=1), dtype=dtype)
    await fake.start()
    try:
        async with VLLMClient(fake.url, name="theta") as client:
            assert await client.admin.served_dtype() == dtype
    finally:
        await fake.close()
