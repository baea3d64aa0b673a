"""The learner: the base model in this process, updated by GRPO on scored q* rollouts."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from training.losses import advantages as group_advantages, policy_loss
from training.rollouts import Rollout, ScoredBatch


@dataclass(frozen=True)
class Packed:
    """Rollouts as padded tensors: prompt + completion per row, completion positions masked in."""

    input_ids: torch.Tensor  # [B, L] right-padded
    attention_mask: torch.Tensor  # [B, L]
    targets: torch.Tensor  # [B, T] completion tokens, 0 where padded
    target_mask: torch.Tensor  # [B, T] 1 on real completion tokens
    logp_behaviour: torch.Tensor  # [B, T] log q* of each completion token
    starts: torch.Tensor  # [B] index in input_ids of the first completion token


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
    for row, r in enumerate(rollouts):
        sequence = list(r.prompt_ids) + list(r.completion_ids)
        input_ids[row, : len(sequence)] = torch.tensor(sequence)
        attention[row, : len(sequence)] = 1
        n = len(r.completion_ids)
        targets[row, :n] = torch.tensor(r.completion_ids)
        target_mask[row, :n] = 1.0
        behaviour[row, :n] = torch.tensor(r.logprobs_q, dtype=torch.float64)
        starts[row] = len(r.prompt_ids)
    return Packed(input_ids, attention, targets, target_mask, behaviour, starts)


def completion_logprobs(model: Any, packed: Packed) -> torch.Tensor:
    """log pi(y_t | prompt, y_<t) of every completion token -> [B, T] (0 where padded)."""
    logits = model(input_ids=packed.input_ids, attention_mask=packed.attention_mask).logits  # [B, L, V]
    logp = torch.log_softmax(logits.float(), dim=-1)  # [B, L, V]
    width_t = packed.targets.shape[1]
    # The token at position s + t is predicted by the logits at s + t - 1.
    positions = packed.starts[:, None] - 1 + torch.arange(width_t)[None, :]  # [B, T]
    positions = positions.clamp(max=logp.shape[1] - 1)
    rows = torch.arange(logp.shape[0])[:, None]
    picked = logp[rows, positions, packed.targets]  # [B, T]
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

    def train_step(self, batch: ScoredBatch, *, correction: str, scale_advantages: bool, is_cap: float,
                   share_cap: float, normalization: str, max_completion_length: int) -> dict[str, float]:
        started = time.perf_counter()
        groups = [g for g in batch.groups if len(g) >= 2]
        rewards = [torch.tensor([r.reward for r in g]) for g in groups]
        rollouts = [r for g in groups for r in g]
        packed = pack(rollouts, self.pad_id)
        logp = completion_logprobs(self.model, packed)  # [B, T]
        behaviour = packed.logp_behaviour.float()  # [B, T]
        log_ratio = ((logp.detach() - behaviour) * packed.target_mask).sum(-1)  # [B]
        advantages, advantage_metrics = group_advantages(
            rewards, torch.split(log_ratio, [len(g) for g in groups]), correction=correction,  # type: ignore[arg-type]
            scale=scale_advantages, share_cap=share_cap)
        reference = None
        if self.reference is not None:
            with torch.no_grad():
                reference = completion_logprobs(self.reference, packed)
        loss, metrics = policy_loss(
            logp, behaviour, advantages.float(), packed.target_mask, correction=correction,  # type: ignore[arg-type]
            is_cap=is_cap, normalization=normalization,  # type: ignore[arg-type]
            max_completion_length=max_completion_length, logp_reference=reference, kl_coef=self.kl_coef,
        )
        metrics.update(advantage_metrics)
        self.optimizer.zero_grad()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        with torch.no_grad():
            entropy_proxy = -(logp * packed.target_mask).sum() / packed.target_mask.sum()
        all_rewards = torch.cat(rewards)
        tokens = int(packed.target_mask.sum())
        return {
            "loss": float(loss.detach()),
            "reward_mean": float(all_rewards.mean()),
            "reward_std": float(all_rewards.std()) if len(all_rewards) > 1 else 0.0,
            "accuracy": float((all_rewards >= 1.0).float().mean()),
            # Groups whose rollouts all scored alike: no advantage, so no learning signal from them.
            "zero_advantage_groups": sum(bool((r == r[0]).all()) for r in rewards) / len(rewards),
            "grad_norm": float(grad_norm),
            "neg_logp_per_token": float(entropy_proxy),
            "train_tokens_per_s": tokens / (time.perf_counter() - started),
            **metrics,
        }
