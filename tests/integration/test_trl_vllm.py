"""TRL's GRPOTrainer on q* rollouts from real vLLM servers, its policy pushed back into the base server.

Its own pair (the shared one is not in dev mode, so it takes no pushes): the bundled base in
dev mode and the teacher, with the lockstep plugin. Two optimizer steps, a push before the
first and after each, every push verified by logprobs.
"""

from __future__ import annotations

import warnings

import pytest

import tinymodels
from coordinator import CoordinatorConfig
from engines.launcher import pair_configs
from tests.integration.pairs import running_pair

datasets = pytest.importorskip("datasets")
pytest.importorskip("trl")
from training.trl_rollouts import QStarRollouts  # noqa: E402
from training.trl_sync import QStarWeightSync  # noqa: E402
from training.trl_trainer import QStarGRPOConfig, QStarGRPOTrainer  # noqa: E402

ROWS = [{"prompt": "57+44=", "answer": "101"}, {"prompt": "85+10=", "answer": "59"},
        {"prompt": "45+27=", "answer": "27"}, {"prompt": "90+61=", "answer": "151"}]
STEPS = 2


@pytest.fixture(scope="module")
def dev_pair(tmp_path_factory):
    configs = pair_configs(log_dir=tmp_path_factory.mktemp("trl-vllm-logs"), dev_mode=True, max_logprobs=20,
                           lockstep=True, lockstep_timeout_s=15)
    with running_pair(configs) as pair:
        yield pair


def exact(prompts, completions, answer, **_):
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


def test_trl_trains_on_qstar_rollouts_and_pushes_every_step(dev_pair, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from training.weight_sync import learner_logprobs

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
    assert all(r.max_abs_diff <= 1e-3 and r.replicas == 1 for r in sync.reports)
    logged = [e for e in trainer.state.log_history if "push/max_abs_diff" in e]
    assert len(logged) == STEPS and all(e["push/max_abs_diff"] <= 1e-3 for e in logged)
    assert all("qstar/ratio_mean" in e and "reward" in e for e in logged)
    # The server serves the trained weights (verified above), and training moved them.
    probes = [tokenizer(r["prompt"])["input_ids"] for r in ROWS]
    start = learner_logprobs(AutoModelForCausalLM.from_pretrained(tinymodels.BASE_DIR), probes)
    trained = learner_logprobs(trainer.model, probes)
    assert abs(trained - start).max() > 1e-2
