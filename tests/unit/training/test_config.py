"""The options of `dualvllm train` and `dualvllm eval`: flags over a recipe file over the defaults,
one config class per method, and the warning about values that suit only the bundled models."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import yaml

from dualvllm import tinymodels
from dualvllm.common.errors import InvalidInputError
from dualvllm.coordinator.config import CoordinatorConfig
from dualvllm import cli
from tests.recipes import QWEN_GSM8K, RECIPES, TINY_ARITH, TINY_HARD
from dualvllm.tinymodels.task import HARD_TEST, HARD_TRAIN
from dualvllm.training.config import DEFAULT_METHOD, METHOD_CLASSES, TRAIN_OPTIONS, DistillTrainConfig, EvalConfig, GRPOTrainConfig, TrainConfig
from dualvllm.training.serving import coordinator_config
from dualvllm.engines.placement import ServerOptions

# What `dualvllm train --output-dir X` resolved to before the defaults became a real LLM's
# (every field of the one TrainConfig then, but output_dir and method; written out from it).
OLD_DEFAULTS = {
    "alpha_cap_start": 1.0, "alpha_decay_steps": None, "base": None, "chat_template": None, "correction": "sequence",
    "curriculum": False, "dataset": None, "distill_beta": 0.0, "distill_coef": None, "dpo_beta": 0.1, "dpo_epochs": 1,
    "engine": "vllm", "eval_dataset": None, "eval_every": 20, "eval_fraction": 0.1, "eval_prompts": 200,
    "eval_samples": 0, "fixed_alpha": None, "format_pattern": None, "group_size": 8, "guided_shaping": None,
    "is_cap": 2.0, "keep_checkpoints": 3, "kl_coef": 0.0, "learning_rate": 0.0002, "length_budget": None,
    "lockstep": True, "lora_alpha": 32, "lora_rank": 0, "max_staleness": 1, "max_tokens": 6, "normalization": "dapo",
    "on_policy_rollouts": 0, "opd_coef": None, "pass_k": [1, 4, 8], "prompt_template": None, "prompts_per_step": 8,
    "push_every": 1, "queue_size": 2, "replicas": 1, "reward": ["exact"], "reward_timeout": 60.0,
    "reward_weights": None, "rft_min_reward": 1.0, "scale_advantages": True, "seed": 0, "share_cap": 3.0,
    "steps": 200, "stop_at_accuracy": None, "stop_without_signal": None, "t_urls": [], "teacher": None,
    "teacher_template": None, "temperature": 1.0, "theta_urls": [], "top_k": 20,
    "weight_decay": 0.01,  # torch AdamW's default, implicit then
}
OLD_EVAL_DEFAULTS = {name: value for name, value in OLD_DEFAULTS.items() if name in EvalConfig.model_fields} | {
    "arms": ["base", "q*", "teacher"], "eval_samples": 8, "output": None, "eval_group_by": None,
    "retained_dataset": None}
# The shape of an update of the methods that train on each rollout alone, their own default since
# (benchmarks/README.md, "From likelihood to accuracy (issue 24)"): 8 x 8 then, as grpo's still is.
DENSE_SHAPE = {"prompts_per_step": 64, "group_size": 1}
DENSE_METHODS = ("sft", "rft", "opd", "distill")
# The fields added since: the coordinator's options, the learner's memory options, how pushes go, and
# what the evaluation reports besides overall accuracy.
NEW_FIELDS = {"coordinator", "micro_batch_size", "gradient_checkpointing", "weights_via", "push_probe_every", "eval_group_by",
              "checkpoint_every",
              "retained_dataset", "kl_from_start_prompts", "kl_from", "learner_device", "mixed_precision",
              # --method adaptive's own (training/regimes.py)
              "guided_alpha", "probe_rollouts", "pass_rate_decay", "never_enter", "never_exit", "always_enter",
              "always_exit", "solved_weight",
              # the servers' options, shared with serve and eval (engines/placement.py)
              *ServerOptions.model_fields}


@pytest.fixture(autouse=True)
def no_coordinator_variables(monkeypatch):
    """DUALVLLM_* variables fill the coordinator's options: none may leak in from the shell."""
    import os

    for name in [n for n in os.environ if n.startswith("DUALVLLM_")]:
        monkeypatch.delenv(name)


@pytest.fixture
def real_model(tmp_path) -> Path:
    """A directory that looks like a real LLM's to the config (its config.json alone)."""
    config = json.loads((tinymodels.BASE_DIR / "config.json").read_text())
    config.update(vocab_size=151_936, max_position_embeddings=32_768)
    model = tmp_path / "Qwen-like"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    return model


def recipe(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def from_command_line(*argv: str) -> TrainConfig:
    return cli._train_config(cli._parser().parse_args(["train", *argv]))


def dumped(config) -> dict:
    return json.loads(config.model_dump_json())


@pytest.mark.parametrize("method", METHOD_CLASSES)
def test_the_tiny_arith_recipe_is_what_train_did_by_default_before(tmp_path, method):
    config = from_command_line("--config", str(TINY_ARITH), "--output-dir", str(tmp_path), "--method", method)
    values = dumped(config)

    assert type(config) is METHOD_CLASSES[method] and values.pop("method") == method
    assert values.pop("output_dir") == str(tmp_path)
    old = OLD_DEFAULTS | (DENSE_SHAPE if method in DENSE_METHODS else {})
    assert {name: values[name] for name in old if name in values} == {
        name: value for name, value in old.items() if name in values}
    # What is gone is what the method never read; what is new is the coordinator's and the learner's.
    assert not [name for name in OLD_DEFAULTS if name not in values and name in type(config).model_fields]
    assert set(values) - set(OLD_DEFAULTS) == NEW_FIELDS & set(type(config).model_fields)
    assert values["coordinator"] == dumped(CoordinatorConfig())
    if "micro_batch_size" in values:  # the whole batch at once, as the learner did
        assert values["micro_batch_size"] is None and values["gradient_checkpointing"] is False


def test_eval_reads_the_tiny_arith_recipe_as_it_read_its_old_defaults():
    values = dumped(EvalConfig.parse(config_file=TINY_ARITH))
    assert values.pop("coordinator") == dumped(CoordinatorConfig())
    servers = {name: values.pop(name) for name in ServerOptions.model_fields}  # added since, all unset
    assert servers == json.loads(ServerOptions().model_dump_json())
    assert values == OLD_EVAL_DEFAULTS  # the recipe's training options (steps, learning rate) are skipped


def test_flags_override_the_recipe_which_overrides_the_defaults(tmp_path):
    path = recipe(tmp_path, "max_tokens: 7\nsteps: 50\nlockstep: true\nreward: [exact]\n"
                            "coordinator:\n  request_timeout: 90\n  max_retries: 5\n")
    config = from_command_line("--config", str(path), "--output-dir", str(tmp_path / "run"), "--steps", "3",
                               "--no-lockstep", "--reward", "exact", "length", "--length-budget", "4")

    assert config.steps == 3 and config.lockstep is False  # flags
    assert config.reward == ("exact", "length") and config.length_budget == 4
    assert config.max_tokens == 7  # the file
    assert config.eval_every == 20 and config.learning_rate == 1e-6  # the defaults
    assert config.coordinator.request_timeout == 90 and config.coordinator.max_retries == 5
    # A flag left unset is not a value: the file's stands.
    assert from_command_line("--config", str(path), "--output-dir", str(tmp_path / "run")).lockstep is True


def test_the_method_comes_from_the_flags_else_the_file_else_the_default_distill(tmp_path):
    path = recipe(tmp_path, "max_tokens: 6\nmethod: sft\n")
    assert type(TrainConfig.parse(config_file=path, output_dir=tmp_path)) is METHOD_CLASSES["sft"]
    assert type(TrainConfig.parse(config_file=path, output_dir=tmp_path, method="rft")) is METHOD_CLASSES["rft"]
    assert type(TrainConfig.parse(config_file=TINY_ARITH, output_dir=tmp_path)) is GRPOTrainConfig  # the file's
    unnamed = TrainConfig.parse(config_file=recipe(tmp_path, "max_tokens: 6\n"), output_dir=tmp_path)
    assert type(unnamed) is METHOD_CLASSES["distill"] and DEFAULT_METHOD == "distill"
    assert unnamed.fixed_alpha is None  # at q* states


def test_a_method_takes_the_update_shape_its_table_chose_and_help_says_which(tmp_path, capsys):
    shapes = {method: TrainConfig.parse(config_file=recipe(tmp_path, "max_tokens: 6\n"), output_dir=tmp_path,
                                        method=method) for method in METHOD_CLASSES}
    # Groups for the methods that compare a prompt's rollouts; many distinct prompts for the rest.
    assert {method: (c.prompts_per_step, c.group_size) for method, c in shapes.items()} == {
        "grpo": (8, 8), "adaptive": (8, 8), "dpo": (8, 8), "sft": (64, 1), "rft": (64, 1), "opd": (64, 1),
        "distill": (64, 1)}
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for flag_name in ("--prompts-per-step", "--group-size"):
        text = help_text.split(f"{flag_name} {flag_name.lstrip('-').upper().replace('-', '_')} ", 1)[1]
        assert '"From likelihood to accuracy (issue 24)"' in text.split(" --", 1)[0]
        assert '"Defaults and where they come from"' in text.split(" --", 1)[0]
    assert "(default: 64; grpo, adaptive, dpo: 8)" in help_text and "(default: 1; grpo, adaptive, dpo: 8)" in help_text


def test_a_method_takes_its_own_learning_rate_by_default(tmp_path, real_model):
    rates = {method: TrainConfig.parse(output_dir=tmp_path, method=method, base=str(real_model), group_size=3,
                                       teacher=str(real_model), dataset=HARD_TRAIN).learning_rate
             for method in METHOD_CLASSES}
    # TRL 1.16: GRPOConfig, DPOConfig, DistillationConfig 1e-6; SFTConfig 2e-5.
    assert rates == {"grpo": 1e-6, "sft": 2e-5, "rft": 2e-5, "opd": 1e-6, "distill": 1e-6, "adaptive": 1e-6,
                     "dpo": 1e-6}


@pytest.mark.parametrize("text, message", [
    ("max_tokens: 6\ntopk: 3\n", r"unknown option 'topk'; did you mean top_k\?"),
    ("max_tokens: 6\nwarmup: 10\nfoo: 1\n", r"unknown option 'warmup' \(and 1 more\); the options are alpha_cap_start"),
    ("coordinator:\n  topk: 3\n", r"unknown option 'coordinator.topk'; did you mean coordinator.top_k\?"),
    ("coordinator: 5\n", r"'coordinator' holds coordinator options \(key: value\), got 5"),
    ("- max_tokens\n- 6\n", r"a recipe is a mapping of option: value"),
    ("max_tokens: [6\n", r"not valid YAML"),
    ("arms: [base]\n", r"unknown option 'arms'"),  # an option of eval's, not of train's
], ids=["typo", "several", "coordinator-typo", "coordinator-not-a-section", "a-list", "bad-yaml", "eval-option"])
def test_an_unknown_key_in_a_recipe_is_refused_naming_the_key_and_the_file(tmp_path, text, message):
    path = recipe(tmp_path, text)
    with pytest.raises(InvalidInputError, match=message) as info:
        TrainConfig.parse(config_file=path, output_dir=tmp_path)
    assert str(info.value).startswith(f"--config {path}: ") and "\n" not in str(info.value)


def test_a_missing_recipe_is_refused(tmp_path):
    with pytest.raises(InvalidInputError, match=r"--config .*nothing.yaml: no such recipe file"):
        TrainConfig.parse(config_file=tmp_path / "nothing.yaml", output_dir=tmp_path)


@pytest.mark.parametrize("values, message", [
    ({"method": "sft", "on_policy_rollouts": 2}, r"--on-policy-rollouts is an option of --method grpo; drop it or pass --method grpo"),
    ({"method": "opd", "correction": "token"}, r"--correction is an option of --method grpo or adaptive; drop it"),
    ({"method": "sft", "kl_coef": 0.1, "opd_coef": 3.0},
     r"--kl-coef, --opd-coef are options of --method grpo or opd; drop them or pass one of those methods"),
    ({"method": "grpo", "dpo_beta": 0.2}, r"--dpo-beta is an option of --method dpo; drop it or pass --method dpo"),
    ({"method": "dpo", "eval_every": 5, "micro_batch_size": 8},
     r"--eval-every, --micro-batch-size are options of --method grpo, sft, rft, opd, distill or adaptive"),
    ({"method": "distill", "rft_min_reward": 0.5}, r"--rft-min-reward is an option of --method rft"),
    ({"method": "sft", "fixed_alpha": 1.0}, r"--fixed-alpha is an option of --method grpo, rft, distill or dpo"),
])
def test_an_option_of_other_methods_is_refused_with_the_methods_that_take_it(tmp_path, values, message):
    with pytest.raises(InvalidInputError, match=message):
        TrainConfig.parse(config_file=TINY_ARITH, output_dir=tmp_path, **values)


def test_a_refusal_names_the_options_the_recipe_set(tmp_path):
    path = recipe(tmp_path, "max_tokens: 6\non_policy_rollouts: 2\nlora_alpha: 16\n")
    with pytest.raises(InvalidInputError, match=r"--on-policy-rollouts is an option of --method grpo; .* \(--on-policy-rollouts is set "
                                                rf"in {path}\)"):
        TrainConfig.parse(config_file=path, output_dir=tmp_path, method="sft")
    with pytest.raises(InvalidInputError, match=rf"drop --lora-alpha \(--lora-alpha is set in {path}\)"):
        TrainConfig.parse(config_file=path, output_dir=tmp_path, method="grpo")
    # A flag's value is the user's own: no note.
    with pytest.raises(InvalidInputError) as info:
        TrainConfig.parse(config_file=TINY_ARITH, output_dir=tmp_path, lora_alpha=16)
    assert "set in" not in str(info.value)


def test_the_recipe_coordinator_section_reaches_the_coordinator_but_not_what_the_run_owns(tmp_path):
    path = recipe(tmp_path, "max_tokens: 6\nseed: 3\ncoordinator:\n  request_timeout: 120\n  fill_rule: floor\n")
    config = TrainConfig.parse(config_file=path, output_dir=tmp_path, top_k=10)
    run = coordinator_config(config, batch_size=128, theta_urls=["http://127.0.0.1:9"], t_urls=["http://127.0.0.1:8"])

    assert (run.request_timeout, run.fill_rule) == (120, "floor")  # the recipe's
    assert (run.top_k, run.seed, run.theta_urls) == (10, 3, ("http://127.0.0.1:9",))  # the run's
    assert run.max_batch_size == 128  # the run's batch, as before
    assert coordinator_config(config, batch_size=8).max_batch_size == 64  # at least 64, as before
    sized = TrainConfig.parse(config_file=TINY_ARITH, output_dir=tmp_path, coordinator={"max_batch_size": 16})
    assert coordinator_config(sized, batch_size=128).max_batch_size == 16  # the recipe's, when it sets one
    for owned, instead in (("top_k", "--top-k"), ("theta_urls", "--theta-urls"), ("seed", "--seed")):
        with pytest.raises(InvalidInputError, match=rf"coordinator.{owned} is the run's to set: .* \({instead}\) "
                                                    rf"instead \(coordinator is set in {path}\)"):
            TrainConfig.parse(config_file=recipe(tmp_path, f"max_tokens: 6\ncoordinator:\n  {owned}: 5\n"),
                              output_dir=tmp_path)


def test_the_in_process_engine_owns_the_coordinator_mode(tmp_path):
    with pytest.raises(InvalidInputError, match=r"--engine transformers runs the coordinator per token .* drop "
                                                r"coordinator.mode"):
        TrainConfig.parse(config_file=TINY_ARITH, output_dir=tmp_path, engine="transformers",
                          coordinator={"mode": "lockstep"})


def test_toy_values_are_warned_about_for_a_base_that_is_not_bundled(tmp_path, real_model, caplog):
    caplog.set_level(logging.WARNING, logger="dualvllm.training")
    real = {"base": str(real_model), "teacher": str(real_model), "dataset": HARD_TRAIN}
    TrainConfig.parse(config_file=TINY_ARITH, output_dir=tmp_path, **real)

    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith(f"max_tokens=6 (set in {TINY_ARITH}) is a value for the bundled tiny models, "
                                  f"and the base {real_model} is not one of them")
    assert "raise --max-tokens (default 512)" in warnings[0]
    assert warnings[1].startswith(f"learning_rate=0.0002 (set in {TINY_ARITH})")
    assert "TRL's default for --method grpo is 1e-06: lower --learning-rate, or train LoRA adapters" in warnings[1]

    caplog.clear()  # LoRA trains at such rates; a flag's value says where it came from too
    TrainConfig.parse(config_file=TINY_ARITH, output_dir=tmp_path, **real, lora_rank=8, max_tokens=20)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("max_tokens=20 (set by --max-tokens)")

    caplog.clear()  # dualvllm eval warns too
    EvalConfig.parse(config_file=TINY_ARITH, **real)
    assert [r.getMessage()[:33] for r in caplog.records if r.levelno == logging.WARNING] == [
        f"max_tokens=6 (set in {TINY_ARITH})"[:33]]


def test_no_toy_warning_for_the_bundled_models_or_a_checkpoint_of_one(tmp_path, caplog):
    checkpoint = tmp_path / "checkpoints" / "step-000100"
    shutil.copytree(tinymodels.BASE_DIR, checkpoint)
    caplog.set_level(logging.WARNING, logger="dualvllm.training")
    TrainConfig.parse(config_file=TINY_ARITH, output_dir=tmp_path)
    TrainConfig.parse(config_file=TINY_ARITH, output_dir=tmp_path, base=str(checkpoint))
    TrainConfig.parse(config_file=TINY_ARITH, output_dir=tmp_path, base=str(tinymodels.BASE_HINT_DIR),
                      teacher="self-frozen")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("parse", [TrainConfig.parse, EvalConfig.parse], ids=["train", "eval"])
def test_a_base_that_is_not_bundled_names_its_teacher_and_data(tmp_path, real_model, parse):
    """Without them the run took the bundled teacher (another vocabulary: an error about its 64
    positions) and trained on the bundled arithmetic task with the exact reward, silently."""
    run = {"output_dir": tmp_path} if parse == TrainConfig.parse else {}
    base = str(real_model)
    with pytest.raises(InvalidInputError, match=rf"--base {base} is not one of the bundled tiny models; without "
                                                r"--teacher .* give --teacher, .*; and without --dataset the prompts "
                                                r"are the bundled arithmetic task, scored by the exact reward: give "
                                                r"--dataset"):
        parse(**run, base=base)
    with pytest.raises(InvalidInputError, match=r"not one of the bundled tiny models; without --teacher") as refused:
        parse(**run, base=base, dataset=HARD_TRAIN)
    assert "--dataset" not in str(refused.value)
    with pytest.raises(InvalidInputError, match=r"not one of the bundled tiny models; without --dataset") as refused:
        parse(**run, base=base, teacher="self")
    assert "give --teacher" not in str(refused.value)
    for teacher in (base, "self", "self-frozen"):  # the base's own teacher, or itself
        assert parse(**run, base=base, teacher=teacher, dataset=HARD_TRAIN).teacher == teacher
    # A bundled base, or a checkpoint of one, still takes the bundled teacher and task.
    assert parse(**run, base=str(tinymodels.BASE_HINT_DIR), max_tokens=6).dataset is None


def test_the_defaults_do_not_fit_the_bundled_models_and_say_which_recipe_does(tmp_path):
    with pytest.raises(InvalidInputError, match=r"--max-tokens 512 does not fit the 64 positions of .*tinymodels/base,"
                                                r" prompt and completion together; lower --max-tokens \(the bundled "
                                                r"models: --config recipes/tiny-arith.yaml\)"):
        TrainConfig.parse(output_dir=tmp_path)


def test_the_learner_memory_options_are_declared_and_bounded(tmp_path):
    config = TrainConfig.parse(config_file=TINY_ARITH, output_dir=tmp_path, method="sft", micro_batch_size=16,
                               gradient_checkpointing=True)
    assert (config.micro_batch_size, config.gradient_checkpointing) == (16, True)
    with pytest.raises(InvalidInputError, match=r"--micro-batch-size 65 is more than the 64 rollouts of an update"):
        TrainConfig.parse(config_file=TINY_ARITH, output_dir=tmp_path, micro_batch_size=65)
    with pytest.raises(InvalidInputError, match=r"micro_batch_size=0: Input should be greater than or equal to 1"):
        TrainConfig.parse(config_file=TINY_ARITH, output_dir=tmp_path, micro_batch_size=0)


def test_a_method_class_is_built_through_parse(tmp_path):
    with pytest.raises(InvalidInputError, match=r"a TrainConfig is one method's: build it with TrainConfig.parse"):
        TrainConfig(output_dir=tmp_path, max_tokens=6)


def test_the_tiny_hard_recipe_is_the_hard_task_setting_of_the_docs(tmp_path, monkeypatch):
    monkeypatch.chdir(RECIPES.parent)  # its paths are relative to the repository's root
    config = TrainConfig.parse(config_file=TINY_HARD, output_dir=tmp_path)

    assert type(config) is DistillTrainConfig and config.engine == "transformers"
    assert (config.dataset.resolve(), config.eval_dataset.resolve()) == (HARD_TRAIN, HARD_TEST)
    assert Path(config.teacher).resolve() == tinymodels.TEACHER_HARD_DIR and config.max_tokens == 5
    assert (config.steps, config.prompts_per_step, config.group_size, config.learning_rate) == (1000, 64, 1, 2e-3)
    assert (config.eval_every, config.eval_prompts, config.eval_samples, config.pass_k) == (100, 200, 8, (1, 8))
    assert config.stop_at_accuracy == 0.9


def test_the_qwen_recipe_is_a_real_run_with_no_toy_value(tmp_path, real_model, caplog):
    """Its models and data are not here: the same values over stand-ins for them."""
    values = yaml.safe_load(QWEN_GSM8K.read_text())
    assert set(values) <= set(TRAIN_OPTIONS)
    gsm8k = tmp_path / "gsm8k.jsonl"
    gsm8k.write_text(json.dumps({"question": "1+1?", "answer": "1+1=2\n#### 2"}) + "\n")
    stand_ins = {"base": str(real_model), "teacher": str(real_model), "dataset": gsm8k, "eval_dataset": gsm8k}
    caplog.set_level(logging.WARNING, logger="dualvllm.training")
    config = TrainConfig.parse(output_dir=tmp_path / "run", **(values | stand_ins))

    assert type(config) is GRPOTrainConfig and config.reward == ("gsm8k",) and config.chat_template == "tokenizer"
    assert (config.max_tokens, config.learning_rate, config.lora_rank) == (512, 1e-6, 0)
    assert (config.micro_batch_size, config.gradient_checkpointing) == (8, True)
    assert not caplog.records


def test_help_shows_the_defaults_for_a_real_model(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--max-tokens MAX_TOKENS Longest completion sampled" in text and "(default: 512)" in text
    assert "(default: 1e-06; sft, rft: 2e-05)" in text and "(default: 1000)" in text
    assert "--share-cap SHARE_CAP correction=sequence" in text and "[--method grpo]" in text
    assert "--config RECIPE.yaml" in text
    assert "Default: distill." in text  # the method, chosen from the mixed task's table


@pytest.mark.parametrize(("flag", "mode"), [({}, "auto"), ({"lockstep": False}, "per_token"), ({"lockstep": True}, "lockstep")])
def test_lockstep_flags_choose_the_decoding_mode_on_running_servers_too(tmp_path, flag, mode):
    """--no-lockstep with --theta-urls decodes per token, even on servers that carry the plugin."""
    config = TrainConfig.parse(config_file=TINY_ARITH, output_dir=tmp_path, theta_urls=("http://127.0.0.1:9",),
                               t_urls=("http://127.0.0.1:8",), **flag)
    assert coordinator_config(config, batch_size=64, theta_urls=config.theta_urls, t_urls=config.t_urls).mode == mode
