"""The bundled task and the committed tiny checkpoints."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from dualvllm import tinymodels
from dualvllm.tinymodels.task import (HARD_MAX_SAMPLE, HARD_ROWS, HARD_TEST, HARD_TRAIN, HINT_TEMPLATE, LONG_DIGITS, LONG_ROWS,
                             LONG_TEST, LONG_TRAIN, MIXED_DATA, MIXED_DIFFICULTIES, MIXED_ROWS, RETAINED_ROWS,
                             RETAINED_TEST, LongProblem, Problem, hard_problems, hinted, long_problems, problems,
                             score, write_dataset, write_mixed_datasets)


def test_answers_are_reversed_sums():
    assert Problem(12, 34).prompt == "12+34=" and Problem(12, 34).answer == "64"
    assert Problem(57, 68).answer == "521" and Problem(10, 90).answer == "001"


def test_a_hinted_problem_carries_its_answer_and_keeps_its_split():
    problem = hinted([Problem(123, 456)])[0]
    assert problem.prompt == "975 123+456=" == HINT_TEMPLATE.format(answer="975", prompt="123+456=")
    assert problem.answer == "975" and score(problem, "975<eos>") == 1.0
    assert set(hinted(problems("test"))).isdisjoint(hinted(problems("train")))
    assert all(p in hinted(hard_problems("test", 50)) for p in hinted(hard_problems("test", 20)))


def test_splits_are_disjoint_complete_and_stable():
    test, train = problems("test"), problems("train")
    assert not set(test) & set(train) and len(test) + len(train) == 90 * 90
    assert 400 <= len(test) <= 600
    assert problems("test", n=5, seed=3) == problems("test", n=5, seed=3)
    assert problems("test", n=5, seed=3) != problems("test", n=5, seed=4)
    assert set(problems("test", seed=9)) == set(test)
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        problems("dev")


def test_hard_answers_are_reversed_three_digit_sums():
    assert Problem(123, 456).prompt == "123+456=" and Problem(123, 456).answer == "975"
    assert Problem(999, 999).answer == "8991" and Problem(500, 500).answer == "0001"
    assert score(Problem(123, 456), "975<eos>") == 1.0 and score(Problem(123, 456), "579") == 0.0


def test_hard_problems_are_seeded_three_digit_and_split_by_a_fixed_hash():
    test = hard_problems("test", 300, seed=3)
    assert test == hard_problems("test", 300, seed=3) != hard_problems("test", 300, seed=4)
    assert hard_problems("test", 40, seed=3) == test[:40]  # a smaller n is a prefix
    assert len(set(test)) == 300 and all(p.a in range(100, 1000) and p.b in range(100, 1000) for p in test)
    train = hard_problems("train", 3000, seed=3)
    assert not set(test) & set(train) and not set(test) & set(hard_problems("train", 3000, seed=4))
    # The first rows of the committed files; the hash keeps each in its split whatever the seed.
    assert hard_problems("test", 1) == [Problem(697, 323)] and hard_problems("train", 1) == [Problem(964, 494)]
    assert Problem(697, 323) not in hard_problems("train", HARD_ROWS["train"], seed=7)
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        hard_problems("dev", 1)
    with pytest.raises(ValueError, match=f"n must be in \\[0, {HARD_MAX_SAMPLE}\\]"):
        hard_problems("test", HARD_MAX_SAMPLE + 1)


@pytest.mark.parametrize(("split", "path"), [("train", HARD_TRAIN), ("test", HARD_TEST)])
def test_hard_dataset_files_are_what_the_generator_writes_with_right_answers(tmp_path, split, path):
    fresh = tmp_path / path.name
    write_dataset(split, fresh, hard=True)
    assert path.read_bytes() == fresh.read_bytes(), f"{path} drifted from dualvllm.tinymodels.task: python -m dualvllm.tinymodels.task"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == HARD_ROWS[split] == len({row["prompt"] for row in rows})
    for row in rows[:2000]:
        a, b = (int(x) for x in row["prompt"].removesuffix("=").split("+"))
        assert 100 <= a <= 999 and 100 <= b <= 999 and row["answer"] == str(a + b)[::-1], row


def test_hard_train_and_test_files_share_no_prompt():
    train, test = ({json.loads(line)["prompt"] for line in path.read_text().splitlines()}
                   for path in (HARD_TRAIN, HARD_TEST))
    assert not train & test


def test_long_answers_are_padded_sums_written_least_significant_digit_first():
    # 91 is 19 and 11 is 11 least-significant first: 19 + 11 = 30, padded to 030, written 030 reversed.
    assert LongProblem("91", "11").prompt == "91+11=" and LongProblem("91", "11").answer == "030"
    assert LongProblem("99", "99").answer == "891"  # 99 + 99 = 198
    assert LongProblem("00", "00").answer == "000"
    problem = LongProblem("9" * LONG_DIGITS, "1" + "0" * (LONG_DIGITS - 1))  # 10^19 - 1 + 1 = 10^19
    assert problem.answer == "0" * LONG_DIGITS + "1" and score(problem, problem.answer + "<eos>") == 1.0
    assert len(problem.prompt) + len(problem.answer) + 1 <= 64  # the models' positions


def test_long_problems_are_seeded_split_by_a_fixed_hash_and_refuse_bad_arguments():
    test = long_problems("test", 100, seed=3)
    assert test == long_problems("test", 100, seed=3) != long_problems("test", 100, seed=4)
    assert long_problems("test", 10, seed=3) == test[:10]
    assert all(len(p.a) == len(p.b) == LONG_DIGITS and (p.a + p.b).isdigit() for p in test)
    assert not set(test) & set(long_problems("train", 2000, seed=3))
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        long_problems("dev", 1)
    with pytest.raises(ValueError, match="n must be >= 0"):
        long_problems("test", -1)
    with pytest.raises(ValueError, match="one of hard and long"):
        write_dataset("test", HARD_TEST, hard=True, long=True)


@pytest.mark.parametrize(("split", "path"), [("train", LONG_TRAIN), ("test", LONG_TEST)])
def test_long_dataset_files_are_what_the_generator_writes_with_right_answers(tmp_path, split, path):
    fresh = tmp_path / path.name
    write_dataset(split, fresh, long=True)
    assert path.read_bytes() == fresh.read_bytes(), f"{path} drifted from dualvllm.tinymodels.task: python -m dualvllm.tinymodels.task"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == LONG_ROWS[split] == len({row["prompt"] for row in rows})
    for row in rows[:2000]:
        a, b = row["prompt"].removesuffix("=").split("+")
        assert int(row["answer"][::-1]) == int(a[::-1]) + int(b[::-1]) and len(row["answer"]) == LONG_DIGITS + 1


@pytest.mark.parametrize(("completion", "expected"), [
    ("64", 1.0), (" 64 ", 1.0), ("64<eos>", 1.0), ("64\n12+1", 1.0),
    ("46", 0.0), ("640", 0.0), ("", 0.0), (None, 0.0), ("6 4", 0.0),
])
def test_score_is_exact_match_and_never_raises(completion, expected):
    assert score(Problem(12, 34), completion) == expected


def test_importing_the_package_and_task_does_not_import_torch():
    code = "import dualvllm.tinymodels, dualvllm.tinymodels.task, sys; print('torch' in sys.modules)"
    assert subprocess.check_output([sys.executable, "-c", code], text=True).strip() == "False"


@pytest.mark.parametrize("model_dir", [tinymodels.BASE_DIR, tinymodels.TEACHER_DIR, tinymodels.TEACHER_HARD_DIR,
                                       tinymodels.TEACHER_LONG_DIR], ids=["base", "teacher", "teacher-hard", "teacher-long"])
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

    from dualvllm.tinymodels.build import greedy_accuracy

    tokenizer = AutoTokenizer.from_pretrained(tinymodels.TEACHER_DIR)
    held_out = problems("test", n=200, seed=5)
    teacher = greedy_accuracy(AutoModelForCausalLM.from_pretrained(tinymodels.TEACHER_DIR), tokenizer, held_out)
    base = greedy_accuracy(AutoModelForCausalLM.from_pretrained(tinymodels.BASE_DIR), tokenizer, held_out)
    report = json.loads(tinymodels.BUILD_REPORT.read_text())
    assert teacher >= 0.95 and report["teacher"]["test_greedy_accuracy"] >= 0.95
    assert 0.1 <= base <= 0.5 and base < teacher - 0.4


def test_hard_teacher_solves_both_tasks_and_the_base_not_the_hard_one():
    pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dualvllm.tinymodels.build import HARD_MAX_LEN, greedy_accuracy

    tokenizer = AutoTokenizer.from_pretrained(tinymodels.TEACHER_HARD_DIR)
    assert tokenizer.get_vocab() == AutoTokenizer.from_pretrained(tinymodels.BASE_DIR).get_vocab()
    hard_teacher = AutoModelForCausalLM.from_pretrained(tinymodels.TEACHER_HARD_DIR)
    base = AutoModelForCausalLM.from_pretrained(tinymodels.BASE_DIR)
    hard, easy = hard_problems("test", 20, seed=5), problems("test", n=20, seed=5)
    assert greedy_accuracy(hard_teacher, tokenizer, hard, HARD_MAX_LEN) >= 0.9
    assert greedy_accuracy(hard_teacher, tokenizer, easy) >= 0.9
    assert greedy_accuracy(base, tokenizer, hard, HARD_MAX_LEN) <= 0.1
    report = json.loads(tinymodels.BUILD_REPORT.read_text())
    assert report["teacher_hard"]["hard_test_greedy_accuracy"] >= 0.95
    assert report["teacher_hard"]["test_greedy_accuracy"] >= 0.95
    assert report["hard_task"]["base"]["pass_at_1"] <= 0.05
    assert report["hard_task"]["teacher_hard"]["pass_at_1"] >= 0.95


def test_encode_leaves_the_prompt_out_of_the_loss_when_asked():
    pytest.importorskip("torch")
    from dualvllm.tinymodels.build import EOS_ID, build_tokenizer, encode

    problem = LongProblem("91", "11")  # "91+11=" then "030" and <eos>
    ids, labels = encode(build_tokenizer(), [problem], max_len=12, prompt_loss=False)
    assert labels[0, :6].tolist() == [-100] * 6 and labels[0, 6:10].tolist() == ids[0, 6:10].tolist()
    assert ids[0, 9] == EOS_ID and labels[0, 10:].tolist() == [-100, -100]  # padding
    _, with_prompt = encode(build_tokenizer(), [problem], max_len=12)
    assert with_prompt[0, :10].tolist() == ids[0, :10].tolist()


def test_long_teacher_solves_the_long_task_and_the_base_does_not():
    pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dualvllm.tinymodels.build import LONG_MAX_LEN, greedy_accuracy

    tokenizer = AutoTokenizer.from_pretrained(tinymodels.TEACHER_LONG_DIR)
    assert tokenizer.get_vocab() == AutoTokenizer.from_pretrained(tinymodels.BASE_DIR).get_vocab()
    batch = long_problems("test", 20, seed=5)
    teacher = AutoModelForCausalLM.from_pretrained(tinymodels.TEACHER_LONG_DIR)
    assert greedy_accuracy(teacher, tokenizer, batch, LONG_MAX_LEN) >= 0.9
    assert greedy_accuracy(AutoModelForCausalLM.from_pretrained(tinymodels.BASE_DIR), tokenizer, batch,
                           LONG_MAX_LEN) == 0.0
    record = json.loads(tinymodels.BUILD_REPORT.read_text())["teacher_long"]
    assert record["long_test_greedy_accuracy"] >= 0.95 and record["base_long_test_greedy_accuracy"] == 0.0


def test_answer_logprob_of_a_uniform_model_is_answer_length_times_log_vocab():
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from dualvllm.tinymodels.build import HARD_MAX_LEN, answer_logprob, build_tokenizer

    class Uniform:
        """Equal logits over 98 tokens everywhere: every token has log-probability -log 98."""

        def eval(self):
            return self

        def __call__(self, ids):
            return SimpleNamespace(logits=torch.zeros(*ids.shape, 98))

    batch = [Problem(123, 456), Problem(999, 999)]  # answers "975" and "8991": 3 + 1 and 4 + 1 tokens with <eos>
    expected = -(4 + 5) / 2 * math.log(98)
    assert answer_logprob(Uniform(), build_tokenizer(), batch, HARD_MAX_LEN) == pytest.approx(expected, rel=1e-6)


def test_the_hint_base_reads_a_hint_and_is_the_base_without_one():
    pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dualvllm.tinymodels.build import HARD_MAX_LEN, HINT_MAX_LEN, greedy_accuracy

    tokenizer = AutoTokenizer.from_pretrained(tinymodels.BASE_HINT_DIR)
    assert tokenizer.get_vocab() == AutoTokenizer.from_pretrained(tinymodels.BASE_DIR).get_vocab()
    model = AutoModelForCausalLM.from_pretrained(tinymodels.BASE_HINT_DIR)
    hard = hard_problems("test", 40, seed=5)
    assert greedy_accuracy(model, tokenizer, hinted(hard), HINT_MAX_LEN) >= 0.9
    assert greedy_accuracy(model, tokenizer, hard, HARD_MAX_LEN) <= 0.1
    report = json.loads(tinymodels.BUILD_REPORT.read_text())["base_hint"]
    assert report["hard_test_greedy_accuracy_with_hint"] >= 0.95 and report["hard_test_greedy_accuracy"] <= 0.05


def test_mixed_dataset_files_are_what_the_generator_writes_and_mix_three_difficulties(tmp_path):
    write_mixed_datasets(tmp_path)
    for path in [*MIXED_DATA.values(), RETAINED_TEST]:
        assert path.read_bytes() == (tmp_path / path.name).read_bytes(), (
            f"{path} drifted from dualvllm.tinymodels.task: python -m dualvllm.tinymodels.task")
    rows = {split: [json.loads(line) for line in path.read_text().splitlines()] for split, path in MIXED_DATA.items()}
    for split, split_rows in rows.items():
        counts = {d: sum(r["difficulty"] == d for r in split_rows) for d in MIXED_DIFFICULTIES}
        assert counts == dict.fromkeys(MIXED_DIFFICULTIES, MIXED_ROWS[split])
        assert [r["difficulty"] for r in split_rows[:3]] == list(MIXED_DIFFICULTIES)  # interleaved
        for row in split_rows:
            a, b = row["prompt"].removesuffix("=").split("+")
            expected = (LongProblem(a, b) if row["difficulty"] == "long" else Problem(int(a), int(b))).answer
            assert row["answer"] == expected, row
    prompts = {split: {r["prompt"] for r in split_rows} for split, split_rows in rows.items()}
    assert not prompts["train"] & prompts["val"] and not prompts["train"] & prompts["test"]
    assert not prompts["val"] & prompts["test"]
    retained = [json.loads(line) for line in RETAINED_TEST.read_text().splitlines()]
    assert len(retained) == 2 * RETAINED_ROWS
    assert all(r["prompt"].startswith(r["answer"] + " ") for r in retained)  # the hint is the answer
