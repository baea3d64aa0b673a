"""Every option of a training run, declared once (CLI flags are generated from it)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from common.validation import RaisesInvalidInput
from training.losses import Correction, Normalization

Method = Literal["grpo", "dpo"]
# Options only one method reads: setting one of them under the other method does nothing,
# so it is refused rather than silently ignored.
GRPO_ONLY = ("correction", "is_cap", "share_cap", "normalization", "scale_advantages", "kl_coef",
             "max_staleness", "queue_size", "push_every", "keep_checkpoints", "eval_every")
DPO_ONLY = ("dpo_beta", "dpo_epochs")


class TrainConfig(RaisesInvalidInput, BaseModel):
    """Training on q* rollouts (GRPO or DPO): sampling, the update, weight pushes, checkpoints."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    output_dir: Path = Field(description="Checkpoints, pushed weights, metrics.jsonl and the run's config go here.")
    method: Method = Field(
        "grpo", description="grpo: streaming GRPO with verified weight pushes; dpo: TRL DPO on pairs mined from q* rollouts.")
    base: str | None = Field(None, description="Base model directory (trained); None = the bundled tiny base.")
    teacher: str | None = Field(None, description="Teacher model directory; None = the bundled tiny teacher.")
    steps: int = Field(200, ge=1, description="Learner updates to run.")
    prompts_per_step: int = Field(8, ge=1, description="Prompts per update; each gets group_size rollouts.")
    group_size: int = Field(8, ge=2, description="Rollouts per prompt (G): advantages compare a prompt's rollouts.")
    max_tokens: int = Field(6, ge=1, description="Longest completion sampled.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the rollouts.")
    fixed_alpha: float | None = Field(
        None, ge=0, le=1, description="None = sample from q* (alpha* per token); 0 = on-policy (base only); 1 = teacher only.")
    top_k: int = Field(20, ge=1, description="Top-k the coordinator merges per token.")
    learning_rate: float = Field(2e-4, gt=0, description="AdamW learning rate (1e-3 collapsed every arm on the bundled base).")
    correction: Correction = Field(
        "sequence", description="Off-policy correction for q* rollouts: sequence (self-normalized per group) or token "
                                "(truncated per-token pi/q*; did not lift the bundled base, see benchmarks/README.md).")
    is_cap: float = Field(2.0, ge=1, description="correction=token: truncation of the per-token weight pi_theta / q*.")
    share_cap: float = Field(
        3.0, ge=1, description="correction=sequence: truncation of G·v, the group shares one rollout may count for.")
    normalization: Normalization = Field("dapo", description="Loss normalization: grpo, dr_grpo or dapo (TRL's meanings).")
    scale_advantages: bool = Field(True, description="Divide group-relative advantages by the group std (False = Dr. GRPO).")
    lora_rank: int = Field(0, ge=0, description="LoRA rank of the learner's adapters (peft); 0 = train every weight.")
    lora_alpha: int = Field(32, ge=1, description="LoRA scaling numerator (peft's lora_alpha); used when lora_rank > 0.")
    kl_coef: float = Field(0.0, ge=0, description="Weight of the k3 KL penalty to the frozen initial model; 0 = none.")
    max_staleness: int = Field(1, ge=0, description="Drop rollouts sampled more than this many policy versions ago.")
    queue_size: int = Field(2, ge=1, description="Scored batches the sampler may run ahead of the learner.")
    push_every: int = Field(1, ge=1, description="Push weights to the base server every N updates.")
    keep_checkpoints: int = Field(3, ge=1, description="Checkpoints kept on disk (newest first); older ones are deleted.")
    eval_every: int = Field(20, ge=1, description="Held-out greedy accuracy of the base every N updates (and at start and end).")
    eval_prompts: int = Field(200, ge=1, description="Held-out problems per evaluation.")
    dpo_beta: float = Field(0.1, gt=0, description="DPO: strength of the implicit KL to the starting model (TRL's beta).")
    dpo_epochs: int = Field(1, ge=1, description="DPO: passes over the mined preference pairs.")
    seed: int = Field(0, description="Seeds data order, sampling and the learner.")

    @field_validator("base", "teacher")
    @classmethod
    def _model_directory(cls, model: str | None) -> str | None:
        """Both models are loaded here (the learner, and the servers this run starts)."""
        if model is not None and not (Path(model).expanduser() / "config.json").is_file():
            raise ValueError(f"{model!r} is not a model directory (no config.json in it); give a Hugging "
                             "Face checkpoint directory")
        return model

    @model_validator(mode="after")
    def _no_option_without_effect(self) -> TrainConfig:
        """Options set explicitly that the chosen method or mode never reads are refused with the fix."""
        given = self.model_fields_set
        flag = lambda name: "--" + name.replace("_", "-")  # noqa: E731
        unused = {"grpo": DPO_ONLY, "dpo": GRPO_ONLY}[self.method]
        if wasted := [flag(n) for n in unused if n in given]:
            other = "dpo" if self.method == "grpo" else "grpo"
            raise ValueError(f"{', '.join(wasted)} only apply to --method {other}; drop them, or pass --method {other}")
        if "lora_alpha" in given and self.lora_rank == 0:
            raise ValueError("--lora-alpha scales LoRA adapters, and lora_rank is 0 (full fine-tuning); "
                             "set --lora-rank > 0 or drop --lora-alpha")
        for name, mode in (("is_cap", "token"), ("share_cap", "sequence")):
            if name in given and self.correction != mode:
                raise ValueError(f"{flag(name)} applies to --correction {mode}, and the correction is "
                                 f"{self.correction}; drop {flag(name)} or pass --correction {mode}")
        if self.eval_every > self.steps and "eval_every" in given:
            raise ValueError(f"--eval-every {self.eval_every} is more than --steps {self.steps}: no evaluation "
                             "would run between the first and the last; lower it or drop it")
        return self
