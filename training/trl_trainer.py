"""TRL's GRPOTrainer with this project's loss: q* is the behaviour policy.

TRL 1.16 trains on rollouts from a `rollout_func` (dualvllm.training.trl_rollouts.QStarRollouts
returns log q* per token as their sampling logprobs), but its own losses read those
logprobs only as vLLM's sampling noise around the policy (`use_vllm=True` with
`vllm_importance_sampling_correction`), never as a behaviour policy that differs from it
on purpose. Without `use_vllm` TRL treats the rollouts as on-policy. So the trainer here
keeps everything of TRL's step (sampling, rewards, batching, accumulation, accelerate)
and replaces two things with this project's math (training/losses.py, training/distill.py):

    _generate_and_score_completions   the group advantages: for correction "sequence",
                                      self-normalized weights of pi_theta / q* within each
                                      group (gathered over processes, as TRL gathers rewards)
    _compute_loss                     dualvllm.training.losses.policy_loss with log q* as the
                                      behaviour logprobs, plus on-policy distillation's
                                      per-token advantages (`opd_coef`) and the top-k JSD to
                                      the teacher (`distill_coef`), from the rollouts' extra
                                      fields `logprob_t` and `teacher_topk_*`

Corrections (`QStarGRPOConfig.correction`) mean what they mean for `dualvllm train`
(docs/training.md): "none" = every token weighs 1 (GRPO as if q* were the base, biased
toward q* on purpose), "sequence" = self-normalized whole-rollout weights per group,
"token" = min(pi/q*, is_cap) per token, "vespo" = VESPO's Gamma weight of the sequence ratio
pi/q* (TRL's `get_gamma_weights`, fed q* instead of the old policy). `loss_type` keeps TRL's
meaning and picks the normalization: grpo, dr_grpo or dapo.

On one batch, one process and no accumulation the loss and its gradient equal
dualvllm.training.learner.Learner's (tests/unit/training/test_trl.py). With accumulation or several
processes each term is rescaled the way TRL rescales that normalization, so the summed
gradient is the one of the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from trl import GRPOConfig, GRPOTrainer

from dualvllm.common.errors import InvalidInputError
from dualvllm.training.config import GRPOTrainConfig
from dualvllm.training.distill import teacher_advantages, topk_distillation
from dualvllm.training.learner import denormals_flushed
from dualvllm.training.losses import advantages as project_advantages, normalize, policy_loss

CORRECTIONS = ("none", "sequence", "token", "vespo")
NORMALIZATIONS = ("grpo", "dr_grpo", "dapo")  # TRL's loss_type values that are this project's normalizations
# Extra fields of the rollout function (dualvllm.training.trl_rollouts) that the loss reads.
TEACHER_LOGPROBS = "logprob_t"
TEACHER_TOPK_IDS = "teacher_topk_ids"
TEACHER_TOPK_LOGPROBS = "teacher_topk_logprobs"
# TRL settings whose effect the project's loss does not have: they must stay at these values.
UNSUPPORTED = {
    # With use_vllm off, TRL's vllm_importance_sampling_correction (on by default) does nothing; on, it would
    # reweigh every token by pi/q* truncated at its clip, which erases a q* rollout's signal.
    "use_vllm": (False, "the rollouts come from rollout_func, and TRL's vLLM correction would reweigh them by pi/q*"),
    "num_iterations": (1, "the project's losses take one gradient step per batch (no ratio to an old policy)"),
    "importance_sampling_level": ("token", "the correction decides how rollouts are weighed"),
    "multi_objective_aggregation": ("sum_then_normalize", "advantages are the project's group advantages"),
    "off_policy_mask_threshold": (None, "the correction decides how off-policy rollouts count"),
    "top_entropy_quantile": (1.0, "every completion token is trained"),
    "entropy_coef": (0.0, "the loss has no entropy bonus"),
    "use_adaptive_entropy": (False, "the loss has no entropy bonus"),
}


def _train_field(name: str, help_prefix: str = "") -> Any:
    """A dataclass field whose default and help are `dualvllm train --method grpo`'s (defaults live in one schema)."""
    info = GRPOTrainConfig.model_fields[name]
    return field(default=info.default, metadata={"help": help_prefix + (info.description or "")})


@dataclass
class QStarGRPOConfig(GRPOConfig):
    """GRPOConfig plus the q* correction and the distillation terms of `dualvllm train`."""

    correction: str = _train_field("correction")
    is_cap: float = _train_field("is_cap")
    share_cap: float = _train_field("share_cap")
    opd_coef: float = field(
        default=0.0,
        metadata={
            "help": "Weight c of on-policy distillation's per-token "
            "advantage -c (log pi_theta(y_t) - log pi_t(y_t)), from the rollouts' `logprob_t`; 0 = off."
        },
    )
    distill_coef: float = field(
        default=0.0,
        metadata={
            "help": "Weight of the top-k JSD to the teacher at every "
            "visited state, from the rollouts' `teacher_topk_ids`/`teacher_topk_logprobs` "
            "(QStarRollouts(record_topk=k)); 0 = off."
        },
    )
    distill_beta: float = _train_field("distill_beta")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.correction not in CORRECTIONS:
            raise InvalidInputError(f"correction={self.correction!r}; use one of {', '.join(CORRECTIONS)}")
        if self.loss_type not in NORMALIZATIONS:
            hint = " (for VESPO set correction='vespo' with loss_type='dapo')" if self.loss_type == "vespo" else ""
            raise InvalidInputError(
                f"loss_type={self.loss_type!r}: with q* rollouts loss_type only chooses the "
                f"normalization, one of {', '.join(NORMALIZATIONS)}{hint}"
            )
        if self.scale_rewards not in ("group", "none"):
            raise InvalidInputError(
                f"scale_rewards={self.scale_rewards!r}: q* advantages are group-relative; use "
                "'group' (divide by the group's std) or 'none' (Dr. GRPO)"
            )
        for name, (allowed, why) in UNSUPPORTED.items():
            if getattr(self, name) != allowed:
                raise InvalidInputError(
                    f"{name}={getattr(self, name)!r} is not supported with q* rollouts: {why}; leave it at {allowed!r}"
                )
        if self.beta > 0 and self.use_bias_correction_kl:
            raise InvalidInputError(
                "use_bias_correction_kl=True (TRL's default) is not supported with q* rollouts: "
                "the KL penalty is the learner's k3 estimate, unweighted; set it to False"
            )
        for name in ("is_cap", "share_cap"):
            if getattr(self, name) < 1:
                raise InvalidInputError(f"{name}={getattr(self, name)} must be >= 1")
        if self.opd_coef < 0 or self.distill_coef < 0 or not 0 <= self.distill_beta <= 1:
            raise InvalidInputError("opd_coef and distill_coef must be >= 0 and distill_beta within [0, 1]")


# GRPOTrainer's private methods this subclass overrides, with TRL's signatures: a TRL release that
# renames or reshapes one would leave the override silently unused (tests/unit/training/test_trl.py
# fails loudly instead). The tested range is pyproject.toml's.
OVERRIDDEN = {
    "_calculate_rewards": ("self", "inputs", "prompts", "completions", "completion_ids_list"),
    "_generate_and_score_completions": ("self", "inputs"),
    "_compute_loss": ("self", "model", "inputs"),
}


class QStarGRPOTrainer(GRPOTrainer):
    """GRPOTrainer whose advantages and loss are this project's, with q* as the behaviour policy.

    Pass `rollout_func=QStarRollouts(...)` (or any rollout function returning log q* as
    `logprobs`) and a QStarGRPOConfig.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, QStarGRPOConfig):
            raise InvalidInputError("QStarGRPOTrainer needs args=QStarGRPOConfig(...): it carries the correction")
        if self.rollout_func is None:
            raise InvalidInputError(
                "QStarGRPOTrainer trains on q* rollouts: pass rollout_func=QStarRollouts(...), "
                "whose logprobs are log q*"
            )
        self._rewards: torch.Tensor | None = None

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """TRL's step (its generation, loss and backward) with denormals flushed: tiny sequence
        weights backpropagate denormal gradients (dualvllm.training.learner.denormals_flushed)."""
        with denormals_flushed():
            return super().training_step(*args, **kwargs)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        # TRL gathers every process's rewards here; the advantages below need them, summed as TRL sums them.
        per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        total = (per_func * self.reward_weights.to(per_func.device)).nansum(dim=1)
        self._rewards = total.masked_fill(torch.isnan(per_func).all(dim=1), float("nan"))  # [B_global]
        return per_func

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        output = super()._generate_and_score_completions(inputs)
        args: QStarGRPOConfig = self.args  # type: ignore[assignment]
        mask = output["completion_mask"] * output.get("tool_mask", 1)  # [B, T]
        output["advantages"] = self._qstar_advantages(output, mask, len(inputs))
        # TRL merged the rollout function's extra fields into `inputs` (for the rewards): the loss needs some.
        width = output["completion_ids"].shape[1]
        device = output["completion_ids"].device
        if args.opd_coef > 0:
            output["teacher_per_token_logps"] = _padded(
                [_field(x, TEACHER_LOGPROBS) for x in inputs], width, fill=0.0, device=device
            )  # [B, T]
        if args.distill_coef > 0:
            output["teacher_topk_ids"] = _padded(
                [_field(x, TEACHER_TOPK_IDS) for x in inputs], width, fill=0, device=device, dtype=torch.long
            )  # [B, T, k]
            output["teacher_topk_logprobs"] = _padded(
                [_field(x, TEACHER_TOPK_LOGPROBS) for x in inputs], width, fill=float("-inf"), device=device
            )  # [B, T, k]
        return output

    def _qstar_advantages(self, output: dict[str, Any], mask: torch.Tensor, local: int) -> torch.Tensor:
        """This process's [B] advantages: dualvllm.training.losses.advantages over every process's groups.

        A rollout no reward scored (NaN) is left out of its group and gets 0, and so does a
        group left with fewer than 2 rollouts (`dualvllm train` drops both).
        """
        args: QStarGRPOConfig = self.args  # type: ignore[assignment]
        mode = "train" if self.model.training else "eval"
        rewards = self._rewards
        assert rewards is not None, "_calculate_rewards runs before the advantages"
        group = self.num_generations if mode == "train" else self.num_generations_eval
        log_ratio = torch.zeros(local, device=mask.device)  # [B] summed log pi_theta - log q*
        if args.correction == "sequence":
            log_ratio = ((self._policy_logps(output) - output["sampling_per_token_logps"]) * mask).sum(-1)
        log_ratio = self.accelerator.gather(log_ratio)  # [B_global]
        advantages = torch.zeros_like(rewards)  # [B_global]
        kept_rewards, kept_ratios, kept_rows = [], [], []
        for start in range(0, len(rewards), group):
            rows = torch.arange(start, start + group, device=rewards.device)
            rows = rows[~torch.isnan(rewards[rows])]
            if len(rows) >= 2:
                kept_rewards.append(rewards[rows].cpu().double())
                kept_ratios.append(log_ratio[rows].cpu().double())
                kept_rows.append(rows)
        if kept_rows:
            values, metrics = project_advantages(
                kept_rewards,
                kept_ratios,
                correction=args.correction,
                scale=args.scale_rewards == "group",
                share_cap=args.share_cap,
            )
            advantages[torch.cat(kept_rows)] = values.to(advantages.dtype).to(advantages.device)
            if args.correction == "sequence":
                for name, value in metrics.items():
                    self._metrics[mode][f"qstar/{name}"].append(value)
        rank = self.accelerator.process_index
        return advantages[rank * local : (rank + 1) * local]

    def _policy_logps(self, output: dict[str, Any]) -> torch.Tensor:
        """log pi_theta of every completion token under the weights that sampled them -> [B, T]."""
        if output.get("old_per_token_logps") is not None:
            return output["old_per_token_logps"]
        input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        with torch.no_grad():
            logps, _, _ = self._get_per_token_logps_and_entropies(
                self.model,
                input_ids,
                attention,
                output["completion_ids"].size(1),
                batch_size=self.args.per_device_train_batch_size,
            )
        return logps

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        args: QStarGRPOConfig = self.args  # type: ignore[assignment]
        mode = "train" if self.model.training else "eval"
        completion_ids = inputs["completion_ids"]
        mask = (inputs["completion_mask"] * inputs.get("tool_mask", 1)).float()  # [B, T]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        width = completion_ids.size(1)
        logits = None
        if args.distill_coef > 0:  # the divergence needs whole distributions: one plain forward gives both
            logits = model(input_ids=input_ids, attention_mask=attention).logits[:, -width - 1 : -1]  # [B, T, V]
            logp = torch.log_softmax(logits.float() / self.temperature, dim=-1).gather(-1, completion_ids[..., None])[
                ..., 0
            ]  # [B, T]
        else:
            logp, entropies, _ = self._get_per_token_logps_and_entropies(
                model, input_ids, attention, width, compute_entropy=True
            )
            self._metrics[mode]["entropy"].append(self._masked_mean(entropies, mask))
        behaviour = inputs.get("sampling_per_token_logps")
        if behaviour is None:
            raise InvalidInputError(
                "the rollout function returned no logprobs: QStarGRPOTrainer needs log q* per "
                "token as `logprobs` (QStarRollouts returns them)"
            )
        token_advantages = None
        if args.opd_coef > 0:
            token_advantages = teacher_advantages(logp, inputs["teacher_per_token_logps"], args.opd_coef) * mask
        loss, metrics = policy_loss(
            logp,
            behaviour,
            inputs["advantages"].float(),
            mask,
            correction=args.correction,
            is_cap=args.is_cap,
            normalization=args.loss_type,
            max_completion_length=self.max_completion_length,
            logp_reference=inputs.get("ref_per_token_logps"),
            kl_coef=self.beta,
            token_advantages=token_advantages,
        )
        loss = loss * self._accumulation_scale(args.loss_type, mask, inputs)
        if logits is not None:
            divergence = topk_distillation(
                logits, inputs["teacher_topk_ids"], inputs["teacher_topk_logprobs"], beta=args.distill_beta
            )  # [B, T]
            distill = normalize(divergence, mask, "dapo")
            loss = loss + args.distill_coef * distill * self._accumulation_scale("dapo", mask, inputs)
            metrics["distill_divergence"] = float(distill.detach())
        for name, value in metrics.items():
            self._metrics[mode][f"qstar/{name}"].append(value)
        return loss

    def _accumulation_scale(self, normalization: str, mask: torch.Tensor, inputs: dict[str, Any]) -> float:
        """What turns a micro-batch's loss, normalized as dualvllm.training.losses.normalize does, into TRL's share of
        the accumulated batch: 1 / accumulation steps, or for dapo the micro-batch's tokens over the
        tokens TRL normalizes by (the generation batch's, per process and accumulation window)."""
        training = self.model.training
        steps = self.current_gradient_accumulation_steps if training else 1
        if normalization != "dapo":
            return 1.0 / steps
        tokens = float(inputs["num_items_in_batch"].clamp(min=1.0)) / self.accelerator.num_processes
        if training:
            tokens = tokens * steps / self.args.steps_per_generation
        return float(mask.sum().clamp(min=1.0)) / tokens

    def _masked_mean(self, values: torch.Tensor, mask: torch.Tensor) -> float:
        totals = self.accelerator.reduce(torch.stack([(values.detach() * mask).sum(), mask.sum()]), reduction="sum")
        return float(totals[0] / totals[1].clamp(min=1.0))


def _field(row: dict[str, Any], name: str) -> Any:
    if name not in row:
        raise InvalidInputError(
            f"the loss needs the rollouts' {name!r}, and the rollout function returned none: "
            "use QStarRollouts (with record_topk=k for the distillation term), or set its "
            "coefficient to 0"
        )
    return row[name]


def _padded(
    rows: list[Any], width: int, *, fill: float, device: torch.device, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Per-rollout lists of [T_i] or [T_i, k] values -> [B, width(, k)], right-padded with `fill`."""
    tensors = [torch.as_tensor(row, dtype=dtype) for row in rows]
    shape = (len(rows), width, *tensors[0].shape[1:])
    out = torch.full(shape, fill, dtype=dtype)
    for i, tensor in enumerate(tensors):
        out[i, : len(tensor)] = tensor
    return out.to(device)
