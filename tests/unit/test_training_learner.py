"""The learner's packing, log-probabilities, update direction, and checkpoints."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import tinymodels  # noqa: E402
from training import checkpoint  # noqa: E402
from training.checkpoint import RunState  # noqa: E402
from training.learner import Learner, completion_logprobs, pack  # noqa: E402
from training.rollouts import Rollout, ScoredBatch  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(tinymodels.BASE_DIR)


def rollout(tokenizer, prompt: str, completion: str, reward: float, logq: float = -1.0) -> Rollout:
    ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [1]  # + EOS
    return Rollout(prompt_ids=tuple(tokenizer(prompt, add_special_tokens=False)["input_ids"]),
                   completion_ids=tuple(ids), logprobs_q=(logq,) * len(ids), alphas=(0.3,) * len(ids),
                   text=completion, reward=reward)


def test_completion_logprobs_match_a_plain_forward_pass(tokenizer):
    model = transformers.AutoModelForCausalLM.from_pretrained(tinymodels.BASE_DIR).eval()
    rollouts = [rollout(tokenizer, "12+34=", "64", 1.0), rollout(tokenizer, "5+6=", "11", 0.0),
                rollout(tokenizer, "99+99=", "891", 1.0)]
    packed = pack(rollouts, pad_id=0)
    with torch.no_grad():
        got = completion_logprobs(model, packed)
        for row, r in enumerate(rollouts):
            sequence = torch.tensor([list(r.prompt_ids) + list(r.completion_ids)])
            logp = torch.log_softmax(model(sequence).logits[0].float(), -1)
            for t, token in enumerate(r.completion_ids):
                assert got[row, t].item() == pytest.approx(logp[len(r.prompt_ids) + t - 1, token].item(), abs=1e-4)
            assert packed.target_mask[row].sum() == len(r.completion_ids)
    assert got[1, 3:].abs().sum() == 0  # padding contributes nothing


@pytest.mark.parametrize("correction", ["sequence", "token", "none"])
def test_an_update_makes_the_rewarded_completion_more_likely(tokenizer, correction):
    model = transformers.AutoModelForCausalLM.from_pretrained(tinymodels.BASE_DIR)
    good, bad = rollout(tokenizer, "12+34=", "64", 1.0), rollout(tokenizer, "12+34=", "65", 0.0)
    batch = ScoredBatch(groups=((good, bad),), policy_version=0, data_position=1, sample_seconds=1.0, tokens=6)
    # A small step, where the update follows the gradient's first-order promise.
    learner = Learner(model, learning_rate=1e-5, kl_coef=0.0, pad_id=0)
    before = completion_logprobs(model, pack([good, bad], 0)).sum(-1).detach()
    metrics = learner.train_step(batch, correction=correction, scale_advantages=True, is_cap=2.0, share_cap=3.0,
                                 normalization="dapo",
                                 max_completion_length=6)
    after = completion_logprobs(model, pack([good, bad], 0)).sum(-1).detach()
    assert after[0] > before[0] and after[1] < before[1]
    assert metrics["reward_mean"] == 0.5 and metrics["accuracy"] == 0.5


def test_checkpoints_round_trip_and_keep_the_newest(tmp_path, tokenizer):
    model = transformers.AutoModelForCausalLM.from_pretrained(tinymodels.BASE_DIR)
    learner = Learner(model, learning_rate=1e-3, kl_coef=0.0, pad_id=0)
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, model, tokenizer, learner.optimizer, RunState(step, 8 * step, step), keep=2)
    assert [p.name for p in checkpoint.all_checkpoints(tmp_path)] == ["step-000002", "step-000003"]
    (tmp_path / "checkpoints" / "step-000004.partial").mkdir()  # a save killed midway is ignored
    newest = checkpoint.latest(tmp_path)
    assert newest is not None and newest.name == "step-000003"
    fresh = Learner(transformers.AutoModelForCausalLM.from_pretrained(newest), learning_rate=1e-3,
                    kl_coef=0.0, pad_id=0)
    assert checkpoint.load_state(newest, fresh.optimizer) == RunState(3, 24, 3)
    for mine, saved in zip(model.parameters(), fresh.model.parameters()):
        assert torch.equal(mine, saved)
