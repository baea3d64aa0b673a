"""`dualvllm train` and `dualvllm eval` on user data, rewards and teachers, against real vLLM servers.

The bundled tiny models know only "a+b=" arithmetic; these runs check the plumbing of
GSM8K-format and code datasets, chat templates, user reward functions and the
privileged-information teacher end to end, not accuracy.
"""

from __future__ import annotations

import json

from tests.integration.test_cli import dualvllm
from tests.recipes import TINY_ARITH
from dualvllm.tinymodels.task import problems

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}{% endif %}")


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def run(command: str, *args: str, timeout: int = 900) -> str:
    """`dualvllm COMMAND` with the bundled models' recipe and `args` over it."""
    process = dualvllm(command, "--config", str(TINY_ARITH), *args)
    stdout, stderr = process.communicate(timeout=timeout)
    assert process.returncode == 0, stderr[-3000:]
    return stdout


def test_gsm8k_format_with_a_chat_template_a_user_reward_and_the_base_as_its_own_teacher(dev_pair, tmp_path):
    """On a running base alone (--theta-urls, no --t-urls): with --teacher self it plays both roles."""
    theta, _ = dev_pair
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({"question": p.prompt, "answer": f"reversed sum\n#### {p.answer}"}) + "\n"
                            for p in problems("train", n=40)))
    (tmp_path / "chat.jinja").write_text(CHAT_TEMPLATE)
    out = tmp_path / "run"
    stdout = run("train", "--output-dir", str(out), "--dataset", str(data), "--prompt-template", "{question}",
                 "--chat-template", str(tmp_path / "chat.jinja"),
                 "--reward", "gsm8k", "tests.integration.user_rewards:starts_with_a_digit", "--reward-weights", "1",
                 "0.5", "--teacher", "self", "--teacher-template", "{answer} {prompt}", "--steps", "2",
                 "--prompts-per-step", "2", "--group-size", "4", "--eval-prompts", "8", "--eval-samples", "2",
                 "--pass-k", "1", "2", "--max-tokens", "4", "--theta-urls", theta.url)
    assert "2 steps" in stdout
    config = json.loads((out / "config.json").read_text())
    assert config["teacher"] == "self" and config["reward"] == ["gsm8k", "tests.integration.user_rewards:starts_with_a_digit"]
    lines = records(out / "metrics.jsonl")
    steps = [r for r in lines if "event" not in r]
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:  # each named reward is logged on its own
        assert 0.0 <= record["reward/gsm8k"] <= 1.0
        assert 0.0 <= record["reward/tests.integration.user_rewards:starts_with_a_digit"] <= 1.0
        assert record["push_verified_by"] in ("digest", "digest+probe") and record.get("push_max_abs_diff", 0) < 1e-3
    evals = [r for r in lines if r.get("event") == "eval"]
    assert len(evals) == 2 and all({"held_out_accuracy", "held_out_pass@1", "held_out_pass@2"} <= set(r) for r in evals)
    assert config["theta_urls"] == [theta.url] and not config["t_urls"]  # the base served both roles


def test_a_code_dataset_scored_in_the_sandbox(tmp_path):
    """On the in-process engine (--engine transformers): the data and the sandbox's scores are
    what this checks, and it starts no server."""
    data = tmp_path / "code.jsonl"
    # A completion that is valid Python passes the first two tests and fails the third: reward 2/3.
    tests = ["assert True", "assert 1 + 1 == 2", "assert solve(1) == 2"]
    data.write_text("".join(json.dumps({"prompt": p.prompt, "tests": tests}) + "\n" for p in problems("train", n=30)))
    out = tmp_path / "run"
    run("train", "--output-dir", str(out), "--dataset", str(data), "--reward", "code", "--steps", "2",
        "--prompts-per-step", "2", "--group-size", "4", "--eval-prompts", "6", "--max-tokens", "4",
        "--engine", "transformers")
    assert not list(out.glob("*.log"))  # no server was started (their logs go there)
    steps = [r for r in records(out / "metrics.jsonl") if "event" not in r]
    assert len(steps) == 2
    assert all(r["reward/code"] in {0.0, 2 / 3} or 0.0 < r["reward/code"] < 2 / 3 + 1e-9 for r in steps)
    assert any(r["reward/code"] > 0 for r in steps)  # digits are valid Python: some rollouts pass 2 of 3


def test_eval_reports_every_arm(vllm_pair, tmp_path):
    """On running servers (--theta-url/--t-url): eval starts none of its own."""
    theta, t = vllm_pair
    report = tmp_path / "eval.json"
    stdout = run("eval", "--theta-url", theta.url, "--t-url", t.url, "--eval-prompts", "48", "--eval-samples", "4",
                 "--pass-k", "1", "4", "--output", str(report))
    arms = {a["arm"]: a for a in json.loads(report.read_text())["arms"]}
    assert list(arms) == ["base", "q*", "teacher"] and "pass@4" in stdout
    assert arms["teacher"]["greedy_accuracy"] > arms["base"]["greedy_accuracy"]
    for arm in arms.values():
        assert arm["pass_at"]["1"] <= arm["pass_at"]["4"] and arm["tasks"] == 48


def test_bad_data_is_refused_before_any_server(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"question": "1+1="}) + "\n")
    process = dualvllm("train", "--config", str(TINY_ARITH), "--output-dir", str(tmp_path / "run"),
                       "--dataset", str(data), "--prompt-template", "{question}")
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 2
    assert f"{data}:1: no 'answer' field, which the reward needs" in stderr
    assert not (tmp_path / "run").exists()
