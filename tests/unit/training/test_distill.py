"""The teacher-signal objectives (training/distill.py), VESPO's weights and LUFFY's shaping
(training/losses.py), against values worked out by hand (and TRL's own VESPO function)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
from dualvllm.training.distill import (  # noqa: E402
    generalized_jsd, sft_loss, teacher_advantages, topk_distillation, topk_divergence, with_tail)
from dualvllm.training.losses import gamma_weights, guided_shaping, policy_loss  # noqa: E402

log = math.log
PAD = -1


def logs(*probabilities: float) -> torch.Tensor:
    return torch.log(torch.tensor(probabilities, dtype=torch.float64))


def test_the_tail_bucket_holds_the_mass_outside_the_top_k_and_padding():
    full = with_tail(logs(0.5, 0.3), torch.tensor([True, True]))
    assert full.exp().tolist() == pytest.approx([0.5, 0.3, 0.2])
    padded = with_tail(torch.tensor([log(0.5), -math.inf], dtype=torch.float64), torch.tensor([True, False]))
    assert padded.exp().tolist() == pytest.approx([0.5, 0.0, 0.5])


def test_generalized_jsd_by_hand():
    teacher, student = logs(0.5, 0.3, 0.2), logs(0.25, 0.25, 0.5)
    forward = 0.5 * log(0.5 / 0.25) + 0.3 * log(0.3 / 0.25) + 0.2 * log(0.2 / 0.5)  # KL(t || s) = 0.218008
    reverse = 0.25 * log(0.25 / 0.5) + 0.25 * log(0.25 / 0.3) + 0.5 * log(0.5 / 0.2)  # KL(s || t) = 0.239278
    assert generalized_jsd(student, teacher, 0.0).item() == pytest.approx(forward)
    assert generalized_jsd(student, teacher, 1.0).item() == pytest.approx(reverse)
    m = (0.375, 0.275, 0.35)  # (t + s) / 2
    kl_t = 0.5 * log(0.5 / m[0]) + 0.3 * log(0.3 / m[1]) + 0.2 * log(0.2 / m[2])
    kl_s = 0.25 * log(0.25 / m[0]) + 0.25 * log(0.25 / m[1]) + 0.5 * log(0.5 / m[2])
    assert generalized_jsd(student, teacher, 0.5).item() == pytest.approx(0.5 * kl_t + 0.5 * kl_s)  # 0.055583
    assert generalized_jsd(teacher, teacher, 0.3).item() == pytest.approx(0.0, abs=1e-12)


def test_topk_distillation_compares_the_teachers_top_k_and_a_tail_by_hand():
    # The learner: (0.4, 0.3, 0.2, 0.1) over 4 ids. The teacher's top 2: id 2 at 0.6, id 0 at 0.3.
    student_logits = logs(0.4, 0.3, 0.2, 0.1).float().reshape(1, 1, 4).requires_grad_()
    ids = torch.tensor([[[2, 0]]])
    teacher = logs(0.6, 0.3).float().reshape(1, 1, 2)
    # buckets (id 2, id 0, tail): teacher (0.6, 0.3, 0.1), learner (0.2, 0.4, 0.4)
    want = 0.6 * log(0.6 / 0.2) + 0.3 * log(0.3 / 0.4) + 0.1 * log(0.1 / 0.4)  # 0.434233
    kl = topk_distillation(student_logits, ids, teacher)
    assert kl.shape == (1, 1) and kl.item() == pytest.approx(want, rel=1e-5)
    # The learner's log-probabilities at the teacher's ids are all the divergence needs (dualvllm.training.logprobs).
    assert topk_divergence(logs(0.2, 0.4).reshape(1, 1, 2), teacher.double()).item() == pytest.approx(want)
    kl.sum().backward()
    # d KL / d logit_j = s_j - (target mass given to j's bucket share): for id 3 (in the tail) it
    # is s_3 - 0.1 · s_3 / 0.4 = 0.1 - 0.025
    assert student_logits.grad[0, 0, 3].item() == pytest.approx(0.075, rel=1e-4)

    # A padded top-k entry leaves its mass in the tail, and the gradient stays finite.
    padded_logits = logs(0.4, 0.3, 0.2, 0.1).float().reshape(1, 1, 4).requires_grad_()
    padded = topk_distillation(padded_logits, torch.tensor([[[2, PAD]]]),
                               torch.tensor([[[log(0.6), -math.inf]]], dtype=torch.float32))
    assert padded.item() == pytest.approx(0.6 * log(0.6 / 0.2) + 0.4 * log(0.4 / 0.8), rel=1e-5)  # 0.381908
    padded.sum().backward()
    assert torch.isfinite(padded_logits.grad).all()


def test_a_step_on_the_distillation_term_moves_the_learner_toward_the_teacher():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 8, requires_grad=True)
    teacher_full = torch.log_softmax(torch.randn(2, 3, 8), -1)
    top = teacher_full.topk(4, dim=-1)
    before = topk_distillation(logits, top.indices, top.values).sum()
    before.backward()
    with torch.no_grad():
        after = topk_distillation(logits - 0.5 * logits.grad, top.indices, top.values).sum()
    assert after < before


def test_teacher_advantages_by_hand():
    adv = teacher_advantages(logs(0.5, 0.1).requires_grad_(), logs(0.25, 0.4), coef=2.0)
    assert adv.tolist() == pytest.approx([-2 * log(2.0), 2 * log(4.0)])  # -1.386294, 2.772589
    assert not adv.requires_grad


def test_sft_loss_averages_the_chosen_rollouts_tokens_only():
    logp = torch.tensor([[log(0.5), log(0.25)], [log(0.1), 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    assert sft_loss(logp, mask, torch.tensor([True, False])).item() == pytest.approx((log(2) + log(4)) / 2)
    none = sft_loss(logp, mask, torch.tensor([False, False]))
    assert none.item() == 0.0
    none.backward()  # still a graph


def test_guided_shaping_and_its_gradient_by_hand():
    logp = torch.tensor([log(0.1)], requires_grad=True)
    shaped = guided_shaping(logp, gamma=0.1)
    assert shaped.item() == pytest.approx(0.5)
    shaped.backward()
    assert logp.grad.item() == pytest.approx(0.1 * 0.1 / 0.2**2)  # gamma p / (p + gamma)^2 = 0.25


def test_gamma_weights_by_hand():
    mask = torch.ones(3, 2)
    # W = 1, 2 (A >= 0: k = 2, lambda = 3), 1/2 (A < 0: k = 3, lambda = 2); two tokens each
    log_ratio = torch.tensor([[0.2, -0.2], [log(2.0), 0.0], [0.0, -log(2.0)]])
    phi = gamma_weights(torch.tensor([1.0, 0.5, -1.0]), log_ratio, mask)
    assert phi.tolist() == pytest.approx([1.0, 4 * math.exp(-3.0), 0.125 * math.exp(1.0)])  # 1, 0.199148, 0.339785


def test_gamma_weights_equal_trls_vespo_weights_on_random_inputs():
    from trl import GRPOTrainer

    generator = torch.Generator().manual_seed(3)
    for _ in range(5):
        advantages = torch.randn(16, generator=generator)
        log_ratio = 0.3 * torch.randn(16, 7, generator=generator)
        mask = (torch.rand(16, 7, generator=generator) > 0.2).float()
        ours = gamma_weights(advantages, log_ratio, mask)
        theirs = GRPOTrainer.get_gamma_weights(advantages[:, None], log_ratio, mask, None)  # [B, 1]
        torch.testing.assert_close(ours, theirs[:, 0], rtol=1e-6, atol=1e-7)


def test_policy_loss_with_vespo_and_per_token_advantages_by_hand():
    logp = torch.tensor([[log(0.5), log(0.5)]], requires_grad=True)
    behaviour = torch.tensor([[log(0.25), log(0.5)]])  # W = 2, per-token ratios (2, 1)
    mask = torch.ones(1, 2)
    loss, metrics = policy_loss(logp, behaviour, torch.tensor([1.0]), mask, correction="vespo")
    phi = 4 * math.exp(-3.0)
    assert loss.item() == pytest.approx(-phi * 1.0 * log(0.5))  # dapo: mean over the 2 tokens
    assert metrics["vespo_phi_mean"] == pytest.approx(phi)
    # A per-token advantage adds min(pi/q*, is_cap) · A_t at each token: caps (2, 1) at is_cap = 2.
    loss, _ = policy_loss(logp, behaviour, torch.tensor([0.0]), mask, correction="none",
                          token_advantages=torch.tensor([[1.0, -3.0]]))
    assert loss.item() == pytest.approx(-(2.0 * 1.0 * log(0.5) + 1.0 * -3.0 * log(0.5)) / 2)
    # LUFFY: a shaped rollout's tokens use -A f(p) = -A · 0.5 / 0.6 instead of -A log p.
    loss, _ = policy_loss(logp, behaviour, torch.tensor([1.0]), mask, correction="none",
                          shaped=torch.tensor([True]))
    assert loss.item() == pytest.approx(-0.5 / 0.6)
