"""QStarRollouts, TRL's rollout function over one coordinator: its fields, its teacher prompts, its
loop, and two real TRL training steps on in-process engines over the bundled models (no servers)."""

from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest

from dualvllm import tinymodels
from dualvllm.common.errors import InvalidInputError, LifecycleError
from dualvllm.coordinator import CoordinatorConfig, GenerationOutput
from dualvllm.engines.transformers_engine import TransformersEngine
from dualvllm.tinymodels.task import HINT_TEMPLATE
from dualvllm.training.trl_rollouts import QStarRollouts, rollout_fields

datasets = pytest.importorskip("datasets")
pytest.importorskip("trl")

ROWS = [{"prompt": "57+44=", "answer": "101"}, {"prompt": "85+10=", "answer": "59"},
        {"prompt": "45+27=", "answer": "27"}, {"prompt": "90+61=", "answer": "151"}]


def _output(index: int, tokens: list[int], k: int | None = None) -> GenerationOutput:
    n = len(tokens)
    topk_ids = topk_lp = None
    if k is not None:
        topk_ids = np.arange(n * 2 * k).reshape(n, 2, k)  # row 0 base, row 1 teacher
        topk_ids[:, 1, -1] = -1  # a teacher that reported fewer than k
        topk_lp = -np.arange(n * 2 * k, dtype=np.float64).reshape(n, 2, k) / 10
        topk_lp[:, 1, -1] = -np.inf
    return GenerationOutput(index=index, prompt=[5], generated_text="", generated_tokens=tokens,
                            alpha_history=[0.25] * n, logprobs_q=[-0.5 - i for i in range(n)],
                            logprobs_theta=[-1.0] * n, logprobs_t=[-0.1] * n, finish_reason="eos",
                            topk_ids=topk_ids, topk_logprobs=topk_lp)


def test_rollout_fields_are_one_entry_per_rollout_with_per_token_lists():
    fields = rollout_fields([[5, 6], [7]], [_output(0, [3, 4, 1]), _output(1, [1])])
    assert fields["prompt_ids"] == [[5, 6], [7]]
    assert fields["completion_ids"] == [[3, 4, 1], [1]]
    assert fields["logprobs"] == [[-0.5, -1.5, -2.5], [-0.5]]  # log q*, the behaviour policy
    assert fields["alpha"] == [[0.25] * 3, [0.25]]
    assert fields["logprob_t"] == [[-0.1] * 3, [-0.1]] and fields["logprob_theta"] == [[-1.0] * 3, [-1.0]]
    assert "teacher_topk_ids" not in fields


def test_rollout_fields_take_the_teachers_row_of_the_recorded_topk():
    fields = rollout_fields([[5]], [_output(0, [3, 1], k=3)], record_topk=3)
    # [T, 2, k] = [2, 2, 3]: the teacher's row 1 is ids 3..5 and 9..11, its missing last id clipped to 0.
    assert fields["teacher_topk_ids"] == [[[3, 4, 0], [9, 10, 0]]]
    assert fields["teacher_topk_logprobs"][0][0][:2] == [-0.3, -0.4]
    assert fields["teacher_topk_logprobs"][0][0][2] == -np.inf


def test_rollout_fields_refuse_mismatches():
    with pytest.raises(InvalidInputError, match="one output per prompt"):
        rollout_fields([[5], [6]], [_output(0, [1])])
    with pytest.raises(InvalidInputError, match="record_topk"):
        rollout_fields([[5]], [_output(0, [1])], record_topk=2)


def test_teacher_settings_are_checked_before_any_engine_starts():
    config = CoordinatorConfig(top_k=20, mode="per_token")
    with pytest.raises(InvalidInputError, match="dataset"):
        QStarRollouts(config, teacher_template=HINT_TEMPLATE)
    with pytest.raises(InvalidInputError, match="'hint'"):
        QStarRollouts(config, dataset=ROWS, teacher_column="hint")
    with pytest.raises(InvalidInputError, match="names 'solution'"):
        QStarRollouts(config, dataset=ROWS, teacher_template="{solution} {prompt}")
    with pytest.raises(InvalidInputError, match="ambiguous"):
        QStarRollouts(config, dataset=[*ROWS, {"prompt": "57+44=", "answer": "1"}], teacher_template=HINT_TEMPLATE)


def _engines(teacher=tinymodels.TEACHER_DIR):
    return dict(theta_engine=TransformersEngine(tinymodels.BASE_DIR, name="theta"),
                t_engine=TransformersEngine(teacher, name="t"))


def _trainer(tmp_path, rollouts, tokenizer, *, steps: int = 2):
    from transformers import AutoModelForCausalLM

    from dualvllm.training.trl_trainer import QStarGRPOConfig, QStarGRPOTrainer

    def exact(prompts, completions, answer, **_):
        return [float(c.strip() == a) for c, a in zip(completions, answer)]

    config = QStarGRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=8, num_generations=4,
                             max_completion_length=5, max_steps=steps, learning_rate=1e-4, report_to=[],
                             use_cpu=True, bf16=False, logging_steps=1, save_strategy="no", correction="none",
                             temperature=1.0, seed=0)
    model = AutoModelForCausalLM.from_pretrained(tinymodels.BASE_DIR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return QStarGRPOTrainer(model=model, reward_funcs=exact, args=config, train_dataset=datasets.Dataset.from_list(ROWS),
                                processing_class=tokenizer, rollout_func=rollouts)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tinymodels.BASE_DIR)


def test_the_teacher_template_reaches_the_teacher(tmp_path, tokenizer):
    """The hint-reading base as the teacher, alone (alpha = 1): shown the answer it copies it; shown
    nothing it is as weak as the base. So right answers prove the template's prompt reached it."""
    prompts = [r["prompt"] for r in ROWS for _ in range(2)]
    answers = [r["answer"] for r in ROWS for _ in range(2)]
    config = CoordinatorConfig(top_k=20, mode="per_token")
    right = {}
    for name, template in (("hinted", HINT_TEMPLATE), ("plain", None)):
        with QStarRollouts(config, dataset=ROWS, teacher_template=template, fixed_alpha=1.0,
                           **_engines(tinymodels.BASE_HINT_DIR)) as rollouts:
            trainer = _trainer(tmp_path / name, rollouts, tokenizer)
            fields = rollouts(prompts, trainer)
        texts = tokenizer.batch_decode(fields["completion_ids"], skip_special_tokens=True)
        right[name] = sum(t.strip() == a for t, a in zip(texts, answers)) / len(answers)
        assert fields["prompt_ids"][0] == tokenizer("57+44=")["input_ids"]  # the base prompt, as TRL tokenizes it
        assert all(a == [1.0] * len(c) for a, c in zip(fields["alpha"], fields["completion_ids"]))
    assert right["hinted"] >= 0.75 and right["plain"] <= 0.5, right


def test_two_trl_steps_sample_through_one_coordinator_on_one_loop(tmp_path, tokenizer):
    config = CoordinatorConfig(top_k=20, mode="per_token")
    rollouts = QStarRollouts(config, record_topk=5, **_engines())
    coordinator, thread = rollouts.coordinator, rollouts._thread
    calls = []
    original = rollouts.__call__

    class Recording:
        def __call__(self, prompts, trainer):
            fields = original(prompts, trainer)
            calls.append((prompts, fields, rollouts.coordinator))
            return fields

    trainer = _trainer(tmp_path, Recording(), tokenizer, steps=2)
    trainer.train()
    assert len(calls) == 2 and all(c is coordinator for _, _, c in calls)
    loops = [t for t in threading.enumerate() if t.name == "dualvllm-qstar-rollouts"]
    assert loops == [thread] and thread.is_alive()  # one loop thread for the trainer's lifetime, not one per call
    for prompts, fields, _ in calls:
        assert len(prompts) == 8 and len(set(map(str, prompts))) == 2  # 2 prompts x 4, as TRL repeats them
        for key in ("completion_ids", "logprobs", "alpha", "logprob_t", "logprob_theta", "teacher_topk_ids"):
            assert [len(v) for v in fields[key]] == [len(c) for c in fields["completion_ids"]], key
        assert all(1 <= len(c) <= 5 for c in fields["completion_ids"])
        assert all(lp <= 0 for row in fields["logprobs"] for lp in row)
        assert all(0 <= a <= 1 for row in fields["alpha"] for a in row)
        # Repeated prompts get their own seeds: a group of identical completions would be suspicious.
        assert len({tuple(c) for c in fields["completion_ids"]}) > 2
    logged = [entry for entry in trainer.state.log_history if "reward" in entry]
    assert len(logged) == 2 and all("qstar/ratio_mean" in entry for entry in logged)
    rollouts.close()
    assert not thread.is_alive()
    rollouts.close()  # idempotent
    with pytest.raises(LifecycleError):
        rollouts(["57+44="], trainer)
