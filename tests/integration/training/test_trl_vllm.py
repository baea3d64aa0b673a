"""TRL's GRPOTrainer on q* rollouts from real vLLM servers, its policy pushed back into the base server.

Against the session's dev-mode pair (integration/conftest.py: the bundled base in dev mode and the
teacher, with the lockstep plugin; the session's shared pair takes no pushes). In this process: two
optimizer steps, a push before the first and after each, every push verified by logprobs.
Then `accelerate launch --multi_gpu --num_processes 2` runs examples/trl_grpo.py against the
same pair for three steps: two processes, DDP on gloo (the script trains with use_cpu=True;
accelerate 1.15's `--cpu --num_processes 2` would start one process).
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from dualvllm import tinymodels
from dualvllm.coordinator import CoordinatorConfig
from tests import processes

datasets = pytest.importorskip("datasets")
pytest.importorskip("trl")
from dualvllm.training.trl_rollouts import QStarRollouts  # noqa: E402
from dualvllm.training.trl_sync import QStarWeightSync  # noqa: E402
from dualvllm.training.trl_trainer import QStarGRPOConfig, QStarGRPOTrainer  # noqa: E402

ROWS = [{"prompt": "57+44=", "answer": "101"}, {"prompt": "85+10=", "answer": "59"},
        {"prompt": "45+27=", "answer": "27"}, {"prompt": "90+61=", "answer": "151"}]
STEPS = 2
EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "trl_grpo.py"
DDP_STEPS = 3
# Two trainer processes start (imports, model, coordinator: ~30 s each on a shared core) and
# take three steps of 8 rollouts each; ten minutes is a hung collective, not a slow machine.
LAUNCH_TIMEOUT_S = 600.0



def exact(prompts, completions, answer, **_):
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


def assert_verified(pushes: list[dict]) -> None:
    """Every push reached the one replica and was proved: the first by digest and a logprob probe
    (its difference within float32 round-off), the others by the digest the server reported,
    the same on both sides (dualvllm.training.push_check)."""
    first, *later = pushes
    assert all(p["replicas"] == 1 and p["digest"] for p in pushes), pushes
    assert first["verified_by"] == "digest+probe" and first["max_abs_diff"] <= 1e-3, first
    assert all(p["verified_by"] == "digest" and p["max_abs_diff"] is None for p in later), later
    assert len({p["digest"] for p in pushes}) == len(pushes), pushes  # training changed the weights each step


def test_trl_trains_on_qstar_rollouts_and_pushes_every_step(dev_pair, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dualvllm.training.weight_sync import learner_logprobs

    theta, t = dev_pair
    tokenizer = AutoTokenizer.from_pretrained(tinymodels.BASE_DIR)
    config = QStarGRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                             max_completion_length=5, max_steps=STEPS, learning_rate=1e-3, report_to=[],
                             use_cpu=True, bf16=False, logging_steps=1, save_strategy="no", correction="none",
                             temperature=1.0, seed=0)
    with QStarRollouts(CoordinatorConfig(theta_url=theta.url, t_url=t.url, top_k=20)) as rollouts:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = QStarGRPOTrainer(model=AutoModelForCausalLM.from_pretrained(tinymodels.BASE_DIR),
                                       reward_funcs=exact, args=config, train_dataset=datasets.Dataset.from_list(ROWS),
                                       processing_class=tokenizer, rollout_func=rollouts)
        sync = QStarWeightSync(trainer, rollouts)
        trainer.add_callback(sync)
        trainer.train()
        assert rollouts.coordinator.mode == "lockstep"
    assert len(sync.reports) == STEPS + 1  # before the first step, then after each
    assert_verified([{"max_abs_diff": r.max_abs_diff, "verified_by": r.verified_by, "digest": r.digest,
                      "replicas": r.replicas} for r in sync.reports])
    logged = [e for e in trainer.state.log_history if "push/digest_verified" in e]
    assert len(logged) == STEPS and all(e["push/digest_verified"] == 1.0 for e in logged)
    assert logged[0]["push/max_abs_diff"] <= 1e-3  # the first push's probe lands in the first step's line
    assert all("qstar/ratio_mean" in e and "reward" in e for e in logged)
    # The server serves the trained weights (verified above), and training moved them.
    probes = [tokenizer(r["prompt"])["input_ids"] for r in ROWS]
    start = learner_logprobs(AutoModelForCausalLM.from_pretrained(tinymodels.BASE_DIR), probes)
    trained = learner_logprobs(trainer.model, probes)
    assert abs(trained - start).max() > 1e-2


def test_accelerate_runs_two_processes_that_sample_their_own_prompts_and_one_pushes(dev_pair, tmp_path):
    theta, t = dev_pair
    log = tmp_path / "launch.log"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", "0", str(EXAMPLE),
               "--output-dir", str(tmp_path / "run"), "--theta-url", theta.url, "--t-url", t.url,
               "--max-steps", str(DDP_STEPS), "--batch-size", "8", "--num-generations", "4"]
    with log.open("w") as out:
        # Ended with its children at the test's teardown on every path (tests/processes.py).
        launch = processes.start(command, stdout=out, stderr=subprocess.STDOUT)
        try:
            code = launch.wait(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"accelerate launch did not finish within {LAUNCH_TIMEOUT_S:g} s; its log:\n"
                        + log.read_text()[-4000:])
    assert code == 0, log.read_text()[-4000:]
    main, other = (json.loads((tmp_path / "run" / f"rank-{i}.json").read_text()) for i in (0, 1))
    for rank in (main, other):
        assert (rank["world_size"], rank["distributed_type"], rank["backend"], rank["wrapped_model"]) == (
            2, "DistributedType.MULTI_CPU", "gloo", "DistributedDataParallel")
        assert rank["mode"] == "lockstep"  # two coordinators, each in lockstep with the one pair
    # Trained on different prompts, the two replicas hold the same weights: DDP averaged the gradients.
    assert main["weights_sha256"] == other["weights_sha256"]
    # Every step hands each process 8 rollouts of its own 2 prompts (x 4 generations).
    assert main["rollouts"] == other["rollouts"] == DDP_STEPS * 8
    assert not set(main["prompts_sampled"]) & set(other["prompts_sampled"])
    assert len(main["prompts_sampled"]) == len(other["prompts_sampled"]) == DDP_STEPS * 2
    # Only the main process pushed: before the first step and after each, every push verified.
    assert other["pushes"] == [] and len(main["pushes"]) == DDP_STEPS + 1
    assert_verified(main["pushes"])
    logged = [e for e in main["log_history"] if "push/digest_verified" in e]
    assert [e["step"] for e in logged] == list(range(1, DDP_STEPS + 1))
    assert all("reward" in e and "loss" in e and e["push/digest_verified"] == 1.0 for e in logged)
