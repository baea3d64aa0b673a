"""The learner's packing, log-probabilities, update direction, and checkpoints."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dualvllm import tinymodels  # noqa: E402
from dualvllm.training import checkpoint  # noqa: E402
from dualvllm.training.checkpoint import RunState  # noqa: E402
from dualvllm.training.learner import Learner, Objective, Packed, completion_logprobs, pack  # noqa: E402
from dualvllm.training.rollouts import Rollout, ScoredBatch  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(tinymodels.BASE_DIR)


def rollout(tokenizer, prompt: str, completion: str, reward: float, logq: float = -1.0, **kw) -> Rollout:
    ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [1]  # + EOS
    return Rollout(prompt_ids=tuple(tokenizer(prompt, add_special_tokens=False)["input_ids"]),
                   completion_ids=tuple(ids), logprobs_q=(logq,) * len(ids), alphas=(0.3,) * len(ids),
                   text=completion, reward=reward, **kw)


def full_completion_logits(model, packed: Packed) -> torch.Tensor:
    """The plain forward's logits at every completion state, predicting y_t -> [B, T, V] (the learner never
    builds them)."""
    logits = model(input_ids=packed.input_ids, attention_mask=packed.attention_mask).logits  # [B, L, V]
    positions = packed.starts[:, None] - 1 + torch.arange(packed.targets.shape[1])[None, :]  # [B, T]
    positions = positions.clamp(max=logits.shape[1] - 1)
    return logits[torch.arange(logits.shape[0])[:, None], positions]  # [B, T, V]


def one_update(tokenizer, rollouts, objective: Objective) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(summed log p of each rollout before, after, metrics) of one small update on one group."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tinymodels.BASE_DIR)
    batch = ScoredBatch(groups=(tuple(rollouts),), policy_version=0, data_position=1, sample_seconds=1.0, tokens=6)
    learner = Learner(model, learning_rate=1e-5, kl_coef=0.0, pad_id=0)
    before = completion_logprobs(model, pack(rollouts, 0)).sum(-1).detach()
    metrics = learner.train_step(batch, objective)
    after = completion_logprobs(model, pack(rollouts, 0)).sum(-1).detach()
    return before, after, metrics


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


@pytest.mark.parametrize("correction", ["sequence", "token", "vespo", "none"])
def test_an_update_makes_the_rewarded_completion_more_likely(tokenizer, correction):
    model = transformers.AutoModelForCausalLM.from_pretrained(tinymodels.BASE_DIR)
    good, bad = rollout(tokenizer, "12+34=", "64", 1.0), rollout(tokenizer, "12+34=", "65", 0.0)
    batch = ScoredBatch(groups=((good, bad),), policy_version=0, data_position=1, sample_seconds=1.0, tokens=6)
    # A small step, where the update follows the gradient's first-order promise.
    learner = Learner(model, learning_rate=1e-5, kl_coef=0.0, pad_id=0)
    before = completion_logprobs(model, pack([good, bad], 0)).sum(-1).detach()
    metrics = learner.train_step(batch, Objective(correction=correction, max_completion_length=6))
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


def test_sft_makes_every_sample_more_likely_and_rft_only_the_verified_ones(tokenizer):
    right, wrong = rollout(tokenizer, "12+34=", "64", 1.0), rollout(tokenizer, "12+34=", "65", 0.0)
    before, after, metrics = one_update(tokenizer, [right, wrong], Objective(method="sft"))
    assert (after > before).all() and metrics["sft_rollouts"] == 1.0
    before, after, metrics = one_update(tokenizer, [right, wrong], Objective(method="rft"))
    assert after[0] > before[0] and metrics["sft_rollouts"] == 0.5
    # the wrong answer is not trained on: it moves only as much as sharing "6" with the right one moves it
    assert after[1] - before[1] < after[0] - before[0]


def test_on_policy_distillation_follows_the_teachers_per_token_log_ratio(tokenizer):
    # Same reward for both: no reward advantage. The teacher likes "64" far more than the learner
    # does (log pi_t = 0 per token) and "65" far less (-20 per token).
    liked = rollout(tokenizer, "12+34=", "64", 0.0, logprobs_t=(0.0, 0.0, 0.0))
    disliked = rollout(tokenizer, "12+34=", "65", 0.0, logprobs_t=(-20.0, -20.0, -20.0))
    for r in (liked, disliked):
        assert len(r.completion_ids) == 3
    model = transformers.AutoModelForCausalLM.from_pretrained(tinymodels.BASE_DIR)
    on_policy = completion_logprobs(model, pack([liked, disliked], 0)).detach()  # sampled by the base itself
    liked = rollout(tokenizer, "12+34=", "64", 0.0, logprobs_t=(0.0,) * 3)
    liked = type(liked)(**{**liked.__dict__, "logprobs_q": tuple(on_policy[0].tolist())})
    disliked = type(disliked)(**{**disliked.__dict__, "logprobs_q": tuple(on_policy[1].tolist())})
    before, after, metrics = one_update(tokenizer, [liked, disliked], Objective(method="opd", teacher_advantage_coef=1.0))
    assert after[0] > before[0] and after[1] < before[1]
    assert metrics["teacher_log_ratio"] > 0  # the learner gives its tokens more than the teacher, on average


def test_the_distillation_term_moves_the_learner_toward_the_teachers_top_k(tokenizer):
    import numpy as np

    r = rollout(tokenizer, "12+34=", "65", 0.0)
    target = tokenizer("4", add_special_tokens=False)["input_ids"][0]  # the teacher's answer at the second state
    model = transformers.AutoModelForCausalLM.from_pretrained(tinymodels.BASE_DIR)
    with torch.no_grad():
        logits = full_completion_logits(model, pack([r], 0))[0]  # [T, V]
    ids = np.argsort(-logits.numpy(), axis=-1)[:, :2].astype(np.int64)  # the learner's own top 2 ...
    logprobs = np.log(np.full((3, 2), 0.01))
    ids[1, 0], logprobs[1, 0] = target, np.log(0.98)  # ... except the second state, where the teacher says "4"
    r = type(r)(**{**r.__dict__, "teacher_topk": (ids, logprobs)})
    learner = Learner(model, learning_rate=1e-4, kl_coef=0.0, pad_id=0)
    batch = ScoredBatch(groups=((r, r),), policy_version=0, data_position=1, sample_seconds=1.0, tokens=6)
    before = torch.log_softmax(logits[1], -1)[target].item()
    # equal rewards: no reward advantage, the distillation term alone moves the learner
    metrics = learner.train_step(batch, Objective(correction="none", distill_coef=1.0))
    with torch.no_grad():
        after = torch.log_softmax(full_completion_logits(model, pack([r], 0))[0, 1], -1)[target].item()
    assert after > before and metrics["distill_divergence"] > 0


def test_weight_decay_is_trls_zero_unless_set_and_then_decays_weights_without_signal(tokenizer):
    """A batch whose advantages are all zero moves no weight, unless AdamW's decay is on."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tinymodels.BASE_DIR)
    assert Learner(model, learning_rate=1e-3, kl_coef=0.0, pad_id=0).optimizer.param_groups[0]["weight_decay"] == 0.0
    flat = [rollout(tokenizer, "12+34=", answer, 1.0) for answer in ("64", "46", "47")]  # one reward: advantages 0
    batch = ScoredBatch(groups=(tuple(flat),), policy_version=0, data_position=1, sample_seconds=1.0, tokens=6)
    moved = {}
    for decay in (0.0, 0.1):
        model = transformers.AutoModelForCausalLM.from_pretrained(tinymodels.BASE_DIR)
        start = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
        Learner(model, learning_rate=1e-3, kl_coef=0.0, pad_id=0, weight_decay=decay).train_step(
            batch, Objective(method="grpo"))
        moved[decay] = float((torch.nn.utils.parameters_to_vector(model.parameters()) - start).abs().max())
    assert moved[0.0] == 0.0 and moved[0.1] > 0.0


def test_the_adaptive_loss_is_grpo_on_the_on_policy_rows_plus_distillation_on_the_guided_ones(tokenizer):
    """One batch of two groups: a never-solved prompt (6 guided rollouts, 2 on-policy probes) and a
    sometimes-solved one (all on-policy). Its loss and gradient are those of GRPO on the on-policy
    rollouts alone plus the distillation term on the guided rollouts alone, micro-batched or not."""
    import numpy as np

    rng = np.random.default_rng(0)

    def with_topk(r, on_policy):
        n = len(r.completion_ids)
        ids = rng.integers(2, 90, size=(n, 3)).astype(np.int64)
        logprobs = np.log(np.full((n, 3), 0.3))
        return type(r)(**{**r.__dict__, "teacher_topk": (ids, logprobs), "on_policy": on_policy})

    never = tuple(with_topk(rollout(tokenizer, "123+456=", "975", 1.0, logq=-0.2), False) for _ in range(6)) + tuple(
        with_topk(rollout(tokenizer, "123+456=", d, 0.0, logq=-2.0), True) for d in ("9", "91"))
    sometimes = tuple(with_topk(rollout(tokenizer, "12+34=", c, r, logq=-1.5), True)
                      for c, r in (("64", 1.0), ("65", 0.0), ("6", 0.0), ("64", 1.0)))

    def gradient(groups, objective, micro_batch_size=None):
        model = transformers.AutoModelForCausalLM.from_pretrained(tinymodels.BASE_DIR)
        learner = Learner(model, learning_rate=1e-5, kl_coef=0.0, pad_id=0, micro_batch_size=micro_batch_size)
        batch = ScoredBatch(groups=groups, policy_version=0, data_position=1, sample_seconds=1.0, tokens=6)
        metrics = learner.accumulate_gradients(batch, objective)
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]), metrics["loss"]

    adaptive = Objective(method="adaptive", correction="sequence", distill_coef=0.5)
    whole, loss = gradient((never, sometimes), adaptive)
    micro, micro_loss = gradient((never, sometimes), adaptive, micro_batch_size=3)
    rewarded, reward_loss = gradient((never[6:], sometimes), Objective(method="grpo", correction="sequence"))
    distilled, distill_loss = gradient((never[:6],), Objective(method="distill", distill_coef=0.5))
    assert loss == pytest.approx(reward_loss + distill_loss, rel=1e-5, abs=1e-7)
    assert micro_loss == pytest.approx(loss, rel=1e-5, abs=1e-7)
    torch.testing.assert_close(whole, rewarded + distilled, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(micro, whole, rtol=1e-4, atol=1e-6)
