"""TaskConfig: what a run samples and how it scores it, shared by `dualvllm train` and `dualvllm eval`.

The models, the data, the prompts, the rewards, the sampling, the held-out evaluation,
the servers and the coordinator's options (`coordinator`, embedded whole). The training
and evaluation configs built on it are in training/config.py. Besides each field's bounds,
a task is checked against the model directories it names: a completion of `max_tokens`
must fit their positions, and values that suit only the bundled tiny models are reported
for any other base (`toy_values`). Such a base must name its teacher and its data: the
bundled ones, the defaults, suit only the bundled models.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, Field, field_validator, model_validator

from dualvllm import tinymodels
from dualvllm.common.validation import RaisesInvalidInput
from dualvllm.coordinator.config import CoordinatorConfig
from dualvllm.coordinator.sequence import SamplingParams
from dualvllm.engines import placement
from dualvllm.training.config_sources import flag

# The teacher may be the base model itself, shown the teacher's prompt: "self" on the base
# server (always the current weights), "self-frozen" on a second server with the starting weights.
SELF_TEACHERS = ("self", "self-frozen")
# Coordinator options a run sets itself, and the option of the run to set instead.
RUN_OWNED = {
    "theta_url": "theta_urls",
    "t_url": "t_urls",
    "theta_urls": "theta_urls",
    "t_urls": "t_urls",
    "top_k": "top_k",
    "seed": "seed",
}
# The bundled tiny models; a checkpoint of one has their vocabulary (see `bundled`).
BUNDLED_DIRS = (
    tinymodels.BASE_DIR,
    tinymodels.BASE_HINT_DIR,
    tinymodels.TEACHER_DIR,
    tinymodels.TEACHER_HARD_DIR,
    tinymodels.TEACHER_LONG_DIR,
    tinymodels.BASE_MIXED_DIR,
    tinymodels.TEACHER_MIXED_DIR,
)
# Values that only suit the bundled tiny models (6-token answers, 64 positions, 60k weights): on
# another base they are warned about. TRL's max_completion_length is 512; full fine-tuning of a
# real LLM runs at 1e-6 to 2e-5 (TRL's GRPOConfig and SFTConfig), and far above that diverges.
TOY_MAX_TOKENS = 32
TOY_LEARNING_RATE = 1e-4


class TaskConfig(RaisesInvalidInput, placement.ServerOptions):
    """What is sampled and how it is scored: the models, the data, the prompts and the rewards; and
    the servers' options (placement per role, dtype, context: engines/placement.py's ServerOptions)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    base: str | None = Field(None, description="Base model directory (the one trained); None = the bundled tiny base.")
    teacher: str | None = Field(
        None,
        description="Teacher model directory, or 'self' (the base server shown the teacher's prompt, always "
        "the current weights) or 'self-frozen' (the starting base on a second server); None = the "
        "bundled tiny teacher.",
    )
    dataset: Path | None = Field(
        None,
        description="Training prompts: JSONL, or a file/directory the datasets library loads (parquet, arrow, "
        "json, csv, save_to_disk); None = the bundled arithmetic task.",
    )
    eval_dataset: Path | None = Field(
        None,
        description="Held-out prompts; None = the bundled test split without --dataset, else --eval-prompts "
        "rows held out of --dataset (chosen by --seed).",
    )
    prompt_template: str | None = Field(
        None,
        description="The base prompt as a format string over each row's fields, e.g. '{question}'; None = the "
        "row's prompt, messages or theta_prompt.",
    )
    teacher_template: str | None = Field(
        None,
        description="The teacher's prompt as a format string over the row's fields and {prompt} (the base "
        "prompt), e.g. '{prompt}{answer} ' for a teacher shown the answer; None = the row's "
        "t_prompt, else the base prompt.",
    )
    chat_template: str | None = Field(
        None,
        description="'tokenizer': every prompt becomes one user message rendered with the base tokenizer's "
        "chat template; a path: that Jinja template instead (for tokenizers without one); None = "
        "prompts as they are (rows with messages use the tokenizer's template).",
    )
    reward: tuple[str, ...] = Field(
        ("exact",),
        description="Rewards, summed: exact, math, gsm8k, code, length, format, or module:function "
        "(TRL's signature); see training/rewards.py.",
    )
    reward_weights: tuple[float, ...] | None = Field(None, description="One weight per --reward; None = all 1.")
    length_budget: int | None = Field(None, ge=1, description="The length reward's budget in tokens.")
    format_pattern: str | None = Field(None, description="The format reward's regular expression.")
    reward_timeout: float = Field(
        60.0, gt=0, description="Seconds a reward may take for one batch before it scores None."
    )
    max_tokens: int = Field(
        512,
        ge=1,
        description="Longest completion sampled, in tokens (TRL's max_completion_length); the bundled "
        "models' answers take 6 (recipes/tiny-arith.yaml).",
    )
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the rollouts.")
    top_k: int = Field(20, ge=1, description="Top-k the coordinator merges per token.")
    lockstep: bool = Field(
        True,
        description="Start the servers with the lockstep plugin, so rollouts are decoded natively in lockstep "
        "(coordinator/lockstep/); a weight push takes the sequences in flight off the servers and "
        "resumes them after it, on the new weights.",
    )
    replicas: int = Field(
        1,
        ge=1,
        le=64,
        description="(base, teacher) server pairs this run starts, pooled per role: a replica that "
        "dies hands its sequences to the others, and every weight push goes to each base "
        "replica, verified (engines/pool.py).",
    )
    theta_urls: tuple[str, ...] = Field(
        (),
        description="Base servers already running (dev mode, serving --base) to sample from instead of starting "
        "any; the run first pushes its starting weights into each, then every update.",
    )
    t_urls: tuple[str, ...] = Field(
        (),
        description="Teacher servers already running (serving --teacher); needed with --theta-urls unless "
        "--teacher self, which samples the teacher from the base servers.",
    )
    eval_prompts: int = Field(200, ge=1, description="Held-out problems per evaluation (at most).")
    eval_fraction: float = Field(
        0.1,
        gt=0,
        lt=1,
        description="--dataset without --eval-dataset: the share of its rows held out, capped at "
        "--eval-prompts (at least 1 row).",
    )
    eval_samples: int = Field(
        0, ge=0, description="Samples per held-out problem for pass@k at --temperature; 0 = greedy accuracy only."
    )
    eval_group_by: str | None = Field(
        None,
        description="A row field to report held-out greedy accuracy by as well (held_out_accuracy/<value>), "
        "e.g. 'difficulty' or 'level'.",
    )
    retained_dataset: Path | None = Field(
        None,
        description="Prompts of a skill the base has and the training set does not ask for, scored greedily "
        "at every evaluation (retained_accuracy, at most --eval-prompts rows): what training "
        "makes the base forget.",
    )
    pass_k: tuple[int, ...] = Field((1, 4, 8), description="The k of pass@k (each at most --eval-samples).")
    seed: int = Field(0, description="Seeds data order and the held-out choice, sampling and the learner.")
    coordinator: CoordinatorConfig = Field(
        default_factory=CoordinatorConfig,
        description="The coordinator's options (coordinator/config.py; DUALVLLM_* variables fill those not set), set "
        "in a recipe file's coordinator: section. The run sets its servers' URLs, top_k and seed itself, "
        "from its own options, and the batch size from its batch unless this sets it.",
    )

    @field_validator("base")
    @classmethod
    def _base_directory(cls, model: str | None) -> str | None:
        """The learner loads the base here, and this run serves it."""
        return _model_directory(model)

    @field_validator("theta_urls", "t_urls", mode="before")
    @classmethod
    def _server_urls(cls, urls: object) -> object:
        """Checked as the coordinator checks them, before the run loads anything."""
        return CoordinatorConfig._url_list(urls)

    @model_validator(mode="before")
    @classmethod
    def _coordinator_leaves_the_run_its_own(cls, data: Any) -> Any:
        """A coordinator option the run sets itself is refused in the coordinator section, with the run's option."""
        section = data.get("coordinator") if isinstance(data, dict) else None
        if isinstance(section, dict) and (owned := [name for name in section if name in RUN_OWNED]):
            own = RUN_OWNED[owned[0]]
            why = (
                "points the coordinator at the servers it starts, or at those of --theta-urls/--t-urls"
                if own.endswith("urls")
                else "gives the coordinator its own"
            )
            raise ValueError(f"coordinator.{owned[0]} is the run's to set: it {why}; set {own} ({flag(own)}) instead")
        return data

    @field_validator("teacher")
    @classmethod
    def _teacher_directory(cls, model: str | None) -> str | None:
        return model if model in SELF_TEACHERS else _model_directory(model)

    @model_validator(mode="after")
    def _task_is_consistent(self) -> TaskConfig:
        from dualvllm.training.rewards import reward_spec

        reward_spec(
            self.reward, self.reward_weights, length_budget=self.length_budget, format_pattern=self.format_pattern
        )
        given = self.model_fields_set
        if "eval_dataset" in given and "dataset" not in given:
            raise ValueError(
                "--eval-dataset is held out of a --dataset; give --dataset too (without it the "
                "bundled task and its own test split are used)"
            )
        for name, reward in (("length_budget", "length"), ("format_pattern", "format")):
            if name in given and reward not in self.reward:
                raise ValueError(
                    f"{flag(name)} applies to the {reward} reward, which --reward does not name; "
                    f"add {reward} to --reward or drop {flag(name)}"
                )
        if self.chat_template not in (None, "tokenizer") and not Path(self.chat_template).is_file():
            raise ValueError(f"--chat-template {self.chat_template!r} is neither 'tokenizer' nor a template file")
        if self.theta_urls and "replicas" in given:
            raise ValueError("--replicas starts servers and --theta-urls names running ones; give one of them")
        if bool(self.theta_urls) != bool(self.t_urls) and not (self.theta_urls and self.teacher == "self"):
            raise ValueError(
                "--theta-urls and --t-urls name the running base and teacher servers: give both "
                "(or --teacher self with --theta-urls alone)"
            )
        if self.teacher == "self" and (self.replicas > 1 or len(self.theta_urls) > 1 or self.t_urls):
            raise ValueError(
                "--teacher self samples the teacher from the one base server; with several base "
                "replicas, serve the starting weights as the teacher (--teacher self-frozen) instead"
            )
        if too_large := [k for k in self.pass_k if k > self.eval_samples]:
            if "pass_k" in given:
                raise ValueError(f"--pass-k {too_large} needs at least {max(too_large)} --eval-samples per problem")
        return self

    @model_validator(mode="after")
    def _real_base_names_its_inputs(self) -> TaskConfig:
        """A base that is not a bundled model is refused without its own teacher and data: the
        bundled ones (the defaults of --teacher and --dataset) are in a 98-character vocabulary no
        real model shares, and the bundled arithmetic task with its exact reward is no real task."""
        if bundled(self.base):
            return self
        missing = []
        if self.teacher is None:
            missing.append(
                "without --teacher the teacher is the bundled tiny one, whose 98-character vocabulary the base "
                "does not share: give --teacher, a model directory with the base's tokenizer (or 'self' / "
                "'self-frozen': the base shown --teacher-template's prompt)"
            )
        if self.dataset is None:
            missing.append(
                "without --dataset the prompts are the bundled arithmetic task, scored by the exact reward: give "
                "--dataset, the prompts to train or evaluate on (JSONL, or a file/directory the datasets library "
                "loads)"
            )
        if missing:
            raise ValueError(f"--base {self.base} is not one of the bundled tiny models; {'; and '.join(missing)}")
        return self

    @model_validator(mode="after")
    def _servers_fit_their_gpus(self) -> TaskConfig:
        """What the placement options say that can be checked before the machine is known."""
        if self.theta_urls and (given := self.server_flags_given()):
            raise ValueError(
                f"{', '.join(given)} set the servers this run starts, and --theta-urls names running ones; "
                "drop one or the other"
            )
        placement.check(self, replicas=self.replicas, teacher=self.teacher != "self")
        return self

    @model_validator(mode="after")
    def _completions_fit_the_models(self) -> TaskConfig:
        """A completion of max_tokens must leave room for a prompt in every model served."""
        for model in self.served_models:
            positions = _positions(model)
            if positions is not None and self.max_tokens >= positions:
                fix = " (the bundled models: --config recipes/tiny-arith.yaml)" if bundled(model) else ""
                raise ValueError(
                    f"--max-tokens {self.max_tokens} does not fit the {positions} positions of {model}, "
                    f"prompt and completion together; lower --max-tokens{fix}"
                )
        return self

    @property
    def served_models(self) -> tuple[str, ...]:
        """The model directories this config serves: the base, and the teacher unless it is the base."""
        base = self.base or str(tinymodels.BASE_DIR)
        if self.teacher in SELF_TEACHERS:
            return (base,)
        return base, self.teacher or str(tinymodels.TEACHER_DIR)

    def toy_values(self) -> dict[str, str]:
        """The options holding a value that suits only the bundled tiny models, with what to do, when the
        base is not one of them; none for a bundled base."""
        if bundled(self.base):
            return {}
        toys = {}
        if self.max_tokens < TOY_MAX_TOKENS:
            toys["max_tokens"] = (
                f"a real model's completions are cut after {self.max_tokens} tokens; raise "
                f"--max-tokens (default {type(self).model_fields['max_tokens'].default})"
            )
        return toys

    def sampling_params(self, **overrides: Any) -> SamplingParams:
        """The run's sampling settings (--max-tokens, --temperature), with `overrides` (fixed_alpha,
        record_topk, ...): what every call that samples for the run passes to the coordinator."""
        return SamplingParams(**{"max_tokens": self.max_tokens, "temperature": self.temperature, **overrides})

    @property
    def pass_ks(self) -> tuple[int, ...]:
        """The k of pass@k this config can estimate (those within eval_samples)."""
        return tuple(k for k in self.pass_k if k <= self.eval_samples)


def _model_directory(model: str | None) -> str | None:
    if model is not None and not (Path(model).expanduser() / "config.json").is_file():
        raise ValueError(
            f"{model!r} is not a model directory (no config.json in it); give a Hugging Face checkpoint directory"
        )
    return model


def _model_config(model: str | Path) -> dict[str, Any]:
    """A model directory's config.json (the language model's part of a multimodal one); {} if unreadable."""
    try:
        config = json.loads((Path(model).expanduser() / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config.get("text_config", config) if isinstance(config, dict) else {}


def _positions(model: str | Path) -> int | None:
    """The longest sequence a model takes, as vLLM derives it from its config (RoPE scaling included)."""
    config = _model_config(model)
    positions = config.get("max_position_embeddings")
    if not isinstance(positions, int):
        return None
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    factor = scaling.get("factor") if isinstance(scaling, dict) else None
    return int(positions * factor) if isinstance(factor, (int, float)) and factor > 1 else positions


def bundled(model: str | None) -> bool:
    """Whether `model` (None: the bundled base) is a bundled tiny model or a checkpoint of one (a run
    of them, or a warm-up's): the bundled models' vocabulary is a 98-character one no real LLM has."""
    if model is None or Path(model).expanduser().resolve() in BUNDLED_DIRS:
        return True
    return _model_config(model).get("vocab_size") == _model_config(tinymodels.BASE_DIR).get("vocab_size")
