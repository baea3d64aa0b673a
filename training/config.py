"""Every option of a training or evaluation run, declared once (CLI flags are generated from it).

    TaskConfig     what is sampled and how it is scored: models, data, prompts, rewards
    ├── TrainConfig  + the update, weight pushes, checkpoints (`dualvllm train`)
    └── EvalConfig   + arms, samples, pass@k (`dualvllm eval`)
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from common.validation import RaisesInvalidInput
from training.losses import Correction, Normalization

Method = Literal["grpo", "sft", "rft", "opd", "distill", "dpo"]
# Methods that train on a stream of rollouts with weight pushes (training/grpo.py's recipe);
# dpo mines pairs from one batch of rollouts and trains with TRL's DPOTrainer.
STREAMING = ("grpo", "sft", "rft", "opd", "distill")
Arm = Literal["base", "q*", "teacher"]
# The teacher may be the base model itself, shown the teacher's prompt: "self" on the base
# server (always the current weights), "self-frozen" on a second server with the starting weights.
SELF_TEACHERS = ("self", "self-frozen")
# Options only one method reads: setting one of them under the other method does nothing,
# so it is refused rather than silently ignored.
GRPO_ONLY = ("correction", "is_cap", "share_cap", "normalization", "scale_advantages", "kl_coef",
             "max_staleness", "queue_size", "push_every", "keep_checkpoints", "eval_every", "curriculum",
             "opd_coef", "distill_coef", "distill_beta", "on_policy_rollouts", "guided_shaping", "rft_min_reward",
             "alpha_decay_steps", "alpha_cap_start", "stop_at_accuracy", "stop_without_signal")
DPO_ONLY = ("dpo_beta", "dpo_epochs")
# Among the streaming methods, options of the reward policy gradient (grpo) that sft, rft and
# opd never read; and what each of those methods alone reads.
REWARD_PG_ONLY = ("correction", "share_cap", "scale_advantages", "on_policy_rollouts", "guided_shaping",
                  "stop_without_signal")
_NO_PG = (*REWARD_PG_ONLY, "is_cap", "normalization", "kl_coef", "opd_coef")
UNREAD_BY = {"opd": REWARD_PG_ONLY, "sft": _NO_PG, "rft": _NO_PG, "distill": _NO_PG}
METHOD_ONLY = {"rft_min_reward": "rft"}
# The rollouts' alpha that sft (the teacher's samples) and opd (the base's own) stand for.
METHOD_ALPHA = {"sft": 1.0, "opd": 0.0}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


class TaskConfig(RaisesInvalidInput, BaseModel):
    """What is sampled and how it is scored: the models, the data, the prompts and the rewards."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    base: str | None = Field(None, description="Base model directory (the one trained); None = the bundled tiny base.")
    teacher: str | None = Field(
        None, description="Teacher model directory, or 'self' (the base server shown the teacher's prompt, always "
                          "the current weights) or 'self-frozen' (the starting base on a second server); None = the "
                          "bundled tiny teacher.")
    dataset: Path | None = Field(
        None, description="Training prompts: JSONL, or a file/directory the datasets library loads (parquet, arrow, "
                          "json, csv, save_to_disk); None = the bundled arithmetic task.")
    eval_dataset: Path | None = Field(
        None, description="Held-out prompts; None = the bundled test split without --dataset, else --eval-prompts "
                          "rows held out of --dataset (chosen by --seed).")
    prompt_template: str | None = Field(
        None, description="The base prompt as a format string over each row's fields, e.g. '{question}'; None = the "
                          "row's prompt, messages or theta_prompt.")
    teacher_template: str | None = Field(
        None, description="The teacher's prompt as a format string over the row's fields and {prompt} (the base "
                          "prompt), e.g. '{prompt}{answer} ' for a teacher shown the answer; None = the row's "
                          "t_prompt, else the base prompt.")
    chat_template: str | None = Field(
        None, description="'tokenizer': every prompt becomes one user message rendered with the base tokenizer's "
                          "chat template; a path: that Jinja template instead (for tokenizers without one); None = "
                          "prompts as they are (rows with messages use the tokenizer's template).")
    reward: tuple[str, ...] = Field(
        ("exact",), description="Rewards, summed: exact, math, gsm8k, code, length, format, or module:function "
                                "(TRL's signature); see training/rewards.py.")
    reward_weights: tuple[float, ...] | None = Field(None, description="One weight per --reward; None = all 1.")
    length_budget: int | None = Field(None, ge=1, description="The length reward's budget in tokens.")
    format_pattern: str | None = Field(None, description="The format reward's regular expression.")
    reward_timeout: float = Field(60.0, gt=0, description="Seconds a reward may take for one batch before it scores None.")
    max_tokens: int = Field(6, ge=1, description="Longest completion sampled.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the rollouts.")
    top_k: int = Field(20, ge=1, description="Top-k the coordinator merges per token.")
    lockstep: bool = Field(
        True, description="Start the servers with the lockstep plugin, so rollouts are decoded natively in lockstep "
                           "(coordinator/lockstep/); a weight push takes the sequences in flight off the servers and "
                           "resumes them after it, on the new weights.")
    replicas: int = Field(
        1, ge=1, le=64, description="(base, teacher) server pairs this run starts, pooled per role: a replica that "
                                    "dies hands its sequences to the others, and every weight push goes to each base "
                                    "replica, verified (engines/pool.py).")
    theta_urls: tuple[str, ...] = Field(
        (), description="Base servers already running (dev mode, serving --base) to sample from instead of starting "
                        "any; the run first pushes its starting weights into each, then every update.")
    t_urls: tuple[str, ...] = Field(
        (), description="Teacher servers already running (serving --teacher); needed with --theta-urls unless "
                        "--teacher self, which samples the teacher from the base servers.")
    eval_prompts: int = Field(200, ge=1, description="Held-out problems per evaluation (at most).")
    eval_fraction: float = Field(
        0.1, gt=0, lt=1, description="--dataset without --eval-dataset: the share of its rows held out, capped at "
                                     "--eval-prompts (at least 1 row).")
    eval_samples: int = Field(
        0, ge=0, description="Samples per held-out problem for pass@k at --temperature; 0 = greedy accuracy only.")
    pass_k: tuple[int, ...] = Field((1, 4, 8), description="The k of pass@k (each at most --eval-samples).")
    seed: int = Field(0, description="Seeds data order and the held-out choice, sampling and the learner.")

    @field_validator("base")
    @classmethod
    def _base_directory(cls, model: str | None) -> str | None:
        """The learner loads the base here, and this run serves it."""
        return _model_directory(model)

    @field_validator("theta_urls", "t_urls", mode="before")
    @classmethod
    def _server_urls(cls, urls: object) -> object:
        """Checked as the coordinator checks them, before the run loads anything."""
        from coordinator.config import CoordinatorConfig

        return CoordinatorConfig._url_list(urls)

    @field_validator("teacher")
    @classmethod
    def _teacher_directory(cls, model: str | None) -> str | None:
        return model if model in SELF_TEACHERS else _model_directory(model)

    @model_validator(mode="after")
    def _task_is_consistent(self) -> TaskConfig:
        from training.rewards import reward_spec

        reward_spec(self.reward, self.reward_weights, length_budget=self.length_budget,
                    format_pattern=self.format_pattern)
        given = self.model_fields_set
        if "eval_dataset" in given and "dataset" not in given:
            raise ValueError("--eval-dataset is held out of a --dataset; give --dataset too (without it the "
                             "bundled task and its own test split are used)")
        for name, reward in (("length_budget", "length"), ("format_pattern", "format")):
            if name in given and reward not in self.reward:
                raise ValueError(f"{flag(name)} applies to the {reward} reward, which --reward does not name; "
                                 f"add {reward} to --reward or drop {flag(name)}")
        if self.chat_template not in (None, "tokenizer") and not Path(self.chat_template).is_file():
            raise ValueError(f"--chat-template {self.chat_template!r} is neither 'tokenizer' nor a template file")
        if self.theta_urls and "replicas" in given:
            raise ValueError("--replicas starts servers and --theta-urls names running ones; give one of them")
        if bool(self.theta_urls) != bool(self.t_urls) and not (self.theta_urls and self.teacher == "self"):
            raise ValueError("--theta-urls and --t-urls name the running base and teacher servers: give both "
                             "(or --teacher self with --theta-urls alone)")
        if self.teacher == "self" and (self.replicas > 1 or len(self.theta_urls) > 1 or self.t_urls):
            raise ValueError("--teacher self samples the teacher from the one base server; with several base "
                             "replicas, serve the starting weights as the teacher (--teacher self-frozen) instead")
        if too_large := [k for k in self.pass_k if k > self.eval_samples]:
            if "pass_k" in given:
                raise ValueError(f"--pass-k {too_large} needs at least {max(too_large)} --eval-samples per problem")
        return self

    @property
    def pass_ks(self) -> tuple[int, ...]:
        """The k of pass@k this config can estimate (those within eval_samples)."""
        return tuple(k for k in self.pass_k if k <= self.eval_samples)


def _model_directory(model: str | None) -> str | None:
    if model is not None and not (Path(model).expanduser() / "config.json").is_file():
        raise ValueError(f"{model!r} is not a model directory (no config.json in it); give a Hugging Face "
                         "checkpoint directory")
    return model


class TrainConfig(TaskConfig):
    """Training on q* rollouts (GRPO or DPO): sampling, the update, weight pushes, checkpoints."""

    output_dir: Path = Field(description="Checkpoints, pushed weights, metrics.jsonl and the run's config go here.")
    engine: Literal["vllm", "transformers"] = Field(
        "vllm", description="vllm: sample from vLLM servers, pushing every update into the base's; transformers: "
                            "sample in this process from the learner's live weights and the teacher loaded beside "
                            "it (no server, no push: small models and fast sweeps; training/inprocess.py).")
    method: Method = Field(
        "grpo", description="grpo: streaming GRPO with verified weight pushes; sft: fine-tuning on teacher samples "
                            "(alpha = 1); rft: fine-tuning on the verified q* rollouts (rejection fine-tuning); opd: "
                            "on-policy distillation (the base samples, the teacher scores each token); distill: the "
                            "distillation term alone on the states the rollouts visit (q*, or --fixed-alpha); dpo: TRL "
                            "DPO on pairs mined from q* rollouts. All but dpo stream with pushes, and take "
                            "--distill-coef.")
    steps: int = Field(200, ge=1, description="Learner updates to run.")
    prompts_per_step: int = Field(8, ge=1, description="Prompts per update; each gets group_size rollouts.")
    group_size: int = Field(
        8, ge=1, description="Rollouts per prompt (G): grpo's advantages compare a prompt's rollouts (G >= 2); the "
                             "other methods take G = 1 (more distinct prompts per update).")
    fixed_alpha: float | None = Field(
        None, ge=0, le=1, description="None = sample from q* (alpha* per token); 0 = on-policy (base only); 1 = teacher only.")
    learning_rate: float = Field(2e-4, gt=0, description="AdamW learning rate (1e-3 collapsed every arm on the bundled base).")
    correction: Correction = Field(
        "sequence", description="Off-policy correction for q* rollouts: sequence (self-normalized per group), token "
                                "(truncated per-token pi/q*; did not lift the bundled base, see benchmarks/README.md) "
                                "or none (biased toward q*: for tasks the base almost never solves, see "
                                "benchmarks/README.md).")
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
    eval_every: int = Field(20, ge=1, description="Evaluate the base on the held-out prompts every N updates (and at start and end).")
    curriculum: bool = Field(
        False, description="Pick prompts by difficulty: per-prompt reward EMA, buckets at the valleys of a KDE over "
                           "them, hard buckets drawn more, prompts whose group scored all alike skipped for a while "
                           "(training/curriculum.py).")
    opd_coef: float | None = Field(
        None, ge=0, description="Weight c of on-policy distillation's per-token advantage -c (log pi_theta(y_t) - log "
                                "pi_t(y_t)) (training/distill.py), added to the reward advantages; None = 1 under "
                                "--method opd, else 0 (off).")
    distill_coef: float | None = Field(
        None, ge=0, description="Weight of the distillation term: JSD_beta between the teacher's top-k (+ a tail "
                                "bucket) and the learner at every visited state (GKD; training/distill.py); None = 1 "
                                "under --method distill, else 0 (off).")
    distill_beta: float = Field(
        0.0, ge=0, le=1, description="That divergence's beta, as TRL's: 0 = forward KL(teacher || learner), "
                                     "1 = reverse KL, between them the generalized JSD.")
    on_policy_rollouts: int = Field(
        0, ge=0, description="Pooled groups: of each prompt's --group-size rollouts, this many are sampled "
                             "on-policy (alpha = 0), the rest from q*; advantages over the pooled group (LUFFY).")
    guided_shaping: float | None = Field(
        None, gt=0, description="LUFFY's shaping f(p) = p / (p + gamma) on the tokens of the q* rollouts of pooled "
                                "groups, with this gamma (0.1 in the paper), in place of their importance weight; "
                                "None = off.")
    rft_min_reward: float = Field(1.0, description="--method rft: rollouts whose reward reaches this are trained on.")
    stop_at_accuracy: float | None = Field(
        None, gt=0, le=1, description="Stop early once held-out greedy accuracy reaches this at two evaluations in a "
                                      "row (sweeps); None = run all --steps.")
    stop_without_signal: int | None = Field(
        None, ge=1, description="Stop at update N if every group so far had zero advantage (all its rollouts scored "
                                "alike, so GRPO had nothing to learn from); None = never (sweeps).")
    alpha_decay_steps: int | None = Field(
        None, ge=1, description="Alpha schedule: alpha* is capped at --alpha-cap-start x (1 - u / N) at update u, "
                                "reaching 0 (on-policy) after N updates (Logit Fusion's decay, as a cap); None = no cap.")
    alpha_cap_start: float = Field(1.0, ge=0, le=1, description="The schedule's cap at the first update.")
    dpo_beta: float = Field(0.1, gt=0, description="DPO: strength of the implicit KL to the starting model (TRL's beta).")
    dpo_epochs: int = Field(1, ge=1, description="DPO: passes over the mined preference pairs.")

    @model_validator(mode="after")
    def _no_option_without_effect(self) -> TrainConfig:
        """Options set explicitly that the chosen method or mode never reads are refused with the fix."""
        given = self.model_fields_set
        unused = GRPO_ONLY if self.method == "dpo" else DPO_ONLY
        if wasted := [flag(n) for n in unused if n in given]:
            other = "grpo" if self.method == "dpo" else "dpo"
            raise ValueError(f"{', '.join(wasted)} only apply to --method {other}; drop them, or pass --method {other}")
        if wasted := [flag(n) for n in UNREAD_BY.get(self.method, ()) if n in given]:
            raise ValueError(f"--method {self.method} does not read {', '.join(wasted)} (options of grpo's policy "
                             "gradient); drop them")
        for name, method in METHOD_ONLY.items():
            if name in given and self.method != method:
                raise ValueError(f"{flag(name)} applies to --method {method}; drop it or pass --method {method}")
        implied = METHOD_ALPHA.get(self.method)
        if implied is not None and "fixed_alpha" in given and self.fixed_alpha != implied:
            raise ValueError(f"--method {self.method} samples at alpha = {implied:g}; drop --fixed-alpha")
        if self.on_policy_rollouts >= self.group_size:
            raise ValueError(f"--on-policy-rollouts {self.on_policy_rollouts} leaves no q* rollout in groups of "
                             f"{self.group_size}; give fewer than --group-size")
        if self.on_policy_rollouts and self.fixed_alpha == 0.0:
            raise ValueError("--on-policy-rollouts pools on-policy with q* rollouts, and --fixed-alpha 0 makes every "
                             "rollout on-policy; drop one of them")
        if self.guided_shaping is not None and not self.on_policy_rollouts:
            raise ValueError("--guided-shaping shapes the q* rollouts of pooled groups; set --on-policy-rollouts too")
        if self.method in ("grpo", "dpo") and self.group_size < 2:
            raise ValueError(f"--method {self.method} compares a prompt's rollouts: give --group-size >= 2, or use "
                             "--method sft, rft, opd or distill")
        if self.method == "distill" and self.distill_coef == 0:
            raise ValueError("--method distill trains on the distillation term alone: --distill-coef 0 leaves nothing "
                             "to learn; drop it (1) or give a positive weight")
        if self.method == "opd" and self.opd_coef == 0:
            raise ValueError("--method opd trains on the teacher's per-token advantages alone: --opd-coef 0 leaves "
                             "nothing to learn; drop it (1) or give a positive weight")
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
        if self.alpha_decay_steps is not None and self.sampling_alpha is not None:
            raise ValueError(f"--alpha-decay-steps caps alpha*, and these rollouts are sampled at a fixed alpha "
                             f"({self.sampling_alpha:g}); drop one of them")
        if "alpha_cap_start" in given and self.alpha_decay_steps is None:
            raise ValueError("--alpha-cap-start starts the alpha schedule; give --alpha-decay-steps too")
        if self.distill_beta and not self.distillation_coef:
            raise ValueError("--distill-beta shapes the distillation term, which --distill-coef 0 turns off; "
                             "give --distill-coef > 0 or drop --distill-beta")
        if self.engine == "transformers":
            if server_options := [flag(n) for n in ("theta_urls", "t_urls", "replicas", "lockstep") if n in given]:
                raise ValueError(f"--engine transformers samples in this process; {', '.join(server_options)} "
                                 "name or start servers: drop them or use --engine vllm")
            if self.method == "dpo":
                raise ValueError("--method dpo samples and evaluates on servers; use --engine vllm")
        if self.method == "dpo" and self.theta_urls:
            raise ValueError("--method dpo evaluates the trained model on servers it starts for it; running servers "
                             "(--theta-urls, --t-urls) are for grpo, which pushes weights into them: drop them")
        return self


    @property
    def sampling_alpha(self) -> float | None:
        """The rollouts' fixed alpha: the method's own (sft 1, opd 0), else --fixed-alpha (None = alpha*)."""
        return METHOD_ALPHA.get(self.method, self.fixed_alpha)

    def alpha_cap(self, step: int) -> float | None:
        """The alpha schedule's cap for rollouts sampled after `step` updates (None: no schedule)."""
        if self.alpha_decay_steps is None:
            return None
        return self.alpha_cap_start * max(0.0, 1.0 - step / self.alpha_decay_steps)

    @property
    def distillation_coef(self) -> float:
        """The weight of the distillation term (distill_coef resolved)."""
        if self.distill_coef is not None:
            return self.distill_coef
        return 1.0 if self.method == "distill" else 0.0

    @property
    def teacher_advantage_coef(self) -> float:
        """The weight of on-policy distillation's per-token advantage (opd_coef resolved)."""
        if self.opd_coef is not None:
            return self.opd_coef
        return 1.0 if self.method == "opd" else 0.0


class EvalConfig(TaskConfig):
    """`dualvllm eval`: greedy accuracy and pass@k of the base alone, q* and the teacher alone."""

    arms: tuple[Arm, ...] = Field(("base", "q*", "teacher"), description="What to evaluate: base (alpha = 0), q* "
                                                                       "(alpha*), teacher (alpha = 1).")
    eval_samples: int = Field(8, ge=0, description="Samples per problem for pass@k at --temperature; 0 = greedy only.")
    output: Path | None = Field(None, description="Write the report here as JSON too.")
