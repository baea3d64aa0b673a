"""Datasets -> validated examples: every row shape, templates, formats, refusals, the held-out split."""

from __future__ import annotations

import json

import pytest

from dualvllm.common.errors import InputFormatError, InvalidInputError
from dualvllm.tinymodels.task import problems, write_dataset
from dualvllm.training.data import BUNDLED_TEST, BUNDLED_TRAIN, Example, build_examples, held_out_split, load_rows


def write_jsonl(tmp_path, rows, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def examples(rows, **kwargs):
    """build_examples over rows numbered from 1, as load_rows numbers them."""
    return build_examples(list(enumerate(rows, start=1)), source="data.jsonl", **kwargs)


def fake_chat(messages):
    """A chat template in the shape apply_chat_template(..., add_generation_prompt=True) gives."""
    return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"


@pytest.fixture
def datasets_lib(tmp_path, monkeypatch):
    """The `datasets` library, caching what it loads under tmp_path instead of the user's home."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    return datasets


# --- The bundled task --------------------------------------------------------------------------------

@pytest.mark.parametrize("split, path", [("train", BUNDLED_TRAIN), ("test", BUNDLED_TEST)])
def test_bundled_files_are_what_the_generator_writes_and_hold_the_task(tmp_path, split, path):
    fresh = tmp_path / f"{split}.jsonl"
    write_dataset(split, fresh)
    assert path.read_bytes() == fresh.read_bytes(), f"{path} drifted from dualvllm.tinymodels.task: python -m dualvllm.tinymodels.task"
    loaded = build_examples(load_rows(path), source=str(path), required_fields=["answer"])
    assert [(e.theta_prompt, e.row["answer"]) for e in loaded] == [(p.prompt, p.answer) for p in problems(split)]
    assert all(e.t_prompt is None for e in loaded)
    assert loaded[0].line == 1 and loaded[-1].line == len(loaded)


# --- Row shapes ------------------------------------------------------------------------------------

def test_jsonl_rows_of_every_shape_keep_their_fields_and_line_numbers(tmp_path):
    path = write_jsonl(tmp_path, [{"prompt": "12+34=", "answer": "64", "id": 7}])
    with open(path, "a") as f:
        f.write("\n   \n")  # blank lines are skipped but still counted
        f.write(json.dumps({"prompt": [5, 0, 9], "answer": "1"}) + "\n")
        f.write(json.dumps({"theta_prompt": "x=", "t_prompt": "hint: 3. x=", "answer": "3"}) + "\n")
        f.write(json.dumps({"messages": [{"role": "system", "content": "Add."},
                                         {"role": "user", "content": "1+2"}], "answer": "3"}) + "\n")
    rows = load_rows(path)
    assert [n for n, _ in rows] == [1, 4, 5, 6]
    text, ids, pair, chat = build_examples(rows, source=str(path), chat_template=fake_chat)
    assert text == Example("12+34=", None, {"prompt": "12+34=", "answer": "64", "id": 7}, 1)
    assert ids.theta_prompt == (5, 0, 9) and ids.t_prompt is None and ids.line == 4
    assert pair.theta_prompt == "x=" and pair.t_prompt == "hint: 3. x=" and pair.row["answer"] == "3"
    assert chat.theta_prompt == "<system>Add.\n<user>1+2\n<assistant>" and chat.t_prompt is None
    # What the coordinator takes: ids as a list (a tuple would mean a pair there), a pair as a tuple.
    assert text.prompt == "12+34=" and ids.prompt == [5, 0, 9] and pair.prompt == ("x=", "hint: 3. x=")


def test_precedence_prompt_over_messages_and_a_same_teacher_prompt_is_none():
    (both,) = examples([{"prompt": "p", "messages": [{"role": "user", "content": "m"}]}], chat_template=fake_chat)
    assert both.theta_prompt == "p"
    (same,) = examples([{"theta_prompt": "p", "t_prompt": "p"}])
    assert same.t_prompt is None and same.prompt == "p"


def test_gsm8k_rows_through_a_prompt_template():
    rows = [{"question": "Tom has 40 apples and finds 2. How many?", "answer": "40 + 2 = 42\n#### 42"},
            {"question": "What is 6 * 7?", "answer": "#### 42", "source": None}]
    built = examples(rows, prompt_template="{question}", required_fields=["answer"])
    assert [e.theta_prompt for e in built] == [r["question"] for r in rows]
    assert built[1].row == rows[1] and built[0].row["answer"].endswith("#### 42")
    (few_shot,) = examples(rows[1:], prompt_template="Q: 1+1?\nA: 2\nQ: {question}\nA:")
    assert few_shot.theta_prompt == "Q: 1+1?\nA: 2\nQ: What is 6 * 7?\nA:"


def test_teacher_template_sees_the_row_and_the_base_prompt_just_built():
    hint = "{prompt}\nThe answer is {answer}.\n"
    (plain,) = examples([{"prompt": "12+34=", "answer": "64"}], teacher_template=hint)
    assert plain.theta_prompt == "12+34=" and plain.t_prompt == "12+34=\nThe answer is 64.\n"
    assert plain.prompt == ("12+34=", "12+34=\nThe answer is 64.\n")
    (templated,) = examples([{"question": "6*7?", "answer": "42"}], prompt_template="Q: {question}\nA:",
                            teacher_template=hint)
    assert templated.t_prompt == "Q: 6*7?\nA:\nThe answer is 42.\n"
    # A chat row: `prompt` is the rendered chat, generation prompt included.
    (chat,) = examples([{"messages": [{"role": "user", "content": "6*7?"}], "answer": "42"}],
                       chat_template=fake_chat, teacher_template=hint)
    assert chat.t_prompt == "<user>6*7?\n<assistant>\nThe answer is 42.\n"
    (indexed,) = examples([{"prompt": "x=", "facts": {"value": 3}, "steps": ["a", "b"]}],
                          teacher_template="{steps[1]} {facts[value]:>3} {prompt}")
    assert indexed.t_prompt == "b   3 x="


# --- Formats read through `datasets` -----------------------------------------------------------------

def test_a_parquet_file_with_mixed_row_shapes_treats_nulls_as_absent(tmp_path, datasets_lib):
    path = tmp_path / "data.parquet"
    datasets_lib.Dataset.from_dict({
        "prompt": ["12+34=", None], "theta_prompt": [None, "x="], "t_prompt": [None, "hint x="],
        "answer": ["64", "3"],
    }).to_parquet(str(path))
    text, pair = build_examples(load_rows(path), source=str(path))
    assert (text.theta_prompt, text.t_prompt, text.line) == ("12+34=", None, 1)
    assert (pair.theta_prompt, pair.t_prompt, pair.line) == ("x=", "hint x=", 2)
    assert text.row == {"prompt": "12+34=", "theta_prompt": None, "t_prompt": None, "answer": "64"}


def test_a_saved_dataset_directory_and_a_dataset_dict_give_their_train_rows(tmp_path, datasets_lib):
    rows = {"prompt": [[3, 4], [5]], "answer": ["1", "2"]}
    datasets_lib.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "saved"))
    loaded = build_examples(load_rows(tmp_path / "saved"), source="saved")
    assert [e.theta_prompt for e in loaded] == [(3, 4), (5,)] and [e.line for e in loaded] == [1, 2]
    datasets_lib.DatasetDict({
        "train": datasets_lib.Dataset.from_dict(rows),
        "test": datasets_lib.Dataset.from_dict({"prompt": [[9]], "answer": ["9"]}),
    }).save_to_disk(str(tmp_path / "dict"))
    assert [row["answer"] for _, row in load_rows(tmp_path / "dict")] == ["1", "2"]


def test_a_directory_of_parquet_files_gives_its_train_split(tmp_path, datasets_lib):
    folder = tmp_path / "gsm8k"
    folder.mkdir()
    datasets_lib.Dataset.from_dict({"question": ["a?", "b?"], "answer": ["#### 1", "#### 2"]}).to_parquet(
        str(folder / "train-00000-of-00001.parquet"))
    datasets_lib.Dataset.from_dict({"question": ["c?"], "answer": ["#### 3"]}).to_parquet(
        str(folder / "test-00000-of-00001.parquet"))
    built = build_examples(load_rows(folder), source=str(folder), prompt_template="{question}")
    assert [e.theta_prompt for e in built] == ["a?", "b?"]


# --- Refusals ------------------------------------------------------------------------------------

HINT = "{prompt}\nThe answer is {answer}.\n"


@pytest.mark.parametrize("rows, kwargs, problem", [
    ([{"q": "ok", "answer": "1"}, {"prompt": "x", "answer": "2"}], {"prompt_template": "{q}"},
     r"the prompt template names 'q', which this row lacks; it has 'prompt', 'answer'"),
    ([{"prompt": "ok", "answer": "1"}, {"prompt": "x"}], {"teacher_template": HINT},
     r"the teacher template names 'answer', which this row lacks; it has 'prompt'"),
    ([{"prompt": "ok", "answer": "1"}, {"prompt": "x", "answer": None}], {"required_fields": ["answer"]},
     r"no 'answer' field, which the reward needs; the row has 'prompt'. Add it"),
    ([{"prompt": "ok"}, {"messages": [{"role": "user", "content": "hi"}]}], {},
     r'chat \("messages"\), and the base tokenizer has no chat template'),
    ([{"prompt": "ok"}, {"messages": [{"role": "user"}]}], {"chat_template": fake_chat},
     r'"messages" must be a non-empty list of \{"role": "...", "content": "..."\}'),
    ([{"prompt": "ok"}, {"messages": []}], {"chat_template": fake_chat}, r'"messages" must be a non-empty list'),
    ([{"prompt": "ok"}, {"prompt": [True]}], {}, r'"prompt": a prompt must be .* got \[True\]'),
    ([{"prompt": "ok"}, {"prompt": ""}], {}, r'"prompt": the prompt is empty'),
    ([{"prompt": "ok"}, {"prompt": [1, -2]}], {}, r"token ids \(ints >= 0\).*got \[1, -2\]"),
    ([{"prompt": "ok"}, {"prompt": 12}], {}, r"got 12"),
    ([{"prompt": "ok"}, {"prompt": [{"role": "user", "content": "hi"}]}], {}, r'a chat goes in "messages"'),
    ([{"prompt": "ok"}, {"theta_prompt": "x", "t_prompt": [1.5]}], {}, r'"t_prompt": a prompt must be'),
    ([{"prompt": "ok"}, {"theta_prompt": "x"}], {},
     r'needs "prompt", "messages", or both "theta_prompt" and "t_prompt"; the row has \'theta_prompt\''),
    ([{"prompt": "ok"}, {"question": "x"}], {}, r'prompt template over its fields \(e.g. "\{question\}"\)'),
    ([{"prompt": "ok"}, {"prompt": "x", "t_prompt": "y"}], {},
     r'"t_prompt" is set beside "prompt", so the teacher would have two prompts'),
    ([{"prompt": "ok", "answer": "1"}, {"theta_prompt": "x", "t_prompt": "y", "answer": "2"}],
     {"teacher_template": HINT}, r'"t_prompt" is set beside a teacher template'),
    ([{"q": "ok"}, {"q": "x", "t_prompt": "y"}], {"prompt_template": "{q}"},
     r'"t_prompt" is set beside the prompt template'),
    ([{"prompt": "ok", "answer": "1"}, {"prompt": [4, 2], "answer": "2"}], {"teacher_template": HINT},
     r"the teacher template puts 'prompt' into the text whole, and it is not text but \(4, 2\)"),
    ([{"q": "ok"}, {"q": ["a", "b"]}], {"prompt_template": "{q}"}, r"index into it \(e.g. \{q\[0\]\}\)"),
    ([{"q": {"a": "ok"}}, {"q": {"b": "x"}}], {"prompt_template": "{q[a]}"}, r"cannot format this row: KeyError"),
    ([{"q": 3}, {"q": "x"}], {"prompt_template": "{q:d}"}, r"cannot format this row: ValueError: Unknown format"),
    ([{"q": "ok"}, {"q": ""}], {"prompt_template": "{q}"}, r"the prompt template: the prompt is empty"),
    ([{"prompt": "ok"}, ["prompt", "x"]], {}, r"a row must be an object of fields"),
])
def test_a_bad_row_is_refused_with_its_line_and_the_fix(rows, kwargs, problem):
    with pytest.raises(InputFormatError, match=problem) as info:
        examples(rows, **kwargs)
    assert info.value.line_number == 2 and str(info.value).startswith("data.jsonl:2: ")


def test_a_chat_template_that_raises_is_named_with_the_row():
    def strict(messages):
        raise ValueError("Conversation roles must alternate user/assistant")

    with pytest.raises(InputFormatError, match="chat template refused these messages: ValueError: Conversation"):
        examples([{"messages": [{"role": "user", "content": "a"}]}], chat_template=strict)


@pytest.mark.parametrize("kwargs, problem", [
    ({"prompt_template": "{question"}, r"the prompt template '\{question' is malformed \(.*\); write a field"),
    ({"teacher_template": "{prompt}}"}, r"the teacher template .* is malformed .*literal brace as \{\{ or \}\}"),
    ({"prompt_template": "Q: {} A:"}, r"positional field \{\}; name a field"),
    ({"prompt_template": "Q: {0}"}, r"positional field \{0\}"),
    ({"prompt_template": "Solve it:"}, r"names no field, so every prompt would be the same"),
    ({"teacher_template": ""}, r"the teacher template '' names no field"),
])
def test_a_bad_template_is_refused_once_before_any_row(kwargs, problem):
    with pytest.raises(InvalidInputError, match=problem) as info:
        examples([], **kwargs)  # refused before the rows, even before "no rows"
    assert not isinstance(info.value, InputFormatError)


def test_jsonl_lines_that_are_not_utf8_json_objects_are_named_by_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    for body, problem in [(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n', r"not UTF-8 text \(byte 0xe9 at column 16\)"),
                          (b'{"prompt": "a"}\n{"prompt": \n', r"not valid JSON"),
                          (b'{"prompt": "a"}\n["prompt"]\n', r"each line must be a JSON object")]:
        path.write_bytes(body)
        with pytest.raises(InputFormatError, match=problem) as info:
            load_rows(path)
        assert info.value.line_number == 2 and str(info.value).startswith(f"{path}:2: ")


def test_an_empty_dataset_is_refused(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    assert load_rows(path) == []
    with pytest.raises(InvalidInputError, match=r"empty.jsonl has no rows; expected rows like \{\"prompt\""):
        build_examples(load_rows(path), source=str(path))


def test_paths_that_cannot_be_loaded_say_what_to_give(tmp_path, datasets_lib):
    with pytest.raises(InvalidInputError, match=r"nope.jsonl does not exist; give a .jsonl, .json, .parquet"):
        load_rows(tmp_path / "nope.jsonl")
    (tmp_path / "data.txt").write_text("12+34=\n")
    with pytest.raises(InvalidInputError, match=r"cannot tell the format .* from its suffix '.txt'; give a .jsonl"):
        load_rows(tmp_path / "data.txt")
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(InvalidInputError, match=r"cannot load the dataset .*bad.parquet: ArrowInvalid: .*magic bytes"):
        load_rows(tmp_path / "bad.parquet")
    (tmp_path / "bad.json").write_text("{oops")
    with pytest.raises(InvalidInputError, match=r"bad.json: .*; fix the file, or give a .jsonl"):
        load_rows(tmp_path / "bad.json")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidInputError, match=r"cannot load the dataset .*empty: EmptyDatasetError"):
        load_rows(tmp_path / "empty")
    datasets_lib.DatasetDict({"test": datasets_lib.Dataset.from_dict({"prompt": ["a"]})}).save_to_disk(
        str(tmp_path / "test_only"))
    with pytest.raises(InvalidInputError, match=r"has splits \['test'\] and no 'train'"):
        load_rows(tmp_path / "test_only")


# --- The held-out split --------------------------------------------------------------------------

def test_held_out_split_is_a_seeded_partition_that_keeps_order():
    pool = examples([{"prompt": f"p{i}"} for i in range(50)])
    train, held = held_out_split(pool, 10, seed=3)
    assert len(held) == 10 and len(train) == 40
    assert sorted(train + held, key=lambda e: e.line) == pool
    assert [e.line for e in held] == sorted(e.line for e in held)
    assert held_out_split(pool, 10, seed=3) == (train, held)
    assert held_out_split(pool, 10, seed=4)[1] != held


@pytest.mark.parametrize("n", [0, 3, 4])
def test_held_out_split_refuses_to_leave_nothing_to_hold_or_train(n):
    with pytest.raises(InvalidInputError, match=rf"cannot hold out {n} of 3 examples.*give a separate eval dataset"):
        held_out_split(examples([{"prompt": "a"}, {"prompt": "b"}, {"prompt": "c"}]), n, seed=0)
