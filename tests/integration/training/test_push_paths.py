"""Pushes from a trainer whose working directory is not the server's (issue 42, part 3).

The server reads the path it is told to reload from its own working directory; a relative
path from a trainer started elsewhere once made vLLM look for a hub repo, fail the reload
halfway and die. Both trainers here run in a directory of their own with a relative output
directory, against the session's dev-mode pair (started in the test session's directory),
pushing through the disk (the path that sends a directory; a push in memory sends none), and
every push must be sent absolute and verified.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from dualvllm import tinymodels
from dualvllm.coordinator import CoordinatorConfig
from tests import processes
from tests.recipes import TINY_ARITH

datasets = pytest.importorskip("datasets")
pytest.importorskip("trl")
from dualvllm.training.trl_rollouts import QStarRollouts  # noqa: E402
from dualvllm.training.trl_sync import QStarWeightSync  # noqa: E402
from dualvllm.training.trl_trainer import QStarGRPOConfig, QStarGRPOTrainer  # noqa: E402

ROWS = [{"prompt": "57+44=", "answer": "101"}, {"prompt": "85+10=", "answer": "59"}]
# One update of 2 x 4 rollouts, two verified pushes (the start weights and the update), and the
# start-up of a Python process with torch: minutes on a shared 2-core machine, not ten.
TRAIN_TIMEOUT_S = 600.0


def server_cwd(server) -> Path:
    return Path(os.readlink(f"/proc/{server.pid}/cwd"))


def trainer_directory(tmp_path: Path, server) -> Path:
    """A new directory to train in, which is not the one the server runs in."""
    cwd = tmp_path / "trainer"
    cwd.mkdir()
    assert server_cwd(server) != cwd.resolve()
    return cwd


def exact(prompts, completions, answer, **_):
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


def test_the_trl_callback_pushes_from_a_directory_other_than_the_server_s(dev_pair, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    theta, t = dev_pair
    cwd = trainer_directory(tmp_path, theta)
    monkeypatch.chdir(cwd)
    config = QStarGRPOConfig(output_dir="runs/trl", per_device_train_batch_size=8, num_generations=4,  # as docs/trl.md
                             max_completion_length=5, max_steps=1, learning_rate=1e-3, report_to=[], use_cpu=True,
                             bf16=False, save_strategy="no", correction="none", seed=0)
    with QStarRollouts(CoordinatorConfig(theta_url=theta.url, t_url=t.url, top_k=20)) as rollouts:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = QStarGRPOTrainer(model=AutoModelForCausalLM.from_pretrained(tinymodels.BASE_DIR),
                                       reward_funcs=exact, args=config, train_dataset=datasets.Dataset.from_list(ROWS),
                                       processing_class=AutoTokenizer.from_pretrained(tinymodels.BASE_DIR),
                                       rollout_func=rollouts)
        sync = QStarWeightSync(trainer, rollouts, weights_via="disk")
        trainer.add_callback(sync)
        trainer.train()
    assert len(sync.reports) == 2  # before the first step, and after it
    for report in sync.reports:
        assert report.path.is_absolute() and report.path.parent == cwd.resolve() / "runs" / "trl" / "pushed"
        assert report.max_abs_diff <= 1e-3 and report.replicas == 1
    assert theta.running


def test_dualvllm_train_pushes_from_a_directory_other_than_the_server_s(dev_pair, tmp_path):
    theta, t = dev_pair
    cwd = trainer_directory(tmp_path, theta)
    repo = Path(__file__).resolve().parents[3]
    # This repository's code, whatever directory the command runs in.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
        p for p in (str(repo), os.environ.get("PYTHONPATH")) if p)}
    run = processes.start(
        [sys.executable, "-m", "dualvllm", "train", "--config", str(TINY_ARITH), "--output-dir", "run",
         "--theta-urls", theta.url, "--t-urls", t.url, "--steps", "1", "--prompts-per-step", "2", "--group-size", "4",
         "--eval-every", "1", "--eval-prompts", "8", "--max-tokens", "4", "--weights-via", "disk"],
        cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, stderr = run.communicate(timeout=TRAIN_TIMEOUT_S)
    assert run.returncode == 0, stderr[-3000:]
    records = [json.loads(line) for line in (cwd / "run" / "metrics.jsonl").read_text().splitlines()]
    # The start weights were pushed before the update (the servers were started elsewhere), then the update.
    assert [r["push_max_abs_diff"] < 1e-3 for r in records if "push_max_abs_diff" in r] == [True]
    assert [p.name.startswith("step-000001-") for p in (cwd / "run" / "pushed").iterdir()] == [True]
    assert theta.running
