"""GRPO on rollouts sampled from q*: advantages, importance weights, the loss.

Pure functions of tensors; shapes on every line. The rollouts come from the behaviour
policy q* (the coordinator records log q*(y_t) per token), not from pi_theta, so the
policy gradient of J(theta) = E_{y ~ pi_theta}[R(y)] is estimated with importance weights.
Two corrections are offered (`Correction`):

- "sequence" (the default): self-normalized importance sampling of whole sequences within
  each group. A prompt's G rollouts get weights v_i = W_i / sum_j W_j with
  W_i = prod_t pi_theta(y_it) / q*(y_it); the baseline is the weighted group mean
  b = sum_i v_i r_i (an estimate of E_pi[R], not of E_q*[R]) and the advantage
  A_i = G v_i (r_i - b), optionally divided by the weighted std. This is the
  self-normalized off-policy policy gradient (Owen 2013, ch. 9; Precup et al. 2000);
  with q* = pi_theta every v_i = 1/G and it is exactly GRPO's group advantage.
  Truncation: G v_i is capped at `share_cap`, so no rollout counts for more than
  `share_cap` rollouts' share.
- "token": per-token truncated weights w_t = min(pi_theta(y_t) / q*(y_t), is_cap)
  (truncated IS as in IMPALA's V-trace, Espeholt et al. 2018, and the TIS fix for
  vLLM/trainer mismatch) on plain group advantages. Right for small mismatches; with q*
  it is biased: the group mean of q* rollouts overestimates E_pi[R], the base's own
  mistakes carry weights > 1 and the teacher-guided tokens < 1, so the update is mostly a
  push-down (measured: it did not lift the bundled base, see benchmarks/README.md).
- "vespo": plain group advantages, every token of rollout i weighed by the smooth Gamma
  weight phi(W_i) = e^lambda W_i^k e^(-lambda W_i) of its sequence ratio W_i (phi(1) = 1;
  k, lambda by the sign of the advantage), as TRL 1.16's `loss_type="vespo"`
  (`GRPOTrainer.get_gamma_weights`; VESPO, arXiv 2602.10693): near-on-policy rollouts
  count fully, far-off ones fade smoothly instead of being truncated.
- "none": plain group advantages, every token weighs 1, as if q* were the base. Biased on
  purpose. Both corrections above estimate the on-policy gradient of E_pi[R], and where
  the base almost never succeeds that gradient is almost zero however well it is
  estimated: q*'s right answers are exactly the rollouts the base finds unlikely, so
  their weights vanish. Without a correction the update climbs E_q*[R] instead and
  pulls the base toward what q* gets right, as off-policy guidance does (LUFFY, Yan et
  al. 2025, who likewise drop the off-policy ratio's denominator).

Advantages are group-relative (GRPO, Shao et al. 2024). Loss normalizations follow
TRL's names:
- "grpo": mean over each sequence's tokens, then over sequences;
- "dr_grpo": sum over all tokens / (sequences x max_completion_length) (Liu et al. 2025),
  no length bias;
- "dapo": sum over all tokens / all tokens in the batch (Yu et al. 2025).
An optional KL penalty to a frozen reference uses the k3 estimator
exp(ref - logp) - (ref - logp) - 1 >= 0 (Schulman 2020), per token, normalized the same way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from dualvllm.training.choices import Correction, Normalization

# VESPO's Gamma shapes, TRL 1.16's defaults (vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg).
VESPO_POSITIVE = (2.0, 3.0)
VESPO_NEGATIVE = (3.0, 2.0)
# TRL clamps log W to [log 1e-8, 20] before exponentiating.
VESPO_LOG_W_MIN = math.log(1e-8)
VESPO_LOG_W_MAX = 20.0


def group_advantages(rewards: torch.Tensor, *, scale: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """(r - mean of its group) [/ (std of its group + eps)]; rewards [N, G] -> [N, G].

    `scale=False` is Dr. GRPO's choice: dividing by the std up-weights groups that are
    almost all right or all wrong. std is the unbiased sample std, as in TRL.
    """
    centered = rewards - rewards.mean(dim=-1, keepdim=True)  # [N, G]
    if not scale:
        return centered
    return centered / (rewards.std(dim=-1, keepdim=True) + eps)


def sequence_weights(log_ratio: torch.Tensor) -> torch.Tensor:
    """Self-normalized sequence weights v = softmax(sum_t log(pi/q*)) over a group, [G] -> [G].

    `log_ratio` holds each rollout's summed log pi_theta(y) - log q*(y); normalizing in log
    space keeps products of many per-token ratios finite.
    """
    return torch.softmax(log_ratio.detach().double(), dim=-1).to(log_ratio.dtype)


def weighted_group_advantages(
    rewards: torch.Tensor, weights: torch.Tensor, *, scale: bool = True, cap: float | None = None, eps: float = 1e-4
) -> torch.Tensor:
    """G v_i (r_i - b) with b = sum_i v_i r_i [/ weighted std]; rewards, weights [G] -> [G].

    The std uses the unbiased weighted variance sum_i v_i (r_i - b)^2 / (1 - sum_i v_i^2)
    (reliability weights), so uniform weights give exactly `group_advantages`. `cap`
    truncates G v_i (None = no truncation).
    """
    group = rewards.shape[-1]
    baseline = (weights * rewards).sum(-1, keepdim=True)  # [1]
    centered = rewards - baseline  # [G]
    shares = group * weights  # [G], 1 each when on-policy
    if cap is not None:
        shares = shares.clamp(max=cap)
    advantages = shares * centered  # [G]
    if not scale:
        return advantages
    # One dominant weight leaves no spread to estimate: the numerator is then 0 too.
    unbiased = (weights * centered**2).sum(-1, keepdim=True) / (1.0 - (weights**2).sum(-1, keepdim=True)).clamp(
        min=1e-12
    )
    return advantages / (unbiased.sqrt() + eps)


def effective_sample_size_ratio(weights: torch.Tensor) -> torch.Tensor:
    """Kish's ESS / G = 1 / (G sum_i v_i^2) in (0, 1] for normalized weights [G]; 1 = on-policy."""
    return 1.0 / (weights.shape[-1] * (weights**2).sum(-1))


def importance_weights(
    logp_policy: torch.Tensor, logp_behaviour: torch.Tensor, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(min(pi/q, cap) detached, raw ratio pi/q detached), both [B, T]."""
    ratio = torch.exp((logp_policy - logp_behaviour).detach())  # [B, T]
    return ratio.clamp(max=cap), ratio


def gamma_weights(
    advantages: torch.Tensor,
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    *,
    positive: tuple[float, float] = VESPO_POSITIVE,
    negative: tuple[float, float] = VESPO_NEGATIVE,
) -> torch.Tensor:
    """VESPO's phi(W) = exp(lambda + k log W - lambda W) per rollout, detached; [B], [B, T], [B, T] -> [B].

    W = prod_t pi_theta(y_t) / q*(y_t) over the real tokens (per-token log ratios clamped to
    [-20, 20], log W to [log 1e-8, 20], as TRL does); (k, lambda) = `positive` where the
    advantage is >= 0, else `negative`.
    """
    log_w = (log_ratio.detach().clamp(-20.0, 20.0) * mask).sum(-1).clamp(VESPO_LOG_W_MIN, VESPO_LOG_W_MAX)  # [B]
    nonneg = advantages >= 0
    k = torch.where(nonneg, positive[0], negative[0])  # [B]
    lam = torch.where(nonneg, positive[1], negative[1]).clamp(min=1e-4)  # [B]
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def guided_shaping(logp_policy: torch.Tensor, gamma: float = 0.1) -> torch.Tensor:
    """LUFFY (Yan et al. 2025, arXiv 2504.14945)'s f(pi_theta(y_t)) = p / (p + gamma), with grad; [B, T] -> [B, T].

    Its gradient is gamma / (p + gamma)^2 · p ∇log p: near 1/gamma · p ∇log p for rare tokens,
    far above the ratio's p ∇log p, so the learner moves toward guided tokens it finds unlikely.
    """
    p = logp_policy.exp()
    return p / (p + gamma)


def k3_kl(logp_policy: torch.Tensor, logp_reference: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate exp(ref - logp) - (ref - logp) - 1 >= 0, [B, T]."""
    delta = logp_reference - logp_policy
    return torch.exp(delta) - delta - 1.0


def normalize(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    how: Normalization,
    max_completion_length: int | None = None,
    *,
    batch_rows: int | None = None,
    batch_tokens: float | None = None,
) -> torch.Tensor:
    """Reduce a [B, T] per-token loss over the real tokens (mask) to a scalar.

    Every normalization is a sum over rows with denominators fixed by the whole batch (its
    rows, its real tokens), so a batch cut into micro-batches is normalized by passing the
    whole batch's `batch_rows` and `batch_tokens`: the micro-batches' values, and their
    gradients, then sum to the whole batch's. None: `per_token` is the whole batch.
    """
    mask = mask.to(per_token.dtype)
    rows = per_token.shape[0] if batch_rows is None else batch_rows
    if how == "grpo":
        per_sequence = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)  # [B]
        return per_sequence.sum() / rows
    if how == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("dr_grpo normalizes by max_completion_length; pass it")
        return (per_token * mask).sum() / (rows * max_completion_length)
    if how == "dapo":
        tokens = mask.sum().clamp(min=1.0) if batch_tokens is None else max(batch_tokens, 1.0)
        return (per_token * mask).sum() / tokens
    raise ValueError(f"unknown normalization {how!r}; use grpo, dr_grpo or dapo")


def advantages(
    rewards: Sequence[torch.Tensor],
    log_ratios: Sequence[torch.Tensor],
    *,
    correction: Correction,
    scale: bool = True,
    share_cap: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-rollout advantages for groups of different sizes, concatenated in group order -> [B].

    `rewards[g]`, `log_ratios[g]`: [G_g] rewards and summed log pi_theta(y) - log q*(y) of
    group g's rollouts. "sequence" weights them (self-normalized, G v truncated at `share_cap`);
    "token" ignores the ratios here (the loss weights each token instead), and so does "none".
    Metrics: mean ESS ratio of the groups' sequence weights (for every correction); under
    "sequence", the fraction of rollouts truncated and the largest share.
    """
    weights = [sequence_weights(l) for l in log_ratios]  # [G_g] each
    # How far off-policy the rollouts are, whatever the correction does about it.
    ess = {"ess_ratio": float(torch.stack([effective_sample_size_ratio(v) for v in weights]).mean())}
    if correction in ("token", "vespo", "none"):
        return torch.cat([group_advantages(r[None, :], scale=scale)[0] for r in rewards]), ess
    if correction != "sequence":
        raise ValueError(f"unknown correction {correction!r}; use sequence, token, vespo or none")
    out = torch.cat([weighted_group_advantages(r, v, scale=scale, cap=share_cap) for r, v in zip(rewards, weights)])
    shares = torch.cat([v * v.shape[-1] for v in weights])  # [B]
    return out, {
        **ess,
        "clip_fraction": float((shares > share_cap).float().mean()) if share_cap is not None else 0.0,
        "sequence_weight_max": float(shares.max()),
    }


def policy_loss(
    logp_policy: torch.Tensor,  # [B, T] log pi_theta(y_t), with grad
    logp_behaviour: torch.Tensor,  # [B, T] log q*(y_t) recorded at sampling time
    advantages: torch.Tensor,  # [B] one per sequence (from `advantages`, same correction)
    mask: torch.Tensor,  # [B, T] 1 on completion tokens
    *,
    correction: Correction = "sequence",
    is_cap: float = 2.0,
    normalization: Normalization = "dapo",
    max_completion_length: int | None = None,
    logp_reference: torch.Tensor | None = None,  # [B, T] frozen reference, for the KL penalty
    kl_coef: float = 0.0,
    token_advantages: torch.Tensor | None = None,  # [B, T] per-token advantages (on-policy distillation)
    shaped: torch.Tensor | None = None,  # bool [B]: rollouts whose tokens take LUFFY's shaping f(p)
    shaping_gamma: float = 0.1,
    batch_rows: int | None = None,  # the whole batch's rows and real tokens when these rows are a micro-batch
    batch_tokens: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The importance-corrected policy-gradient loss and its metrics (ratio stats, KL).

    "sequence": the advantages already carry the correction, each token weighs 1;
    "token": each token weighs min(pi/q*, is_cap); "vespo": each token of a rollout weighs
    its Gamma weight phi(W); "none": each token weighs 1. `token_advantages` are added to
    the rollout's advantage at each token, weighed by min(pi/q*, is_cap) whatever the
    correction (a per-token term needs no sequence weight). Rows of `shaped` use
    -A f(pi_theta(y_t)) (dualvllm.training.distill.guided_shaping) instead of -w A log pi_theta(y_t).
    Every term is per token given the rollout's advantage, so a micro-batch's loss with the
    whole batch's `batch_rows` and `batch_tokens` is its exact share (`normalize`); its
    metrics describe only these rows.
    """
    truncated, ratio = importance_weights(logp_policy, logp_behaviour, is_cap)  # [B, T]
    if correction == "token":
        weights = truncated
    elif correction == "vespo":
        weights = gamma_weights(advantages, logp_policy - logp_behaviour, mask)[:, None].expand_as(truncated)
    else:
        weights = torch.ones_like(truncated)
    weighted = weights * advantages[:, None]  # [B, T]
    if token_advantages is not None:
        weighted = weighted + truncated * token_advantages
    per_token = -weighted * logp_policy  # [B, T]
    if shaped is not None and shaped.any():
        per_token = torch.where(shaped[:, None], -weighted * guided_shaping(logp_policy, shaping_gamma), per_token)
    real = mask.bool()
    metrics = {
        "ratio_min": float(ratio[real].min()) if real.any() else float("nan"),
        "ratio_mean": float(ratio[real].mean()) if real.any() else float("nan"),
        "ratio_max": float(ratio[real].max()) if real.any() else float("nan"),
        # Group-centred advantages sum to zero; importance weights can break that, and a
        # negative mean then pushes down every sampled token (watch it in the metrics).
        "weighted_advantage_mean": float(normalize(weighted.detach(), mask, "dapo")),
    }
    if correction == "vespo":
        metrics["vespo_phi_mean"] = float(normalize(weights.detach(), mask, "dapo"))
    if correction == "token":
        metrics["clip_fraction"] = float((ratio[real] > is_cap).float().mean()) if real.any() else 0.0
    if logp_reference is not None and kl_coef > 0:
        kl = k3_kl(logp_policy, logp_reference)  # [B, T]
        per_token = per_token + kl_coef * kl
        metrics["kl_ref"] = float(normalize(kl.detach(), mask, "dapo"))
    loss = normalize(
        per_token, mask, normalization, max_completion_length, batch_rows=batch_rows, batch_tokens=batch_tokens
    )
    return loss, metrics
