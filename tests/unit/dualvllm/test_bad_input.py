"""Every bad input the command line and the Python API refuse, with the message each gets.

Each CLI case runs `dualvllm.cli.main` in this process and must end with exit code 2 and
one line on stderr, before any server is started or contacted: starting a server or
entering a coordinator fails the test. The Python API cases raise InvalidInputError (or
the error tree's class named) with the message shown.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Callable

import pytest

from dualvllm.common.errors import DualVLLMError, InvalidInputError, LifecycleError
from dualvllm.coordinator.config import CoordinatorConfig
from dualvllm.coordinator.core import DualVLLMCoordinator, _params
from dualvllm.coordinator.sequence import SamplingParams
from dualvllm.coordinator.prompts import split_prompt
from dualvllm import cli
from dualvllm.engines.launcher import ServerConfig, VLLMServer, free_port
from tests.recipes import TINY_ARITH

GOOD_LINE = '{"prompt": "12+34="}\n'
# (id, input file content or None for the good one, arguments after the subcommand, message)
GENERATE = [
    ("input-missing", None, "--input {tmp}/missing.jsonl", r"cannot read the input .*missing\.jsonl: No such file"),
    ("input-is-a-directory", None, "--input {tmp}", r"cannot read the input .*: Is a directory"),
    ("input-not-utf8", b'{"prompt": "ab\xff"}\n', "", r"in\.jsonl:1: not UTF-8 text \(byte 0xff at column 15\)"),
    ("input-empty", "\n\n", "", r"has no prompts"),
    ("line-not-json", GOOD_LINE + "{prompt: 1}\n", "", r"in\.jsonl:2: not valid JSON"),
    ("line-not-an-object", "[1, 2]\n", "", r"in\.jsonl:1: each line must be a JSON object"),
    ("prompt-of-bools", '{"prompt": [true]}\n', "", r"in\.jsonl:1: a prompt must be .* got \[True\]"),
    ("prompt-a-number", '{"prompt": 12}\n', "", r"in\.jsonl:1: a prompt must be .* got 12"),
    ("prompt-empty", '{"prompt": ""}\n', "", r"in\.jsonl:1: the prompt is empty"),
    ("prompt-negative-id", '{"prompt": [1, -2]}\n', "", r"got \[1, -2\]"),
    ("pair-half-empty", '{"theta_prompt": "ab", "t_prompt": ""}\n', "", r"in\.jsonl:1: the prompt is empty"),
    ("pair-incomplete", '{"theta_prompt": "ab"}\n', "", r'needs "prompt", or both "theta_prompt" and "t_prompt"'),
    ("id-repeated", '{"id": 1, "prompt": "a"}\n{"id": "1", "prompt": "b"}\n', "",
     r"in\.jsonl:2: id '1' already used on line 1"),
    ("id-a-bool", '{"id": true, "prompt": "a"}\n', "", r'"id" must be a string or an integer'),
    ("output-is-a-directory", None, "--output {tmp}", r"--output .* is a directory; give a file path"),
    ("output-under-a-file", None, "--output {tmp}/in.jsonl/out.jsonl", r"cannot write the output .*: .*in\.jsonl is a file, not a folder"),
    ("output-is-the-input", None, "--output {tmp}/in.jsonl", r"is the input file"),
    ("temperature-negative", None, "--temperature -1", r"temperature must be a finite number >= 0"),
    ("max-tokens-zero", None, "--max-tokens 0", r"max_tokens must be a positive integer, got 0"),
    ("fixed-alpha-above-1", None, "--fixed-alpha 1.5", r"fixed_alpha must be in \[0, 1\]"),
    ("stop-empty", None, "--stop=", r"stop strings must be non-empty strings"),
    ("top-k-zero", None, "--top-k 0", r"invalid CoordinatorConfig: top_k=0: Input should be greater than or equal to 1"),
    ("url-not-http", None, "--theta-url ftp://host:1", r"theta_url='ftp://host:1': .* must start with http://"),
    ("urls-the-same", None, "--theta-url http://127.0.0.1:9 --t-url http://127.0.0.1:9",
     r"--theta-url and --t-url are one server, .* every line needs a theta_prompt and a t_prompt that differ"),
    ("max-batch-size-zero", None, "--max-batch-size 0", r"max_batch_size=0: Input should be greater than or equal"),
    ("base-not-a-directory", None, "--base {tmp}/no-such-model",
     r"model '.*no-such-model' is not a Hugging Face model directory"),
    ("in-process-engine-with-urls", None, "--engine transformers", r"--engine transformers .* drop the server URLs"),
]
# (id, arguments after `dualvllm`, message)
OTHER_COMMANDS = [
    ("demo-no-prompts", "demo --num-prompts 0", r"--num-prompts must be at least 1, got 0"),
    ("demo-temperature-negative", "demo --temperature -0.5", r"temperature must be a finite number >= 0"),
    ("serve-dev-mode-on-a-public-host", "serve --host 0.0.0.0 --dev-mode", r"dev_mode exposes /collective_rpc .* "
                                                                            r"host='0.0.0.0' is not loopback"),
    ("serve-model-missing", "serve --teacher ./no-such-dir", r"'./no-such-dir' is not a Hugging Face model directory"),
    ("serve-no-replicas", "serve --replicas 0", r"--replicas must be at least 1, got 0"),
    ("serve-workers-in-dev-mode", "serve --workers 2 --dev-mode",
     r"dev_mode with workers=2: a weight push through one worker would pause its own sequences"),
    ("serve-workers-in-process", "serve --workers 2 --engine transformers",
     r"--workers 2 with --engine transformers: each worker would load both models again"),
    ("serve-no-workers", "serve --workers 0", r"workers=0: Input should be greater than or equal to 1"),
    ("serve-workers-without-an-endpoint", "serve --servers-only --workers 2",
     r"--workers 2 runs endpoint processes, and --servers-only starts no endpoint"),
    ("serve-replicas-speculative", "serve --replicas 2 --speculative-gamma 4", r"replica pools .* not speculative"),
    ("train-replicas-and-urls", "train --replicas 2 --theta-urls http://127.0.0.1:9 --t-urls http://127.0.0.1:8",
     r"--replicas starts servers and --theta-urls names running ones"),
    ("train-url-not-http", "train --theta-urls ftp://h:1 --t-urls http://h:2", r"'ftp://h:1' must start with http://"),
    ("train-base-urls-alone", "train --theta-urls http://127.0.0.1:9", r"give both \(or --teacher self"),
    ("train-self-teacher-replicas", "train --teacher self --replicas 2", r"with several base replicas, serve the starting"),
    ("train-dpo-on-running-servers", "train --method dpo --theta-urls http://127.0.0.1:9 --t-urls http://127.0.0.1:8",
     r"--method dpo evaluates the trained model on servers it starts"),
    ("train-lora-alpha-without-rank", "train --lora-alpha 8", r"--lora-alpha scales LoRA adapters, and lora_rank is 0"),
    ("train-is-cap-under-sequence", "train --is-cap 3", r"--is-cap applies to --correction token"),
    ("train-share-cap-under-token", "train --correction token --share-cap 2",
     r"--share-cap applies to --correction sequence"),
    ("train-dpo-option-under-grpo", "train --dpo-beta 0.2 --dpo-epochs 2",
     r"--dpo-beta, --dpo-epochs are options of --method dpo; drop them or pass --method dpo"),
    ("train-grpo-option-under-dpo", "train --method dpo --kl-coef 0.1",
     r"--kl-coef is an option of --method grpo or opd; drop it or pass one of those methods"),
    ("train-dpo-resume", "train --method dpo --resume", r"--resume applies to grpo runs"),
    ("train-zero-steps", "train --steps 0", r"steps=0: Input should be greater than or equal to 1"),
    ("train-greedy-rollouts", "train --temperature 0", r"temperature=0.0: Input should be greater than 0"),
    ("train-eval-every-past-the-end", "train --steps 4 --eval-every 10", r"--eval-every 10 is more than --steps 4"),
    ("train-base-missing", "train --base {tmp}/nothing",
     r"invalid GRPOTrainConfig: base=.*: '.*nothing' is not a model directory"),
    ("train-sft-with-a-correction", "train --method sft --correction token",
     r"--correction is an option of --method grpo or adaptive; drop it or pass one of those methods"),
    ("train-stop-without-signal-under-sft", "train --method sft --stop-without-signal 100",
     r"--stop-without-signal is an option of --method grpo"),
    ("train-eval-fraction-out-of-range", "train --eval-fraction 1.5", r"eval_fraction=1.5: Input should be less than 1"),
    ("train-opd-at-a-chosen-alpha", "train --method opd --fixed-alpha 0.5",
     r"--fixed-alpha is an option of --method grpo, rft, distill or dpo; drop it or pass one of those methods"),
    ("train-pooled-groups-without-q", "train --group-size 4 --on-policy-rollouts 4",
     r"--on-policy-rollouts 4 leaves no q\* rollout in groups of 4"),
    ("train-shaping-without-pooled-groups", "train --guided-shaping 0.1",
     r"--guided-shaping shapes the q\* rollouts of pooled groups; set --on-policy-rollouts"),
    ("train-distill-beta-without-the-term", "train --distill-beta 0.5", r"--distill-coef 0 turns off"),
    ("train-opd-without-weight", "train --method opd --opd-coef 0", r"--opd-coef 0 leaves nothing to learn"),
    ("train-rft-threshold-under-grpo", "train --rft-min-reward 0.5",
     r"--rft-min-reward is an option of --method rft; drop it or pass --method rft"),
    ("train-in-process-with-servers", "train --engine transformers --theta-urls http://127.0.0.1:9 --t-urls "
     "http://127.0.0.1:8", r"--engine transformers samples in this process; --theta-urls, --t-urls name or start"),
    ("train-alpha-schedule-at-a-fixed-alpha", "train --fixed-alpha 0.5 --alpha-decay-steps 100",
     r"--alpha-decay-steps caps alpha\*, and these rollouts are sampled at a fixed alpha \(0.5\)"),
    ("train-alpha-schedule-under-sft", "train --method sft --alpha-decay-steps 100",
     r"--alpha-decay-steps is an option of --method grpo, rft or distill"),
    ("train-completions-past-the-positions", "train --max-tokens 512",
     r"--max-tokens 512 does not fit the 64 positions of .*base, .*; lower --max-tokens \(the bundled models: "
     r"--config recipes/tiny-arith.yaml\)"),
    ("train-micro-batch-above-the-batch", "train --prompts-per-step 4 --group-size 4 --micro-batch-size 32",
     r"--micro-batch-size 32 is more than the 16 rollouts of an update"),
    ("train-recipe-missing", "train --config {tmp}/nothing.yaml", r"--config .*nothing.yaml: no such recipe file"),
    ("eval-completions-past-the-positions", "eval --max-tokens 64", r"--max-tokens 64 does not fit the 64 positions"),
]


@pytest.fixture
def no_servers(monkeypatch):
    """Starting a server or entering a coordinator fails the test: refusals must come first."""
    def refuse(*args, **kwargs):
        raise AssertionError("a bad input reached a server")

    monkeypatch.setattr(VLLMServer, "start", refuse)
    monkeypatch.setattr(DualVLLMCoordinator, "__aenter__", refuse)


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    code = cli.main(argv)
    return code, capsys.readouterr().err


def assert_one_line_error(code: int, stderr: str, message: str) -> None:
    assert code == 2, stderr
    assert stderr.startswith("dualvllm: error: ") and stderr.strip().count("\n") == 0, stderr
    assert re.search(message, stderr), stderr


@pytest.mark.parametrize("content, extra, message", [c[1:] for c in GENERATE], ids=[c[0] for c in GENERATE])
def test_generate_refuses_before_any_server(tmp_path, capsys, no_servers, content, extra, message):
    source = tmp_path / "in.jsonl"
    source.write_bytes(content if isinstance(content, bytes) else (content or GOOD_LINE).encode())
    closed = f"http://127.0.0.1:{free_port()}"
    argv = ["generate", "--input", str(source), "--output", str(tmp_path / "out" / "o.jsonl"),
            "--theta-url", closed + "/theta", "--t-url", closed + "/t", *extra.format(tmp=tmp_path).split()]
    # argparse keeps the last of a repeated flag, so a case's own --input/--output/--*-url wins.
    assert_one_line_error(*run_cli(argv, capsys), message)


@pytest.mark.parametrize("args, message", [c[1:] for c in OTHER_COMMANDS], ids=[c[0] for c in OTHER_COMMANDS])
def test_other_commands_refuse_before_any_server(tmp_path, capsys, no_servers, args, message):
    argv = args.format(tmp=tmp_path).split()
    if argv[0] == "train":  # the bundled models' recipe first: a case's own --config wins (argparse keeps the last)
        argv[1:1] = ["--config", str(TINY_ARITH), "--output-dir", str(tmp_path / "run")]
    assert_one_line_error(*run_cli(argv, capsys), message)
    assert not (tmp_path / "run").exists()  # a refused run writes nothing


def test_serve_on_a_port_in_use_refuses_before_any_server(capsys, no_servers):
    """A second `dualvllm serve` on the default port once started both servers (~40 s) and then
    died in aiohttp's traceback: the port is now taken first."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        code, stderr = run_cli(["serve", "--service-port", str(port)], capsys)
    assert_one_line_error(code, stderr, rf"address 127\.0\.0\.1:{port} is in use .* --service-port 0 to pick one")


def _open_coordinator_twice() -> None:
    async def go() -> None:
        coordinator = DualVLLMCoordinator(CoordinatorConfig())
        await coordinator.generate_batch(["ab"], max_tokens=1)

    asyncio.run(go())


# (id, a call that must raise, the error class, message)
PYTHON_API: list[tuple[str, Callable[[], object], type[DualVLLMError], str]] = [
    ("config-unknown-option", lambda: CoordinatorConfig(topk=5), InvalidInputError, r"unknown option 'topk'"),
    ("config-batch-above-request-limit", lambda: CoordinatorConfig(max_batch_size=2048, max_prompts_per_request=1024),
     InvalidInputError, r"max_batch_size=2048 is above max_prompts_per_request=1024"),
    ("server-dev-mode-public", lambda: ServerConfig(model="m", host="0.0.0.0", dev_mode=True), InvalidInputError,
     r"is not loopback"),
    ("sampling-max-tokens-bool", lambda: SamplingParams(True), InvalidInputError, r"max_tokens must be a positive"),
    ("sampling-temperature-nan", lambda: SamplingParams(4, temperature=float("nan")), InvalidInputError,
     r"temperature must be a finite number"),
    ("sampling-fixed-alpha-string", lambda: SamplingParams(4, fixed_alpha="0.5"), InvalidInputError,
     r"fixed_alpha must be in \[0, 1\]"),
    ("sampling-stop-token-bool", lambda: SamplingParams(4, stop_token_ids=[True]), InvalidInputError,
     r"stop_token_ids must be token ids"),
    ("sampling-params-and-keywords", lambda: _params(SamplingParams(4), {"temperature": 0.5}), InvalidInputError,
     r"got a SamplingParams and sampling keywords \(temperature\)"),
    ("prompt-tuple-of-three", lambda: split_prompt(3, ("a", "b", "c")), InvalidInputError,
     r"prompt 3: a tuple prompt must be \(theta_prompt, t_prompt\), got 3 items"),
    ("train-unknown-method", lambda: _train_config(method="ppo"), InvalidInputError, r"method='ppo': Input should be"),
    ("coordinator-not-entered", _open_coordinator_twice, LifecycleError, r"use `async with DualVLLMCoordinator"),
]


def _train_config(**values: object) -> object:
    from dualvllm.training.config import TrainConfig

    return TrainConfig.parse(config_file=TINY_ARITH, output_dir=Path("unused"), **values)


@pytest.mark.parametrize("call, error, message", [c[1:] for c in PYTHON_API], ids=[c[0] for c in PYTHON_API])
def test_python_api_refuses(call, error, message):
    with pytest.raises(error, match=message) as info:
        call()
    assert "\n" not in str(info.value)


def test_the_table_covers_at_least_25_kinds():
    assert len(GENERATE) + len(OTHER_COMMANDS) + len(PYTHON_API) >= 25


def test_config_json_records_the_method(tmp_path):
    from dualvllm.training.config import TrainConfig

    config = TrainConfig.parse(config_file=TINY_ARITH, output_dir=tmp_path, method="dpo", dpo_beta=0.3)
    assert json.loads(config.model_dump_json())["method"] == "dpo"
