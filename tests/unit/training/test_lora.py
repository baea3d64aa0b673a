"""LoRA learners: saved as ordinary merged checkpoints, resumed on their adapter."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from dualvllm import tinymodels  # noqa: E402
from dualvllm.training import checkpoint, lora  # noqa: E402
from dualvllm.training.checkpoint import RunState  # noqa: E402
from dualvllm.training.learner import Learner  # noqa: E402

PROMPT = torch.tensor([[19, 20, 13, 21, 22, 31]])  # "12+34="


def lora_base():
    model = lora.wrap(transformers.AutoModelForCausalLM.from_pretrained(tinymodels.BASE_DIR), rank=4, alpha=8)
    with torch.no_grad():  # peft starts with B = 0 (no change); make the adapter matter
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.2, generator=torch.Generator().manual_seed(0))
    return model


def logits(model):
    with torch.no_grad():
        return model(input_ids=PROMPT).logits


def test_merged_save_is_a_plain_checkpoint_of_the_adapted_model(tmp_path):
    model = lora_base()
    plain = transformers.AutoModelForCausalLM.from_pretrained(tinymodels.BASE_DIR)
    assert not torch.allclose(logits(model), logits(plain), atol=1e-3)  # the adapter changes the model
    before = {n: p.clone() for n, p in model.named_parameters()}
    lora.save_full(model, tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert torch.allclose(logits(merged), logits(model), atol=1e-5)
    # Unmerged again: the learner's own tensors are as they were.
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert not (tmp_path / "merged" / lora.ADAPTER_DIR).exists()


def test_only_the_adapter_trains_and_a_checkpoint_resumes_on_it(tmp_path):
    model = lora_base()
    learner = Learner(model, learning_rate=1e-3, kl_coef=0.0, pad_id=0)
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert trainable and all(id(p) in trainable for group in learner.optimizer.param_groups for p in group["params"])
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tinymodels.BASE_DIR)
    path = checkpoint.save(tmp_path, model, tokenizer, learner.optimizer, RunState(1, 8, 1), keep=2)
    resumed = lora.resume(str(tinymodels.BASE_DIR), path, torch.float32)
    assert torch.allclose(logits(resumed), logits(model), atol=1e-5)
    server_start = transformers.AutoModelForCausalLM.from_pretrained(path)  # what a restarted server loads
    assert torch.allclose(logits(server_start), logits(model), atol=1e-5)
    fresh = Learner(resumed, learning_rate=1e-3, kl_coef=0.0, pad_id=0)
    assert checkpoint.load_state(path, fresh.optimizer) == RunState(1, 8, 1)
