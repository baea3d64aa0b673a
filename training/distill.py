"""Objectives that use the teacher's signal directly, beside GRPO's reward advantages.

Pure functions of tensors; shapes on every line. Each is one term of the learner's loss
(training/learner.py), selected and weighted in TrainConfig.

- Dense distillation on the visited states (GKD, Agarwal et al. 2024, arXiv 2306.13649;
  TRL's GKD/Distillation trainers): at every state the rollout visited, the generalized
  Jensen-Shannon divergence between the teacher's and the learner's next-token
  distributions. beta = 0 is forward KL(teacher || learner), beta = 1 reverse
  KL(learner || teacher), between them JSD_beta = beta KL(t || m) + (1 - beta) KL(s || m)
  with m = beta t + (1 - beta) s (TRL's `generalized_jsd_loss`). Only the teacher's top-k is
  recorded, so both distributions are coarsened to K + 1 buckets: the teacher's top-k ids
  and one tail bucket holding the rest of each model's mass (TRL's ServerDistillation
  `loss_add_tail`). The divergence is per state, so a state visited under q* rather than
  the learner needs no sequence importance weight: the prefix distribution only decides
  which states are trained.
- On-policy distillation (Thinking Machines, "On-Policy Distillation", 2025;
  tinker-cookbook `distillation/train_on_policy.py`): a per-token advantage
  -c (log pi_theta(y_t) - log pi_t(y_t)) on the sampled token, the negative per-token
  reverse KL, detached. Under q* the learner's gradient at y_t is importance weighted by
  min(pi_theta / q*, cap) (dualvllm.training.losses.policy_loss applies it).
- (LUFFY's guided-token shaping f(p) = p / (p + gamma) is a form of the policy-gradient
  term, so it lives in dualvllm.training.losses: `guided_shaping`.)
- Supervised fine-tuning: the mean negative log-likelihood of chosen rollouts (SFT on
  teacher samples, rejection fine-tuning on verified ones).
"""

from __future__ import annotations

import math

import torch

from dualvllm.training.losses import normalize

# log(1 - sum of top-k probabilities) must stay finite when the top-k holds (almost) all the mass.
TAIL_MAX_LOG_SUM = -1e-7


def with_tail(logprobs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """K top-k log-probabilities -> K + 1 with a tail bucket log(1 - sum_k p_k); [..., K] -> [..., K + 1].

    Invalid entries (padding) become -inf and leave their mass in the tail.
    """
    logprobs = torch.where(valid, logprobs, torch.full_like(logprobs, -math.inf))
    log_sum = torch.logsumexp(logprobs, dim=-1, keepdim=True).clamp(max=TAIL_MAX_LOG_SUM)  # [..., 1]
    tail = torch.log(-torch.expm1(log_sum))  # log(1 - exp(log_sum)), [..., 1]
    return torch.cat([logprobs, tail], dim=-1)


def _kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """sum_i p_i (log p_i - log q_i) over the last axis, 0 where p_i = 0 (padding): [..., M] -> [...].

    The padded entries are made finite before any arithmetic: torch.where passes a zero
    gradient to its unchosen branch, but 0 · nan (from -inf - -inf) is still nan.
    """
    present = torch.isfinite(p_log)  # [..., M]
    p_safe = torch.where(present, p_log, torch.zeros_like(p_log))
    q_safe = torch.where(present, q_log, torch.zeros_like(q_log))
    terms = torch.where(present, p_safe.exp() * (p_safe - q_safe), torch.zeros_like(p_safe))
    return terms.sum(-1)


def generalized_jsd(student_log: torch.Tensor, teacher_log: torch.Tensor, beta: float) -> torch.Tensor:
    """JSD_beta between two distributions given as log-probabilities over the same buckets;
    [..., M] -> [...]. beta = 0: KL(teacher || student); beta = 1: KL(student || teacher)."""
    if beta == 0.0:
        return _kl(teacher_log, student_log)
    if beta == 1.0:
        return _kl(student_log, teacher_log)
    mixture = torch.logsumexp(torch.stack([student_log + math.log1p(-beta), teacher_log + math.log(beta)]), dim=0)
    return beta * _kl(teacher_log, mixture) + (1.0 - beta) * _kl(student_log, mixture)


def topk_divergence(
    student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, *, beta: float = 0.0
) -> torch.Tensor:
    """Per-state JSD_beta over the teacher's top-k plus a tail bucket; [..., K], [..., K] -> [...].

    `student_logprobs`: the learner's log pi_theta at the teacher's top-k ids (with grad);
    `teacher_logprobs`: the teacher's recorded top-k (raw logprobs, -inf in padding). The
    learner's tail is 1 - its mass on those ids, so nothing else of its distribution is
    needed: dualvllm.training.logprobs computes these K values chunk by chunk, without [B, T, V].
    """
    valid = torch.isfinite(teacher_logprobs)  # [..., K]
    student_log = with_tail(student_logprobs, valid)  # [..., K + 1]
    teacher_log = with_tail(teacher_logprobs.to(student_log.dtype), valid)  # [..., K + 1]
    return generalized_jsd(student_log, teacher_log, beta)


def topk_distillation(
    student_logits: torch.Tensor, teacher_ids: torch.Tensor, teacher_logprobs: torch.Tensor, *, beta: float = 0.0
) -> torch.Tensor:
    """`topk_divergence` from whole logits: [B, T, V] (with grad), int64 [B, T, K], [B, T, K] -> [B, T].

    For callers that hold the logits anyway (dualvllm.training.trl_trainer, small tests); the learner
    never builds them. log pi(v) = z_v - logsumexp(z): no second [B, T, V] tensor.
    """
    logits = student_logits.float()  # [B, T, V]
    top = logits.gather(-1, teacher_ids.clamp(min=0)) - torch.logsumexp(logits, dim=-1, keepdim=True)  # [B, T, K]
    return topk_divergence(top, teacher_logprobs, beta=beta)


def teacher_advantages(logp_policy: torch.Tensor, logp_teacher: torch.Tensor, coef: float) -> torch.Tensor:
    """On-policy distillation's per-token advantage -coef (log pi_theta(y_t) - log pi_t(y_t)),
    detached; [B, T] -> [B, T]. Positive where the teacher likes the token more than the learner."""
    return -coef * (logp_policy.detach() - logp_teacher)


def sft_loss(
    logp_policy: torch.Tensor, mask: torch.Tensor, chosen: torch.Tensor, *, batch_tokens: float | None = None
) -> torch.Tensor:
    """Negative log-likelihood per token of the chosen rollouts: [B, T], [B, T], bool [B] -> scalar.

    Averaged over the chosen rollouts' tokens only (unchosen ones would dilute it). No
    chosen rollout gives 0, still with a graph, so the caller may backpropagate.
    `batch_tokens`: the chosen tokens of the whole batch when these rows are one micro-batch
    of it (dualvllm.training.losses.normalize).
    """
    rows = mask * chosen[:, None].to(mask.dtype)  # [B, T]
    return normalize(-logp_policy, rows, "dapo", batch_tokens=batch_tokens)
