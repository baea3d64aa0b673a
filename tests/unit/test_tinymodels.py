"""The bundled task and the committed tiny checkpoints."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import tinymodels
from tinymodels.task import Problem, problems, score


def test_answers_are_reversed_sums():
    assert Problem(12, 34).prompt == "12+34=" and Problem(12, 34).answer == "64"
    assert Problem(57, 68).answer == "521" and Problem(10, 90).answer == "001"


def test_splits_are_disjoint_complete_and_stable():
    test, train = problems("test"), problems("train")
    assert not set(test) & set(train) and len(test) + len(train) == 90 * 90
    assert 400 <= len(test) <= 600
    assert problems("test", n=5, seed=3) == problems("test", n=5, seed=3)
    assert problems("test", n=5, seed=3) != problems("test", n=5, seed=4)
    assert set(problems("test", seed=9)) == set(test)
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        problems("dev")


@pytest.mark.parametrize(("completion", "expected"), [
    ("64", 1.0), (" 64 ", 1.0), ("64<eos>", 1.0), ("64\n12+1", 1.0),
    ("46", 0.0), ("640", 0.0), ("", 0.0), (None, 0.0), ("6 4", 0.0),
])
def test_score_is_exact_match_and_never_raises(completion, expected):
    assert score(Problem(12, 34), completion) == expected


def test_importing_the_package_and_task_does_not_import_torch():
    code = "import tinymodels, tinymodels.task, sys; print('torch' in sys.modules)"
    assert subprocess.check_output([sys.executable, "-c", code], text=True).strip() == "False"


@pytest.mark.parametrize("model_dir", [tinymodels.BASE_DIR, tinymodels.TEACHER_DIR], ids=["base", "teacher"])
def test_checkpoints_suit_vllm_on_cpu(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["tie_word_embeddings"] is False  # tied embeddings break in-place reloads
    assert config["head_dim"] >= 32  # the CPU attention backend needs head size >= 32
    assert (model_dir / "model.safetensors").stat().st_size < 2_000_000
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == 1


def test_tokenizer_round_trips_text_exactly():
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tinymodels.BASE_DIR)
    text = "12+34= 64 ok!"
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    assert len(ids) == len(text)  # one token per character, nothing prepended
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token_id == 1 and tokenizer.convert_ids_to_tokens(1) == "<eos>"


def test_teacher_solves_the_task_and_the_base_is_weak():
    pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tinymodels.build import greedy_accuracy

    tokenizer = AutoTokenizer.from_pretrained(tinymodels.TEACHER_DIR)
    held_out = problems("test", n=200, seed=5)
    teacher = greedy_accuracy(AutoModelForCausalLM.from_pretrained(tinymodels.TEACHER_DIR), tokenizer, held_out)
    base = greedy_accuracy(AutoModelForCausalLM.from_pretrained(tinymodels.BASE_DIR), tokenizer, held_out)
    report = json.loads(tinymodels.BUILD_REPORT.read_text())
    assert teacher >= 0.95 and report["teacher"]["test_greedy_accuracy"] >= 0.95
    assert 0.1 <= base <= 0.5 and base < teacher - 0.4
