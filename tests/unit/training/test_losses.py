"""GRPO pieces against values worked out by hand."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
from dualvllm.training.losses import (  # noqa: E402
    advantages,
    effective_sample_size_ratio,
    group_advantages,
    importance_weights,
    k3_kl,
    normalize,
    policy_loss,
    sequence_weights,
    weighted_group_advantages,
)


def test_group_advantages_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    # Group 1: mean 0.5, unbiased std sqrt(1/3) -> ±0.5 / 0.57735 = ±0.86603.
    scaled = group_advantages(rewards, eps=0.0)
    assert scaled[0].tolist() == pytest.approx([0.866025, -0.866025, -0.866025, 0.866025], abs=1e-6)
    assert group_advantages(rewards, eps=1e-4)[1].tolist() == [0.0] * 4  # all equal: no signal, no NaN
    assert group_advantages(rewards, scale=False)[0].tolist() == [0.5, -0.5, -0.5, 0.5]


def test_sequence_weights_and_weighted_advantages_by_hand():
    # W = pi/q* per rollout = (2, 1, 1) -> v = (1/2, 1/4, 1/4); rewards (1, 0, 0).
    log_ratio = torch.log(torch.tensor([2.0, 1.0, 1.0])).requires_grad_()
    v = sequence_weights(log_ratio)
    assert v.tolist() == pytest.approx([0.5, 0.25, 0.25]) and not v.requires_grad
    rewards = torch.tensor([1.0, 0.0, 0.0])
    # b = 0.5 (not the plain mean 1/3), centred (0.5, -0.5, -0.5), shares G v = (1.5, 0.75, 0.75).
    plain = weighted_group_advantages(rewards, v, scale=False)
    assert plain.tolist() == pytest.approx([0.75, -0.375, -0.375])
    # Weighted variance 0.25 / (1 - 0.375) = 0.4, std 0.632456.
    scaled = weighted_group_advantages(rewards, v, eps=0.0)
    assert scaled.tolist() == pytest.approx([0.75 / 0.632456, -0.375 / 0.632456, -0.375 / 0.632456], abs=1e-5)
    capped = weighted_group_advantages(rewards, v, scale=False, cap=1.2)  # shares (1.2, 0.75, 0.75)
    assert capped.tolist() == pytest.approx([0.6, -0.375, -0.375])
    assert effective_sample_size_ratio(v).item() == pytest.approx(1 / (3 * 0.375))


def test_uniform_sequence_weights_are_plain_grpo():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0])
    uniform = sequence_weights(torch.zeros(5))
    assert weighted_group_advantages(rewards, uniform).tolist() == pytest.approx(group_advantages(rewards[None])[0].tolist())
    assert effective_sample_size_ratio(uniform).item() == pytest.approx(1.0)


def test_one_dominant_rollout_gives_no_signal_and_no_nan():
    v = sequence_weights(torch.tensor([0.0, -200.0, -200.0]))  # all the weight on rollout 0
    out = weighted_group_advantages(torch.tensor([1.0, 0.0, 0.0]), v)
    assert torch.isfinite(out).all() and out.abs().max() < 1e-6


def test_advantages_over_ragged_groups():
    rewards = [torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.0, 1.0])]
    ratios = [torch.log(torch.tensor([2.0, 1.0, 1.0])), torch.zeros(2)]
    out, metrics = advantages(rewards, ratios, correction="sequence", scale=False, share_cap=1.2)
    assert out.tolist() == pytest.approx([0.6, -0.375, -0.375, -0.5, 0.5])
    assert metrics["clip_fraction"] == pytest.approx(1 / 5) and metrics["sequence_weight_max"] == pytest.approx(1.5)
    assert metrics["ess_ratio"] == pytest.approx((1 / (3 * 0.375) + 1.0) / 2)
    token, token_metrics = advantages(rewards, ratios, correction="token", scale=False)
    assert token.tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, -0.5, 0.5])
    assert token_metrics == {"ess_ratio": metrics["ess_ratio"]}
    none, _ = advantages(rewards, ratios, correction="none", scale=False)  # the ratios are ignored
    assert none.tolist() == token.tolist()
    with pytest.raises(ValueError, match="unknown correction"):
        advantages(rewards, ratios, correction="importance")  # type: ignore[arg-type]


def test_importance_weights_are_truncated_and_detached():
    logp = torch.log(torch.tensor([[0.5, 0.1]])).requires_grad_()
    behaviour = torch.log(torch.tensor([[0.1, 0.2]]))
    weights, ratio = importance_weights(logp, behaviour, cap=2.0)
    assert ratio.tolist()[0] == pytest.approx([5.0, 0.5])
    assert weights.tolist()[0] == pytest.approx([2.0, 0.5])
    assert not weights.requires_grad


def test_k3_kl_by_hand():
    # ref - logp = log(0.5): exp(.) - (.) - 1 = 0.5 + 0.693147 - 1.
    value = k3_kl(torch.tensor([[0.0]]), torch.tensor([[math.log(0.5)]]))
    assert value.item() == pytest.approx(0.5 + math.log(2) - 1)
    assert k3_kl(torch.tensor([[-1.3]]), torch.tensor([[-1.3]])).item() == 0.0


def test_normalizations_by_hand():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert normalize(per_token, mask, "grpo").item() == pytest.approx((2.0 + 4.0) / 2)  # seq means 2 and 4
    assert normalize(per_token, mask, "dapo").item() == pytest.approx(10.0 / 4)
    assert normalize(per_token, mask, "dr_grpo", max_completion_length=5).item() == pytest.approx(10.0 / 10)
    with pytest.raises(ValueError, match="max_completion_length"):
        normalize(per_token, mask, "dr_grpo")
    with pytest.raises(ValueError, match="unknown normalization"):
        normalize(per_token, mask, "ppo")


def test_micro_batches_normalized_by_the_whole_batch_sum_to_it():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    whole = dict(batch_rows=2, batch_tokens=4.0, max_completion_length=5)
    first, second = (per_token[:1], mask[:1]), (per_token[1:], mask[1:])
    # grpo: each row's mean over the 2 rows: 2 / 2 + 4 / 2; dapo: each row's sum over the 4 tokens: 6 / 4 + 4 / 4;
    # dr_grpo: each row's sum over 2 rows x 5 positions: 6 / 10 + 4 / 10
    for how, shares in (("grpo", (1.0, 2.0)), ("dapo", (1.5, 1.0)), ("dr_grpo", (0.6, 0.4))):
        got = [normalize(p, m, how, **whole).item() for p, m in (first, second)]  # type: ignore[arg-type]
        assert got == pytest.approx(shares)
        assert sum(got) == pytest.approx(normalize(per_token, mask, how, max_completion_length=5).item())


def test_policy_loss_value_gradient_and_metrics_by_hand():
    # One sequence, two tokens: pi = (0.5, 0.1), q* = (0.1, 0.2) -> w = (min(5, 2), 0.5) = (2, 0.5).
    logp = torch.log(torch.tensor([[0.5, 0.1]])).requires_grad_()
    behaviour = torch.log(torch.tensor([[0.1, 0.2]]))
    loss, metrics = policy_loss(logp, behaviour, torch.tensor([1.5]), torch.ones(1, 2),
                                correction="token", is_cap=2.0, normalization="dapo")
    expected = -(2.0 * 1.5 * math.log(0.5) + 0.5 * 1.5 * math.log(0.1)) / 2
    assert loss.item() == pytest.approx(expected)
    loss.backward()
    # d loss / d logp_t = -w_t A / n_tokens: the weights carry no gradient of their own.
    assert logp.grad.tolist()[0] == pytest.approx([-2.0 * 1.5 / 2, -0.5 * 1.5 / 2])
    assert metrics == pytest.approx({"ratio_min": 0.5, "ratio_mean": 2.75, "ratio_max": 5.0, "clip_fraction": 0.5,
                                     "weighted_advantage_mean": (2.0 * 1.5 + 0.5 * 1.5) / 2})


def test_kl_penalty_is_added_per_token():
    logp = torch.tensor([[math.log(0.5)]], requires_grad=True)
    loss, metrics = policy_loss(logp, logp.detach(), torch.tensor([0.0]), torch.ones(1, 1),
                                logp_reference=torch.tensor([[math.log(0.25)]]), kl_coef=0.1)
    kl = 0.5 + math.log(2) - 1  # ref - logp = log(1/2)
    assert loss.item() == pytest.approx(0.1 * kl) and metrics["kl_ref"] == pytest.approx(kl)


def test_sequence_correction_weighs_every_token_once():
    # The advantage already carries the sequence weight: loss = -A * mean(logp), ratios only reported.
    logp = torch.log(torch.tensor([[0.5, 0.1]])).requires_grad_()
    behaviour = torch.log(torch.tensor([[0.1, 0.2]]))
    loss, metrics = policy_loss(logp, behaviour, torch.tensor([1.5]), torch.ones(1, 2), correction="sequence")
    assert loss.item() == pytest.approx(-1.5 * (math.log(0.5) + math.log(0.1)) / 2)
    loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([-1.5 / 2, -1.5 / 2])
    assert metrics["ratio_max"] == pytest.approx(5.0) and "clip_fraction" not in metrics


def test_no_correction_weighs_every_token_once_whatever_the_ratio():
    # q*'s right answer is one the base finds unlikely (pi/q* = 0.01): "none" still pushes it up fully.
    logp = torch.log(torch.tensor([[0.001, 0.002]])).requires_grad_()
    behaviour = torch.log(torch.tensor([[0.1, 0.2]]))
    loss, metrics = policy_loss(logp, behaviour, torch.tensor([1.5]), torch.ones(1, 2), correction="none")
    loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([-1.5 / 2, -1.5 / 2])
    assert metrics["ratio_max"] == pytest.approx(0.01) and "clip_fraction" not in metrics
