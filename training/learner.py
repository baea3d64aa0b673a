"""The learner: the base model in this process, updated on scored rollouts.

One update's loss is a sum of terms (`Objective`, from TrainConfig):
- the reward policy gradient of GRPO (training.losses.policy_loss) with its off-policy
  correction, plus on-policy distillation's per-token teacher advantages when opd_coef > 0
  (--method opd: those alone, no reward advantage), LUFFY's shaping on guided rollouts;
- supervised fine-tuning on chosen rollouts (--method sft: all of them, teacher samples;
  --method rft: those whose reward reaches rft_min_reward);
- distill_coef x the top-k JSD to the teacher at every visited state (training.distill;
  --method distill: that term alone).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from training.distill import sft_loss, teacher_advantages, topk_distillation
from training.losses import advantages as group_advantages, normalize, policy_loss
from training.rollouts import Rollout, ScoredBatch


@dataclass(frozen=True)
class Objective:
    """What one update optimizes (see the module docstring); built by `from_config`."""

    method: str = "grpo"  # grpo, sft, rft, opd or distill
    correction: str = "sequence"
    scale_advantages: bool = True
    is_cap: float = 2.0
    share_cap: float = 3.0
    normalization: str = "dapo"
    max_completion_length: int | None = None
    teacher_advantage_coef: float = 0.0
    distill_coef: float = 0.0
    distill_beta: float = 0.0
    shaping_gamma: float | None = None
    rft_min_reward: float = 1.0

    @classmethod
    def from_config(cls, config: Any) -> Objective:
        return cls(method=config.method, correction=config.correction, scale_advantages=config.scale_advantages,
                   is_cap=config.is_cap, share_cap=config.share_cap, normalization=config.normalization,
                   max_completion_length=config.max_tokens, teacher_advantage_coef=config.teacher_advantage_coef,
                   distill_coef=config.distillation_coef, distill_beta=config.distill_beta,
                   shaping_gamma=config.guided_shaping, rft_min_reward=config.rft_min_reward)

    @property
    def policy_gradient(self) -> bool:
        return self.method in ("grpo", "opd")

    @property
    def min_group(self) -> int:
        """Rollouts a group needs to count: grpo compares them, the other methods take each alone."""
        return 2 if self.method == "grpo" else 1

    @property
    def needs_teacher_topk(self) -> bool:
        return self.distill_coef > 0


@dataclass(frozen=True)
class Packed:
    """Rollouts as padded tensors: prompt + completion per row, completion positions masked in."""

    input_ids: torch.Tensor  # [B, L] right-padded
    attention_mask: torch.Tensor  # [B, L]
    targets: torch.Tensor  # [B, T] completion tokens, 0 where padded
    target_mask: torch.Tensor  # [B, T] 1 on real completion tokens
    logp_behaviour: torch.Tensor  # [B, T] log q* of each completion token
    starts: torch.Tensor  # [B] index in input_ids of the first completion token
    logp_teacher: torch.Tensor  # [B, T] log pi_t of each completion token (0 where not recorded)
    teacher_ids: torch.Tensor | None  # [B, T, k] the teacher's top-k at each state, when recorded
    teacher_logprobs: torch.Tensor | None  # [B, T, k] their logprobs (-inf in padding)


def pack(rollouts: Sequence[Rollout], pad_id: int) -> Packed:
    width_t = max(len(r.completion_ids) for r in rollouts)
    width = max(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts)
    batch = len(rollouts)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    attention = torch.zeros((batch, width), dtype=torch.long)
    targets = torch.zeros((batch, width_t), dtype=torch.long)
    target_mask = torch.zeros((batch, width_t))
    behaviour = torch.zeros((batch, width_t), dtype=torch.float64)
    starts = torch.zeros(batch, dtype=torch.long)
    teacher = torch.zeros((batch, width_t), dtype=torch.float64)
    recorded = [r.teacher_topk for r in rollouts if r.teacher_topk is not None]
    k = recorded[0][0].shape[1] if len(recorded) == batch else 0
    teacher_ids = torch.zeros((batch, width_t, k), dtype=torch.long) if k else None
    teacher_logprobs = torch.full((batch, width_t, k), -torch.inf, dtype=torch.float32) if k else None
    for row, r in enumerate(rollouts):
        sequence = list(r.prompt_ids) + list(r.completion_ids)
        input_ids[row, : len(sequence)] = torch.tensor(sequence)
        attention[row, : len(sequence)] = 1
        n = len(r.completion_ids)
        targets[row, :n] = torch.tensor(r.completion_ids)
        target_mask[row, :n] = 1.0
        behaviour[row, :n] = torch.tensor(r.logprobs_q, dtype=torch.float64)
        starts[row] = len(r.prompt_ids)
        if r.logprobs_t:
            teacher[row, :n] = torch.tensor(r.logprobs_t, dtype=torch.float64)
        if teacher_ids is not None and teacher_logprobs is not None and r.teacher_topk is not None:
            teacher_ids[row, :n] = torch.from_numpy(r.teacher_topk[0]).clamp(min=0)
            teacher_logprobs[row, :n] = torch.from_numpy(r.teacher_topk[1]).float()
    return Packed(input_ids, attention, targets, target_mask, behaviour, starts, teacher, teacher_ids,
                  teacher_logprobs)


def completion_logits(model: Any, packed: Packed) -> torch.Tensor:
    """The logits at every completion state, predicting y_t -> [B, T, V]."""
    logits = model(input_ids=packed.input_ids, attention_mask=packed.attention_mask).logits  # [B, L, V]
    width_t = packed.targets.shape[1]
    # The token at position s + t is predicted by the logits at s + t - 1.
    positions = packed.starts[:, None] - 1 + torch.arange(width_t)[None, :]  # [B, T]
    positions = positions.clamp(max=logits.shape[1] - 1)
    rows = torch.arange(logits.shape[0])[:, None]
    return logits[rows, positions]  # [B, T, V]


def completion_logprobs(model: Any, packed: Packed, logits: torch.Tensor | None = None) -> torch.Tensor:
    """log pi(y_t | prompt, y_<t) of every completion token -> [B, T] (0 where padded)."""
    if logits is None:
        logits = completion_logits(model, packed)
    logp = torch.log_softmax(logits.float(), dim=-1)  # [B, T, V]
    picked = logp.gather(-1, packed.targets[..., None])[..., 0]  # [B, T]
    return picked * packed.target_mask


class Learner:
    """Holds the model being trained, its optimizer and the frozen reference."""

    def __init__(self, model: Any, *, learning_rate: float, kl_coef: float, pad_id: int) -> None:
        self.model = model.train()
        # Only what trains: with LoRA the base weights are frozen.
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=learning_rate)
        self.reference = copy.deepcopy(model).eval().requires_grad_(False) if kl_coef > 0 else None
        self.kl_coef = kl_coef
        self.pad_id = pad_id

    def train_step(self, batch: ScoredBatch, objective: Objective) -> dict[str, float]:
        started = time.perf_counter()
        loss, metrics = self.loss(batch, objective)
        self.optimizer.zero_grad()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        return {"loss": float(loss.detach()), **metrics, "grad_norm": float(grad_norm),
                "train_tokens_per_s": metrics["train_tokens"] / (time.perf_counter() - started)}

    def loss(self, batch: ScoredBatch, objective: Objective) -> tuple[torch.Tensor, dict[str, float]]:
        """The update's loss on `batch` (with its graph, nothing stepped) and its metrics.

        Apart from `train_step` so that another trainer's loss can be checked against it
        (tests/unit/test_training_trl.py compares TRL's path with this one).
        """
        groups = [g for g in batch.groups if len(g) >= objective.min_group]
        rewards = [torch.tensor([r.reward for r in g]) for g in groups]
        rollouts = [r for g in groups for r in g]
        packed = pack(rollouts, self.pad_id)
        mask = packed.target_mask
        logits = completion_logits(self.model, packed)  # [B, T, V]
        logp = completion_logprobs(self.model, packed, logits)  # [B, T]
        loss = torch.zeros(())
        metrics: dict[str, float] = {}
        if objective.policy_gradient:
            term, metrics = self._policy_gradient(packed, logp, rewards, groups, objective)
            loss = loss + term
        elif objective.method in ("sft", "rft"):
            all_rewards = torch.cat(rewards)
            chosen = all_rewards >= objective.rft_min_reward if objective.method == "rft" else torch.ones_like(
                all_rewards, dtype=torch.bool)
            loss = loss + sft_loss(logp, mask, chosen)
            metrics["sft_rollouts"] = float(chosen.float().mean())
        if objective.distill_coef > 0:
            if packed.teacher_ids is None or packed.teacher_logprobs is None:
                raise ValueError("the distillation term needs the teacher's top-k of every rollout; sample with "
                                 "record_topk")
            divergence = topk_distillation(logits, packed.teacher_ids, packed.teacher_logprobs,
                                           beta=objective.distill_beta)  # [B, T]
            distill = normalize(divergence, mask, "dapo")
            loss = loss + objective.distill_coef * distill
            metrics["distill_divergence"] = float(distill.detach())
        with torch.no_grad():
            entropy_proxy = -(logp * mask).sum() / mask.sum()
            if bool(packed.logp_teacher.any()):  # how far the learner is from the teacher on its tokens
                metrics["teacher_log_ratio"] = float(normalize((logp - packed.logp_teacher.float()), mask, "dapo"))
        all_rewards = torch.cat(rewards)
        return loss, {
            "reward_mean": float(all_rewards.mean()),
            "reward_std": float(all_rewards.std()) if len(all_rewards) > 1 else 0.0,
            "accuracy": float((all_rewards >= 1.0).float().mean()),
            # Groups whose rollouts all scored alike: no advantage, so no learning signal from them.
            "zero_advantage_groups": sum(bool((r == r[0]).all()) for r in rewards) / len(rewards),
            "neg_logp_per_token": float(entropy_proxy),
            "train_tokens": float(mask.sum()),
            **metrics,
        }

    def _policy_gradient(self, packed: Packed, logp: torch.Tensor, rewards: list[torch.Tensor],
                         groups: list[Sequence[Rollout]], objective: Objective) -> tuple[torch.Tensor, dict[str, float]]:
        """GRPO's reward term (none under opd) with the teacher's per-token advantages and LUFFY's shaping."""
        behaviour = packed.logp_behaviour.float()  # [B, T]
        log_ratio = ((logp.detach() - behaviour) * packed.target_mask).sum(-1)  # [B]
        correction = objective.correction if objective.method == "grpo" else "none"
        advantages, metrics = group_advantages(
            rewards, torch.split(log_ratio, [len(g) for g in groups]), correction=correction,  # type: ignore[arg-type]
            scale=objective.scale_advantages, share_cap=objective.share_cap)
        if objective.method == "opd":  # the teacher's advantages alone
            advantages = torch.zeros_like(advantages)
        token_advantages = None
        if objective.teacher_advantage_coef > 0:
            token_advantages = teacher_advantages(logp, packed.logp_teacher.float(),
                                                  objective.teacher_advantage_coef) * packed.target_mask
        shaped = None
        if objective.shaping_gamma is not None:
            shaped = torch.tensor([not r.on_policy for g in groups for r in g])
        reference = None
        if self.reference is not None:
            with torch.no_grad():
                reference = completion_logprobs(self.reference, packed)
        loss, loss_metrics = policy_loss(
            logp, behaviour, advantages.float(), packed.target_mask, correction=correction,  # type: ignore[arg-type]
            is_cap=objective.is_cap, normalization=objective.normalization,  # type: ignore[arg-type]
            max_completion_length=objective.max_completion_length, logp_reference=reference, kl_coef=self.kl_coef,
            token_advantages=token_advantages, shaped=shaped, shaping_gamma=objective.shaping_gamma or 0.1)
        return loss, {**metrics, **loss_metrics}
