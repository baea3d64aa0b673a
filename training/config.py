"""Every option of a training or evaluation run, declared once (CLI flags are generated from it).

    TaskConfig                  what is sampled and how it is scored: models, data, prompts,
    │                           rewards, the coordinator's options (training/task_config.py)
    ├── EvalConfig              + arms, samples, pass@k (`dualvllm eval`)
    └── TrainConfig             + the run, the size and rate of an update, LoRA (`dualvllm train`);
        │                         one class per --method, built by TrainConfig.parse
        ├── DPOTrainConfig          dpo: TRL's DPOTrainer on pairs mined from one batch of q* rollouts
        └── StreamingTrainConfig    + the stream of rollouts, weight pushes, checkpoints (training/grpo.py)
            ├── GRPOTrainConfig         grpo: the reward policy gradient and its off-policy correction
            ├── OPDTrainConfig          opd: on-policy distillation (the base samples, alpha = 0)
            ├── SFTTrainConfig          sft: fine-tuning on the teacher's samples (alpha = 1)
            ├── RFTTrainConfig          rft: fine-tuning on the verified q* rollouts
            ├── DistillTrainConfig      distill: the distillation term alone
            └── AdaptiveTrainConfig     adaptive: per prompt, guided distillation or GRPO by its pass rate

Options two or more methods share are declared once, in the mixins they inherit:
_ChosenAlpha and _AlphaSchedule (the sampling alpha and its schedule), _PolicyGradientLoss (the per-token loss),
_PolicyGradient (+ the KL penalty and on-policy distillation's advantage) and _GroupRelative
(group-relative advantages and their off-policy correction).

The method classes are a union discriminated by `method`. An option a method does not
read is not a field of its class, so setting it is refused, naming the methods that take
it. The defaults are for a real LLM, TRL 1.16's where it has the option (docs/training.md,
"Defaults and where they come from"); the bundled tiny models' values are a recipe,
recipes/tiny-arith.yaml. Where the values come from (flags over a recipe file over these
defaults): training/config_sources.py.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, Field, TypeAdapter, ValidationError, model_validator

from dualvllm.common.errors import InvalidInputError
from dualvllm.coordinator.config import CoordinatorConfig
from dualvllm.training.config_sources import Sources, flag
from dualvllm.training.choices import Correction, MixedPrecision, Normalization
from dualvllm.training.device import check_choice
from dualvllm.training.regimes import Regimes
from dualvllm.training.task_config import TOY_LEARNING_RATE, TaskConfig, bundled

log = logging.getLogger("dualvllm.training")

Method = Literal["grpo", "sft", "rft", "opd", "distill", "adaptive", "dpo"]
Arm = Literal["base", "q*", "teacher"]
# The default recipe, chosen from the mixed task's table (benchmarks/README.md, "The mixed task"):
# forward KL to the teacher's top-k at q* states had the best held-out test accuracy there, and
# on the hard task it was the only configuration above 70% in all three seeds.
DEFAULT_METHOD: Method = "distill"
METHOD_HELP = (
    "grpo: streaming GRPO with verified weight pushes; sft: fine-tuning on teacher samples (alpha = 1); "
    "rft: fine-tuning on the verified q* rollouts (rejection fine-tuning); opd: on-policy distillation "
    "(the base samples, the teacher scores each token); distill: the distillation term alone on the states "
    "the rollouts visit (q*, or --fixed-alpha); adaptive: per prompt, from its own recent pass rate, the "
    "distillation term at guided states where the base never solves it and GRPO on its own rollouts where "
    "it sometimes does (training/regimes.py); dpo: TRL DPO on pairs mined from q* rollouts. All but dpo "
    "stream with pushes, and take --distill-coef. Each method takes its own options (see --help). "
    f"Default: {DEFAULT_METHOD}."
)


class TrainConfig(TaskConfig):
    """What every training method takes: the run, the size and rate of an update, LoRA.

    A config is one method's class (below); build it with `TrainConfig.parse`, which picks
    the class from `method`.
    """

    output_dir: Path = Field(description="Checkpoints, pushed weights, metrics.jsonl and the run's config go here.")
    engine: Literal["vllm", "transformers"] = Field(
        "vllm",
        description="vllm: sample from vLLM servers, pushing every update into the base's; transformers: "
        "sample in this process from the learner's live weights and the teacher loaded beside "
        "it (no server, no push: small models and fast sweeps; training/inprocess.py).",
    )
    weights_via: Literal["auto", "memory", "disk"] = Field(
        "auto",
        description="How each update reaches the base servers (engine vllm): memory = vLLM's weight-transfer "
        "API, from the learner's memory into the servers' (servers started here load dualvllm's "
        "shared-memory engine; training/weight_transfer.py); disk = a checkpoint each server "
        "reloads; auto = memory when the servers can take it, else disk (logged once).",
    )
    method: Method = Field(DEFAULT_METHOD, description=METHOD_HELP)
    steps: int = Field(
        1000,
        ge=1,
        description="Learner updates to run (about one pass over GSM8K's 7,473 training problems at grpo's 8 "
        "prompts per update, 8.6 at the dense methods' 64); --method dpo: batches of --prompts-per-step "
        "prompts sampled.",
    )
    prompts_per_step: int = Field(
        8,
        ge=1,
        description="Prompts per update; each gets group_size rollouts. The method's: 8 for grpo, adaptive "
        'and dpo, groups of 8 making 64 rollouts (docs/training.md, "Defaults and where they come from"); '
        '64 for distill, sft, rft and opd (benchmarks/README.md, "From likelihood to accuracy (issue 24)": '
        "64 distinct prompts an update beat 8 x 8).",
    )
    group_size: int = Field(
        8,
        ge=1,
        description="Rollouts per prompt (G; TRL's num_generations): grpo's and adaptive's advantages and "
        "dpo's pairs compare a prompt's rollouts (G >= 2; 8, TRL's, docs/training.md, \"Defaults and where "
        'they come from"); distill, sft, rft and opd take G = 1, more distinct prompts an update '
        '(benchmarks/README.md, "From likelihood to accuracy (issue 24)").',
    )
    learning_rate: float = Field(
        1e-6,
        gt=0,
        description="AdamW learning rate: TRL's default for the method (GRPOConfig's, DPOConfig's and "
        "DistillationConfig's 1e-6; SFTConfig's 2e-5 for sft and rft). The bundled tiny "
        "models train at 2e-4 (recipes/tiny-arith.yaml); 1e-3 collapsed every GRPO arm there.",
    )
    weight_decay: float = Field(
        0.0,
        ge=0,
        description="AdamW's decoupled weight decay: TRL's default (transformers' TrainingArguments) 0. "
        "torch's AdamW default, 0.01, was the learner's until this was a setting; the tiny "
        "recipes keep it, as their tables were measured with it.",
    )
    lora_rank: int = Field(0, ge=0, description="LoRA rank of the learner's adapters (peft); 0 = train every weight.")
    lora_alpha: int = Field(
        32, ge=1, description="LoRA scaling numerator (peft's lora_alpha); used when lora_rank > 0."
    )
    learner_device: str | None = Field(
        None,
        description="Where the learner runs (cpu, cuda, cuda:N): the model, its reference and start copies, the "
        "batches and the in-process engines; None = the first CUDA device torch sees, else the CPU "
        "(training/device.py).",
    )
    mixed_precision: MixedPrecision = Field(
        "auto",
        description="Autocast of the learner's forward passes over float32 master weights: bf16, fp16 (CUDA "
        "only, with loss scaling) or no; auto = bf16 on a CUDA device that supports it natively, else no.",
    )

    @classmethod
    def parse(cls, config_file: Path | None = None, **values: Any) -> TrainConfig:
        """The run's config: `values` (the flags given) over the recipe file's (`config_file`) over the
        defaults of the method's class, the method being `values`' or else the file's or else DEFAULT_METHOD.
        A refusal names the options the file set; values that suit only the bundled models are
        logged as warnings (see `toy_values`)."""
        sources = Sources.read(values, config_file, TRAIN_OPTIONS, nested_options=CoordinatorConfig.model_fields)
        try:
            config = _ONE_METHOD.validate_python({"method": DEFAULT_METHOD, **sources.merged})
        except ValidationError as exc:
            raise sources.explain(_invalid("TrainConfig", exc)) from exc
        except InvalidInputError as exc:
            raise sources.explain(exc) from exc
        _warn(config, sources)
        return config

    @model_validator(mode="before")
    @classmethod
    def _options_of_the_method(cls, data: Any) -> Any:
        """An option of other methods only is refused with the methods that take it."""
        if cls in (TrainConfig, StreamingTrainConfig):
            raise ValueError(f"a {cls.__name__} is one method's: build it with TrainConfig.parse(method=..., ...)")
        if not isinstance(data, dict):
            return data
        foreign: dict[tuple[str, ...], list[str]] = {}
        for name in data:
            owners = tuple(method for method, other in METHOD_CLASSES.items() if name in other.model_fields)
            if name not in cls.model_fields and owners:
                foreign.setdefault(owners, []).append(flag(name))
        if foreign:
            raise ValueError(
                "; ".join(
                    f"{', '.join(names)} {'is an option' if len(names) == 1 else 'are options'} of --method "
                    f"{_either(owners)}; drop {'it' if len(names) == 1 else 'them'} or pass "
                    f"{f'--method {owners[0]}' if len(owners) == 1 else 'one of those methods'}"
                    for owners, names in foreign.items()
                )
            )
        section = data.get("coordinator")
        if data.get("engine") == "transformers" and isinstance(section, dict) and "mode" in section:
            raise ValueError(
                "--engine transformers runs the coordinator per token in this process; drop "
                "coordinator.mode or use --engine vllm"
            )
        return data

    @model_validator(mode="after")
    def _run_is_consistent(self) -> TrainConfig:
        given = self.model_fields_set
        check_choice(self.learner_device, self.mixed_precision)
        if "lora_alpha" in given and self.lora_rank == 0:
            raise ValueError(
                "--lora-alpha scales LoRA adapters, and lora_rank is 0 (full fine-tuning); "
                "set --lora-rank > 0 or drop --lora-alpha"
            )
        if self.engine == "transformers":
            if server_options := [flag(n) for n in ("theta_urls", "t_urls", "replicas", "lockstep") if n in given]:
                raise ValueError(
                    f"--engine transformers samples in this process; {', '.join(server_options)} "
                    "name or start servers: drop them or use --engine vllm"
                )
        return self

    def toy_values(self) -> dict[str, str]:
        toys = super().toy_values()
        if not bundled(self.base) and self.learning_rate > TOY_LEARNING_RATE and not self.lora_rank:
            default = type(self).model_fields["learning_rate"].default
            toys["learning_rate"] = (
                f"full fine-tuning (lora_rank 0) of a real model at more than "
                f"{TOY_LEARNING_RATE:g} diverges; TRL's default for --method {self.method} is "
                f"{default:g}: lower --learning-rate, or train LoRA adapters (--lora-rank)"
            )
        return toys


class _ChosenAlpha(BaseModel):
    """The rollouts' alpha, for the methods that may sample at any."""

    fixed_alpha: float | None = Field(
        None,
        ge=0,
        le=1,
        description="None = sample from q* (alpha* per token); 0 = on-policy (base only); 1 = teacher only.",
    )

    @property
    def sampling_alpha(self) -> float | None:
        """The rollouts' fixed alpha; None = alpha*."""
        return self.fixed_alpha


class _AlphaSchedule(_ChosenAlpha):
    """A cap on alpha* that decays to on-policy over the run."""

    alpha_decay_steps: int | None = Field(
        None,
        ge=1,
        description="Alpha schedule: alpha* is capped at --alpha-cap-start x (1 - u / N) at update u, "
        "reaching 0 (on-policy) after N updates (Logit Fusion's decay, as a cap); None = no cap.",
    )
    alpha_cap_start: float = Field(1.0, ge=0, le=1, description="The schedule's cap at the first update.")

    @model_validator(mode="after")
    def _schedule_has_alpha_star(self) -> _AlphaSchedule:
        if self.alpha_decay_steps is not None and self.sampling_alpha is not None:
            raise ValueError(
                f"--alpha-decay-steps caps alpha*, and these rollouts are sampled at a fixed alpha "
                f"({self.sampling_alpha:g}); drop one of them"
            )
        if "alpha_cap_start" in self.model_fields_set and self.alpha_decay_steps is None:
            raise ValueError("--alpha-cap-start starts the alpha schedule; give --alpha-decay-steps too")
        return self

    def alpha_cap(self, step: int) -> float | None:
        """The alpha schedule's cap for rollouts sampled after `step` updates (None: no schedule)."""
        if self.alpha_decay_steps is None:
            return None
        return self.alpha_cap_start * max(0.0, 1.0 - step / self.alpha_decay_steps)


class _PolicyGradientLoss(BaseModel):
    """The per-token policy-gradient loss's options (grpo's, opd's, and adaptive's GRPO term)."""

    is_cap: float = Field(2.0, ge=1, description="correction=token: truncation of the per-token weight pi_theta / q*.")
    normalization: Normalization = Field(
        "dapo", description="Loss normalization: grpo, dr_grpo or dapo (TRL's loss_type)."
    )


class _PolicyGradient(_PolicyGradientLoss):
    """+ the terms added to it: the KL penalty and on-policy distillation's advantage (grpo's, opd's)."""

    kl_coef: float = Field(
        0.0, ge=0, description="Weight of the k3 KL penalty to the frozen initial model (TRL's beta); 0 = none."
    )
    opd_coef: float | None = Field(
        None,
        ge=0,
        description="Weight c of on-policy distillation's per-token advantage -c (log pi_theta(y_t) - log "
        "pi_t(y_t)) (training/distill.py), added to the reward advantages; None = 1 under "
        "--method opd, else 0 (off).",
    )

    @property
    def teacher_advantage_coef(self) -> float:
        """The weight of on-policy distillation's per-token advantage (opd_coef resolved)."""
        return self.opd_coef if self.opd_coef is not None else 0.0

    @property
    def reference_kl_coef(self) -> float:
        return self.kl_coef


class _GroupRelative(_PolicyGradientLoss):
    """Group-relative advantages of the rewards and their off-policy correction (grpo's, adaptive's)."""

    correction: Correction = Field(
        "sequence",
        description="Off-policy correction of the sampled rollouts (q*'s, or under --method adaptive the "
        "server's copy of the weights, up to --max-staleness updates old): sequence "
        "(self-normalized per group), token (truncated per-token pi/q*; did not lift the "
        "bundled base, see benchmarks/README.md), vespo (VESPO's Gamma weight of the sequence "
        "ratio) or none (biased toward q*: for tasks the base almost never solves, see "
        "benchmarks/README.md).",
    )
    share_cap: float = Field(
        3.0, ge=1, description="correction=sequence: truncation of G·v, the group shares one rollout may count for."
    )
    scale_advantages: bool = Field(
        True,
        description="Divide group-relative advantages by the group std (TRL's scale_rewards='group'; False = "
        "Dr. GRPO).",
    )

    @model_validator(mode="after")
    def _caps_match_the_correction(self) -> _GroupRelative:
        for name, mode in (("is_cap", "token"), ("share_cap", "sequence")):
            if name in self.model_fields_set and self.correction != mode:
                raise ValueError(
                    f"{flag(name)} applies to --correction {mode}, and the correction is "
                    f"{self.correction}; drop {flag(name)} or pass --correction {mode}"
                )
        return self


class StreamingTrainConfig(TrainConfig):
    """The methods that stream rollouts into the learner, pushing its weights (training/grpo.py).

    What the stream asks of every method, with the value of a method that has no such
    option: `sampling_alpha` (the rollouts' fixed alpha, None = alpha*; each method class
    says), `alpha_cap`, `distillation_coef`, `teacher_advantage_coef`, `reference_kl_coef`,
    `pooled_on_policy`, `no_signal_stop`.
    """

    max_staleness: int = Field(1, ge=0, description="Drop rollouts sampled more than this many policy versions ago.")
    queue_size: int = Field(2, ge=1, description="Scored batches the sampler may run ahead of the learner.")
    push_every: int = Field(1, ge=1, description="Push weights to the base server every N updates.")
    push_probe_every: int = Field(
        50,
        ge=0,
        description="In-memory pushes are proved by digest (the exact bytes the servers took); a logprob probe "
        "(a forward pass on each side) also checks the first push, every Nth push after it, and every push "
        "a digest cannot prove. 0: the first push only.",
    )
    checkpoint_every: int = Field(
        10,
        ge=1,
        description="Save a checkpoint (the model, the optimizer's state, the RNGs) every N updates and after the "
        "last: a killed run resumes from the newest, redoing at most N-1 updates (each logged once). A checkpoint "
        "writes the model and the optimizer's two moments, three times the float32 model: every update, it took "
        "0.8 s of a 2.7 s update at 41.8M parameters on CPU.",
    )
    keep_checkpoints: int = Field(
        3, ge=1, description="Checkpoints kept on disk (newest first); older ones are deleted."
    )
    eval_every: int = Field(
        20, ge=1, description="Evaluate the base on the held-out prompts every N updates (and at start and end)."
    )
    curriculum: bool = Field(
        False,
        description="Pick prompts by difficulty: per-prompt reward EMA, buckets at the valleys of a KDE over "
        "them, hard buckets drawn more, prompts whose group scored all alike skipped for a while "
        "(training/curriculum.py).",
    )
    distill_coef: float | None = Field(
        None,
        ge=0,
        description="Weight of the distillation term: JSD_beta between the teacher's top-k (+ a tail "
        "bucket) and the learner at every visited state (GKD; training/distill.py); None = 1 "
        "under --method distill, else 0 (off).",
    )
    distill_beta: float = Field(
        0.0,
        ge=0,
        le=1,
        description="That divergence's beta, as TRL's: 0 = forward KL(teacher || learner), "
        "1 = reverse KL, between them the generalized JSD.",
    )
    stop_at_accuracy: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Stop early once held-out greedy accuracy reaches this at two evaluations in a "
        "row (sweeps); None = run all --steps.",
    )
    micro_batch_size: int | None = Field(
        None,
        ge=1,
        description="Rollouts per forward and backward pass, their gradients accumulated into one update "
        "(less activation memory, the same update); None = the whole batch "
        "(prompts_per_step x group_size) at once.",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute the learner's activations in the backward pass instead of keeping them "
        "(transformers' gradient checkpointing): less memory, about a third more compute.",
    )
    kl_from_start_prompts: int = Field(
        0,
        ge=0,
        description="At every evaluation, sample one completion from the base alone for this many training "
        "prompts and report the KL from the starting weights over their states (kl_from_start, "
        "nats per completion; training/forgetting.py), as RL's Razor measures forgetting. Holds "
        "a float32 copy of the starting weights beside the learner. 0 = off.",
    )
    kl_from: str | None = Field(
        None,
        description="The model the KL from the start is measured from (--kl-from-start-prompts); None = the "
        "run's --base. Give the original model when --base is a checkpoint of an earlier stage (SFT then "
        "GRPO), so that the KL counts every stage's drift.",
    )

    @model_validator(mode="after")
    def _stream_is_consistent(self) -> StreamingTrainConfig:
        given = self.model_fields_set
        if self.kl_from is not None and not self.kl_from_start_prompts:
            raise ValueError(
                "--kl-from names the model --kl-from-start-prompts measures from; give "
                "--kl-from-start-prompts N too, or drop --kl-from"
            )
        if self.eval_every > self.steps and "eval_every" in given:
            raise ValueError(
                f"--eval-every {self.eval_every} is more than --steps {self.steps}: no evaluation "
                "would run between the first and the last; lower it or drop it"
            )
        if self.distill_beta and not self.distillation_coef:
            raise ValueError(
                "--distill-beta shapes the distillation term, which --distill-coef 0 turns off; "
                "give --distill-coef > 0 or drop --distill-beta"
            )
        batch = self.prompts_per_step * self.group_size
        if self.micro_batch_size is not None and self.micro_batch_size > batch:
            raise ValueError(
                f"--micro-batch-size {self.micro_batch_size} is more than the {batch} rollouts of an "
                f"update (--prompts-per-step x --group-size); lower it, or drop it for the whole batch "
                "at once"
            )
        return self

    @property
    def sampling_alpha(self) -> float | None:
        """The rollouts' fixed alpha; None = alpha*. Every method class says which (no default)."""
        raise NotImplementedError(f"{type(self).__name__} does not say its rollouts' alpha (sampling_alpha)")

    @property
    def distillation_coef(self) -> float:
        """The weight of the distillation term (distill_coef resolved)."""
        return self.distill_coef if self.distill_coef is not None else 0.0

    @property
    def teacher_advantage_coef(self) -> float:
        """The weight of on-policy distillation's per-token advantage: 0 for methods without the term."""
        return 0.0

    @property
    def reference_kl_coef(self) -> float:
        """The weight of the KL penalty to the frozen start (grpo's and opd's --kl-coef): 0 = none."""
        return 0.0

    @property
    def pooled_on_policy(self) -> int:
        """On-policy rollouts per group pooled with q* ones (grpo's --on-policy-rollouts); 0 = none."""
        return 0

    @property
    def no_signal_stop(self) -> int | None:
        """The update at which a run whose groups all had zero advantage stops (grpo's --stop-without-signal)."""
        return None

    def alpha_cap(self, step: int) -> float | None:
        """The alpha schedule's cap for rollouts sampled after `step` updates (None: no schedule)."""
        return None


class _OneRolloutPerPrompt(BaseModel):
    """The shape of an update for the methods that train on each rollout alone (distill, sft, rft,
    opd): one rollout of each of many distinct prompts, where grpo, adaptive and dpo take groups."""

    prompts_per_step: int = Field(
        64,
        ge=1,
        description="Prompts per update; each gets group_size rollouts. 64 x 1 for the methods that train "
        'on each rollout alone: benchmarks/README.md, "From likelihood to accuracy (issue 24)" (forward KL '
        "on teacher states 74.5% at 64 x 1 against 5.5% at 8 x 8, on q* states 10.5% against 6.0%; sft, "
        "rft and opd measured at 64 x 1).",
    )
    group_size: int = Field(
        1,
        ge=1,
        description="Rollouts per prompt: 1 for the methods that train on each rollout alone, so an update "
        'sees more distinct prompts: benchmarks/README.md, "From likelihood to accuracy (issue 24)".',
    )


class GRPOTrainConfig(_AlphaSchedule, _GroupRelative, _PolicyGradient, StreamingTrainConfig):
    """--method grpo: group-relative advantages of the rewards, corrected for sampling from q*."""

    method: Literal["grpo"] = Field("grpo", description=METHOD_HELP)
    on_policy_rollouts: int = Field(
        0,
        ge=0,
        description="Pooled groups: of each prompt's --group-size rollouts, this many are sampled "
        "on-policy (alpha = 0), the rest from q*; advantages over the pooled group (LUFFY).",
    )
    guided_shaping: float | None = Field(
        None,
        gt=0,
        description="LUFFY's shaping f(p) = p / (p + gamma) on the tokens of the q* rollouts of pooled "
        "groups, with this gamma (0.1 in the paper), in place of their importance weight; "
        "None = off.",
    )
    stop_without_signal: int | None = Field(
        None,
        ge=1,
        description="Stop at update N if every group so far had zero advantage (all its rollouts scored "
        "alike, so GRPO had nothing to learn from); None = never (sweeps).",
    )

    @model_validator(mode="after")
    def _groups_are_consistent(self) -> GRPOTrainConfig:
        if self.group_size < 2:
            raise ValueError(
                "--method grpo compares a prompt's rollouts: give --group-size >= 2, or use "
                "--method sft, rft, opd or distill"
            )
        if self.on_policy_rollouts >= self.group_size:
            raise ValueError(
                f"--on-policy-rollouts {self.on_policy_rollouts} leaves no q* rollout in groups of "
                f"{self.group_size}; give fewer than --group-size"
            )
        if self.on_policy_rollouts and self.fixed_alpha == 0.0:
            raise ValueError(
                "--on-policy-rollouts pools on-policy with q* rollouts, and --fixed-alpha 0 makes every "
                "rollout on-policy; drop one of them"
            )
        if self.guided_shaping is not None and not self.on_policy_rollouts:
            raise ValueError("--guided-shaping shapes the q* rollouts of pooled groups; set --on-policy-rollouts too")
        return self

    @property
    def pooled_on_policy(self) -> int:
        return self.on_policy_rollouts

    @property
    def no_signal_stop(self) -> int | None:
        return self.stop_without_signal


class OPDTrainConfig(_OneRolloutPerPrompt, _PolicyGradient, StreamingTrainConfig):
    """--method opd: the base samples (alpha = 0) and the teacher's per-token advantages train it."""

    method: Literal["opd"] = Field("opd", description=METHOD_HELP)

    @model_validator(mode="after")
    def _has_a_term(self) -> OPDTrainConfig:
        if self.opd_coef == 0:
            raise ValueError(
                "--method opd trains on the teacher's per-token advantages alone: --opd-coef 0 leaves "
                "nothing to learn; drop it (1) or give a positive weight"
            )
        return self

    @property
    def sampling_alpha(self) -> float:
        return 0.0

    @property
    def teacher_advantage_coef(self) -> float:
        return self.opd_coef if self.opd_coef is not None else 1.0


class SFTTrainConfig(_OneRolloutPerPrompt, StreamingTrainConfig):
    """--method sft: fine-tuning on the teacher's samples (alpha = 1)."""

    method: Literal["sft"] = Field("sft", description=METHOD_HELP)
    learning_rate: float = Field(2e-5, gt=0, description=TrainConfig.model_fields["learning_rate"].description)

    @property
    def sampling_alpha(self) -> float:
        return 1.0


class RFTTrainConfig(_OneRolloutPerPrompt, _AlphaSchedule, StreamingTrainConfig):
    """--method rft: fine-tuning on the rollouts whose reward reaches rft_min_reward (from q* by default)."""

    method: Literal["rft"] = Field("rft", description=METHOD_HELP)
    learning_rate: float = Field(2e-5, gt=0, description=TrainConfig.model_fields["learning_rate"].description)
    rft_min_reward: float = Field(1.0, description="--method rft: rollouts whose reward reaches this are trained on.")


class DistillTrainConfig(_OneRolloutPerPrompt, _AlphaSchedule, StreamingTrainConfig):
    """--method distill: the distillation term alone, on the states the rollouts visit."""

    method: Literal["distill"] = Field("distill", description=METHOD_HELP)

    @model_validator(mode="after")
    def _has_a_term(self) -> DistillTrainConfig:
        if self.distill_coef == 0:
            raise ValueError(
                "--method distill trains on the distillation term alone: --distill-coef 0 leaves nothing "
                "to learn; drop it (1) or give a positive weight"
            )
        return self

    @property
    def distillation_coef(self) -> float:
        return self.distill_coef if self.distill_coef is not None else 1.0


class AdaptiveTrainConfig(_GroupRelative, StreamingTrainConfig):
    """--method adaptive: each prompt's regime, from its own on-policy pass rate, decides its group
    (training/regimes.py): never solved lately -> guided rollouts (--guided-alpha) trained by the
    distillation term, with --probe-rollouts on-policy ones that keep measuring; sometimes -> GRPO
    on the base's own rollouts; always -> drawn rarely."""

    method: Literal["adaptive"] = Field("adaptive", description=METHOD_HELP)
    guided_alpha: float | None = Field(
        1.0,
        ge=0,
        le=1,
        description="Alpha of the guided rollouts of never-solved prompts: 1 = the teacher's samples, "
        "None = q* (alpha* per token).",
    )
    probe_rollouts: int = Field(
        2,
        ge=0,
        description="On-policy rollouts in each never-solved prompt's group, which measure its pass rate "
        "(0: such a prompt stays guided).",
    )
    pass_rate_decay: float = Field(0.5, ge=0, lt=1, description="Decay of each prompt's pass-rate EMA.")
    never_enter: float = Field(0.05, ge=0, le=1, description="A prompt becomes never-solved below this pass rate.")
    never_exit: float = Field(0.1, ge=0, le=1, description="... and leaves that regime at this pass rate.")
    always_enter: float = Field(0.95, ge=0, le=1, description="A prompt becomes always-solved at this pass rate.")
    always_exit: float = Field(0.85, ge=0, le=1, description="... and leaves that regime below this pass rate.")
    solved_weight: float = Field(
        0.1, gt=0, le=1, description="Draw weight of an always-solved prompt (1 for the rest)."
    )

    @model_validator(mode="after")
    def _groups_are_consistent(self) -> AdaptiveTrainConfig:
        if self.group_size < 2:
            raise ValueError(
                "--method adaptive compares a prompt's own rollouts where it is sometimes solved: give "
                "--group-size >= 2"
            )
        if self.probe_rollouts >= self.group_size:
            raise ValueError(
                f"--probe-rollouts {self.probe_rollouts} leaves no guided rollout in groups of "
                f"{self.group_size}; give fewer than --group-size"
            )
        if self.curriculum:
            raise ValueError("--method adaptive chooses its prompts by their regimes; drop --curriculum")
        if self.distill_coef == 0:
            raise ValueError(
                "--method adaptive trains never-solved prompts by the distillation term: --distill-coef "
                "0 leaves them nothing; drop it (1) or give a positive weight"
            )
        self.regimes(n_tasks=1)  # its thresholds, checked before anything starts
        return self

    def regimes(self, n_tasks: int) -> Regimes:
        """A new run's per-prompt regimes over `n_tasks` training prompts."""
        return Regimes(
            n_tasks=n_tasks,
            seed=self.seed,
            decay=self.pass_rate_decay,
            never_enter=self.never_enter,
            never_exit=self.never_exit,
            always_enter=self.always_enter,
            always_exit=self.always_exit,
            solved_weight=self.solved_weight,
        )

    @property
    def sampling_alpha(self) -> float:
        return 0.0  # of the regimes' own groups; the guided ones take guided_alpha

    @property
    def distillation_coef(self) -> float:
        return self.distill_coef if self.distill_coef is not None else 1.0


class DPOTrainConfig(_ChosenAlpha, TrainConfig):
    """--method dpo: TRL's DPOTrainer on pairs mined from one batch of q* rollouts (training/dpo.py)."""

    method: Literal["dpo"] = Field("dpo", description=METHOD_HELP)
    dpo_beta: float = Field(
        0.1, gt=0, description="DPO: strength of the implicit KL to the starting model (TRL's beta)."
    )
    dpo_epochs: int = Field(1, ge=1, description="DPO: passes over the mined preference pairs.")

    @model_validator(mode="after")
    def _pairs_on_servers(self) -> DPOTrainConfig:
        if self.group_size < 2:
            raise ValueError(
                "--method dpo compares a prompt's rollouts: give --group-size >= 2, or use "
                "--method sft, rft, opd or distill"
            )
        if self.engine == "transformers":
            raise ValueError("--method dpo samples and evaluates on servers; use --engine vllm")
        if self.theta_urls:
            raise ValueError(
                "--method dpo evaluates the trained model on servers it starts for it; running servers "
                "(--theta-urls, --t-urls) are for the streaming methods, which push weights into them: "
                "drop them"
            )
        return self


METHOD_CLASSES: dict[str, type[TrainConfig]] = {
    cls.model_fields["method"].default: cls
    for cls in (
        GRPOTrainConfig,
        SFTTrainConfig,
        RFTTrainConfig,
        OPDTrainConfig,
        DistillTrainConfig,
        AdaptiveTrainConfig,
        DPOTrainConfig,
    )
}
_ONE_METHOD: TypeAdapter[TrainConfig] = TypeAdapter(
    Annotated[Union[tuple(METHOD_CLASSES.values())], Field(discriminator="method")]  # type: ignore[arg-type]
)
# Every option of `dualvllm train`: those of at least one method.
TRAIN_OPTIONS = tuple(dict.fromkeys(name for cls in METHOD_CLASSES.values() for name in cls.model_fields))


class EvalConfig(TaskConfig):
    """`dualvllm eval`: greedy accuracy and pass@k of the base alone, q* and the teacher alone."""

    arms: tuple[Arm, ...] = Field(
        ("base", "q*", "teacher"), description="What to evaluate: base (alpha = 0), q* (alpha*), teacher (alpha = 1)."
    )
    eval_samples: int = Field(8, ge=0, description="Samples per problem for pass@k at --temperature; 0 = greedy only.")
    output: Path | None = Field(None, description="Write the report here as JSON too.")

    @classmethod
    def parse(cls, config_file: Path | None = None, **values: Any) -> EvalConfig:
        """As TrainConfig.parse; a training recipe's training options are skipped."""
        sources = Sources.read(
            values,
            config_file,
            tuple(cls.model_fields),
            nested_options=CoordinatorConfig.model_fields,
            skipped=[name for name in TRAIN_OPTIONS if name not in cls.model_fields],
        )
        try:
            config = cls(**sources.merged)
        except InvalidInputError as exc:
            raise sources.explain(exc) from exc
        _warn(config, sources)
        return config


def _invalid(schema: str, exc: ValidationError) -> InvalidInputError:
    """The one-line error of a failed validation of the method union: a method class's own error
    (its __init__ already made it one line), or an unknown method."""
    for error in exc.errors(include_url=False):
        if isinstance(cause := (error.get("ctx") or {}).get("error"), InvalidInputError):
            return cause
        if error["type"] == "union_tag_invalid":
            return InvalidInputError(
                f"invalid {schema}: method={error['ctx']['tag']!r}: Input should be "
                f"{_either([repr(method) for method in METHOD_CLASSES])}"
            )
    return InvalidInputError(f"invalid {schema}: {exc.errors(include_url=False)[0]['msg']}")


def _either(names: list[str] | tuple[str, ...]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _warn(config: TaskConfig, sources: Sources) -> None:
    """Log the recipe's options and every value that suits only the bundled models, with where it came from."""
    if sources.recipe_path is not None:
        log.info("options from %s: %s", sources.recipe_path, ", ".join(sorted(sources.recipe)))
    for name, why in config.toy_values().items():
        log.warning(
            "%s=%s (%s) is a value for the bundled tiny models, and the base %s is not one of them: %s",
            name,
            getattr(config, name),
            sources.origin(name),
            config.base,
            why,
        )
