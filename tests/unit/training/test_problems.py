"""Dataset rows become token-id tasks: the bundled task, templates, chat, and the self-teacher checks."""

from __future__ import annotations

import copy

import json

import pytest
from transformers import AutoTokenizer

from dualvllm import tinymodels
from dualvllm.common.errors import InvalidInputError
from dualvllm.tinymodels.task import problems
from tests.recipes import TINY_ARITH
from dualvllm.training.config import TrainConfig
from dualvllm.training.problems import load_problems


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(tinymodels.BASE_DIR)


def config(tmp_path, **values) -> TrainConfig:
    return TrainConfig.parse(config_file=TINY_ARITH, output_dir=tmp_path / "run", **values)


def test_the_bundled_task_is_the_default_dataset(tmp_path, tokenizer):
    loaded = load_problems(config(tmp_path, eval_prompts=50), tokenizer)
    assert len(loaded.train) == len(problems("train")) and len(loaded.held_out) == 50
    answers = {p.prompt: p.answer for p in problems("train") + problems("test")}
    for task in loaded.train[:20] + loaded.held_out:
        assert task.prompt_ids == tuple(tokenizer(task.prompt_text)["input_ids"])
        assert task.row["answer"] == answers[task.prompt_text] and task.t_prompt_ids is None
    assert {t.prompt_text for t in loaded.held_out} <= {p.prompt for p in problems("test")}
    assert loaded.spec.names == ("exact",)
    # The seed orders the data: another seed, another order of the same tasks.
    other = load_problems(config(tmp_path, eval_prompts=50, seed=1), tokenizer)
    assert [t.prompt_text for t in other.train] != [t.prompt_text for t in loaded.train]
    assert sorted(t.prompt_text for t in other.train) == sorted(t.prompt_text for t in loaded.train)


def gsm8k_file(tmp_path, n=12):
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("".join(json.dumps({"question": f"{i}+{i}=", "answer": f"so it is {2 * i}\n#### {2 * i}"}) + "\n"
                            for i in range(10, 10 + n)))
    return path


def test_a_user_dataset_with_templates_and_a_held_out_split(tmp_path, tokenizer):
    loaded = load_problems(config(tmp_path, dataset=gsm8k_file(tmp_path), prompt_template="Q {question}",
                                  teacher_template="{prompt}#{answer}|", reward=("gsm8k",), eval_fraction=0.34),
                           tokenizer)
    assert len(loaded.train) == 8 and len(loaded.held_out) == 4  # round(0.34 x 12)
    task = loaded.train[0]
    teacher_text = tokenizer.decode(list(task.t_prompt_ids))
    assert task.prompt_text.startswith("Q ") and teacher_text.startswith(task.prompt_text + "#so it is")
    assert task.prompt == (list(task.prompt_ids), list(task.t_prompt_ids))


@pytest.mark.parametrize("rows, fields, held", [(40, {}, 4), (4000, {}, 200), (4000, {"eval_prompts": 50}, 50),
                                                 (3, {}, 1), (40, {"eval_fraction": 0.5}, 20)])
def test_the_held_out_share_fits_the_dataset(tmp_path, tokenizer, caplog, rows, fields, held):
    with caplog.at_level("INFO", logger="dualvllm.training.problems"):
        loaded = load_problems(config(tmp_path, dataset=gsm8k_file(tmp_path, rows), prompt_template="{question}",
                                      reward=("gsm8k",), **fields), tokenizer)
    assert (len(loaded.train), len(loaded.held_out)) == (rows - held, held)
    assert f"held out {held} of the {rows} rows" in caplog.text  # the run says what it held out


def test_a_chat_template_file_renders_every_prompt_as_a_user_message(tmp_path, tokenizer):
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}<assistant>{% endif %}")
    loaded = load_problems(config(tmp_path, dataset=gsm8k_file(tmp_path), prompt_template="{question}",
                                  reward=("gsm8k",), chat_template=str(template), eval_prompts=2), tokenizer)
    task = loaded.train[0]
    assert task.prompt_text == f"<user>{task.row['question']}\n<assistant>"
    assert task.prompt_ids == tuple(tokenizer(task.prompt_text, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("values, message", [
    ({"teacher": "self"}, r"--teacher self is the base model shown the teacher's prompt, .* Give --teacher-template"),
    ({"reward": ("code",)}, r"train.jsonl:1: no 'tests' field, which the reward needs"),
])
def test_refusals_before_any_server(tmp_path, tokenizer, values, message):
    with pytest.raises(InvalidInputError, match=message):
        load_problems(config(tmp_path, **values), tokenizer)


def test_the_tokenizers_own_chat_template_is_used_and_needed(tmp_path, tokenizer):
    # The bundled models' template renders a chat as its messages' text (dualvllm.tinymodels.build.CHAT_TEMPLATE).
    loaded = load_problems(config(tmp_path, chat_template="tokenizer", eval_prompts=2), tokenizer)
    assert loaded.train[0].prompt_text == loaded.train[0].row["prompt"]
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    with pytest.raises(InvalidInputError, match="the base tokenizer has no chat template"):
        load_problems(config(tmp_path, chat_template="tokenizer"), bare)


def test_the_mixed_task_with_its_retained_skill_and_groups(tmp_path, tokenizer):
    from dualvllm.tinymodels.task import MIXED_DATA, RETAINED_TEST

    loaded = load_problems(config(tmp_path, dataset=MIXED_DATA["train"], eval_dataset=MIXED_DATA["val"],
                                  retained_dataset=RETAINED_TEST, eval_group_by="difficulty", eval_prompts=60),
                           tokenizer)
    assert len(loaded.held_out) == len(loaded.retained) == 60
    assert {t.row["difficulty"] for t in loaded.held_out} == {"two-digit", "three-digit", "long"}
    assert all(t.prompt_text.startswith(t.row["answer"] + " ") for t in loaded.retained)  # hinted prompts
    assert not loaded.retained[0].row.keys() - {"prompt", "answer", "difficulty"}
    with pytest.raises(InvalidInputError, match="--eval-group-by level: no held-out row has that field"):
        load_problems(config(tmp_path, dataset=MIXED_DATA["train"], eval_dataset=MIXED_DATA["val"],
                             eval_group_by="level"), tokenizer)
