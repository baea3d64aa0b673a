"""GRPO on rollouts sampled from q*: advantages, importance weights, the loss.

Pure functions of tensors; shapes on every line. The rollouts come from the behaviour
policy q* (the coordinator records log q*(y_t) per token), not from pi_theta, so the
policy gradient is importance-weighted per token:

    grad J = E_{y ~ q*} [ sum_t w_t · A · grad log pi_theta(y_t | y_<t) ],   w_t = pi_theta(y_t) / q*(y_t)

with w truncated at `is_cap` (truncated importance sampling, as in IMPALA's V-trace,
Espeholt et al. 2018): a few tokens that q* drew where pi_theta is far more likely
cannot dominate the batch. w is a detached weight, so the surrogate loss per token is
-min(w, cap) · A · log pi_theta.

Advantages are group-relative (GRPO, Shao et al. 2024): a prompt's G rollouts are
compared with each other. Loss normalizations follow TRL's names:
- "grpo": mean over each sequence's tokens, then over sequences;
- "dr_grpo": sum over all tokens / (sequences x max_completion_length) (Liu et al. 2025),
  no length bias;
- "dapo": sum over all tokens / all tokens in the batch (Yu et al. 2025).
An optional KL penalty to a frozen reference uses the k3 estimator
exp(ref - logp) - (ref - logp) - 1 >= 0 (Schulman 2020), per token, normalized the same way.
"""

from __future__ import annotations

from typing import Literal

import torch

Normalization = Literal["grpo", "dr_grpo", "dapo"]


def group_advantages(rewards: torch.Tensor, *, scale: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """(r - mean of its group) [/ (std of its group + eps)]; rewards [N, G] -> [N, G].

    `scale=False` is Dr. GRPO's choice: dividing by the std up-weights groups that are
    almost all right or all wrong. std is the unbiased sample std, as in TRL.
    """
    centered = rewards - rewards.mean(dim=-1, keepdim=True)  # [N, G]
    if not scale:
        return centered
    return centered / (rewards.std(dim=-1, keepdim=True) + eps)


def importance_weights(logp_policy: torch.Tensor, logp_behaviour: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(min(pi/q, cap) detached, raw ratio pi/q detached), both [B, T]."""
    ratio = torch.exp((logp_policy - logp_behaviour).detach())  # [B, T]
    return ratio.clamp(max=cap), ratio


def k3_kl(logp_policy: torch.Tensor, logp_reference: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate exp(ref - logp) - (ref - logp) - 1 >= 0, [B, T]."""
    delta = logp_reference - logp_policy
    return torch.exp(delta) - delta - 1.0


def normalize(per_token: torch.Tensor, mask: torch.Tensor, how: Normalization,
              max_completion_length: int | None = None) -> torch.Tensor:
    """Reduce a [B, T] per-token loss over the real tokens (mask) to a scalar."""
    mask = mask.to(per_token.dtype)
    if how == "grpo":
        per_sequence = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)  # [B]
        return per_sequence.mean()
    if how == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("dr_grpo normalizes by max_completion_length; pass it")
        return (per_token * mask).sum() / (per_token.shape[0] * max_completion_length)
    if how == "dapo":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    raise ValueError(f"unknown normalization {how!r}; use grpo, dr_grpo or dapo")


def policy_loss(
    logp_policy: torch.Tensor,  # [B, T] log pi_theta(y_t), with grad
    logp_behaviour: torch.Tensor,  # [B, T] log q*(y_t) recorded at sampling time
    advantages: torch.Tensor,  # [B] one per sequence
    mask: torch.Tensor,  # [B, T] 1 on completion tokens
    *,
    is_cap: float = 2.0,
    normalization: Normalization = "dapo",
    max_completion_length: int | None = None,
    logp_reference: torch.Tensor | None = None,  # [B, T] frozen reference, for the KL penalty
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The truncated-IS policy-gradient loss and its metrics (ratio stats, clip fraction, KL)."""
    weights, ratio = importance_weights(logp_policy, logp_behaviour, is_cap)  # [B, T]
    per_token = -weights * advantages[:, None] * logp_policy  # [B, T]
    real = mask.bool()
    metrics = {
        "ratio_min": float(ratio[real].min()) if real.any() else float("nan"),
        "ratio_mean": float(ratio[real].mean()) if real.any() else float("nan"),
        "ratio_max": float(ratio[real].max()) if real.any() else float("nan"),
        "clip_fraction": float((ratio[real] > is_cap).float().mean()) if real.any() else 0.0,
        # Group-centred advantages sum to zero; importance weights can break that, and a
        # negative mean then pushes down every sampled token (watch it in the metrics).
        "weighted_advantage_mean": float(normalize((weights * advantages[:, None]).detach(), mask, "dapo")),
    }
    if logp_reference is not None and kl_coef > 0:
        kl = k3_kl(logp_policy, logp_reference)  # [B, T]
        per_token = per_token + kl_coef * kl
        metrics["kl_ref"] = float(normalize(kl.detach(), mask, "dapo"))
    loss = normalize(per_token, mask, normalization, max_completion_length)
    return loss, metrics
