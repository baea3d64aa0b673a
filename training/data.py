"""Training data: dataset files -> validated examples, and the held-out split.

A dataset is a JSONL file or anything the `datasets` library loads from a local path.
Each row holds its prompt in one of three shapes, plus the fields its reward reads
(`answer`, `tests`, ...), which travel with the example untouched:

    {"prompt": "12+34=", "answer": "64"}                      text, or a list of token ids
    {"messages": [{"role": "user", "content": "..."}], ...}    a chat, rendered by the base
                                                               tokenizer's chat template
    {"theta_prompt": "...", "t_prompt": "...", ...}            the base and the teacher see
                                                               different prompts

Where the prompts come from, first match wins:

    base prompt     prompt_template  >  "prompt"  >  "messages"  >  "theta_prompt"
    teacher prompt  teacher_template >  "t_prompt" (only beside "theta_prompt")  >  the base prompt

Templates are `str.format` strings over the row's fields; a teacher template also sees
`prompt`, the base prompt just built (for a chat row, the rendered text, generation
prompt included). A field whose value is null counts as absent: columnar formats
(parquet, arrow) fill the columns a row does not use with nulls.

Every row is checked before anything is returned, so a bad row stops a run before any
server starts, with its file, its line (JSONL) or row (other formats) and the fix.
"""

from __future__ import annotations

import functools
import random
import re
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, overload
from collections.abc import Callable, Iterable, Mapping, Sequence

from dualvllm.common.errors import InputFormatError, InvalidInputError
from dualvllm.common.jsonl import read_objects
from dualvllm.coordinator.outputs import Prompt
from dualvllm.coordinator.prompts import prompt_problem
from dualvllm.tinymodels.task import DATA_DIR

# The bundled arithmetic task (dualvllm.tinymodels.task), as dataset files read by the same code path.
BUNDLED_TRAIN = DATA_DIR / "train.jsonl"
BUNDLED_TEST = DATA_DIR / "test.jsonl"

# File suffix -> the `datasets` builder that reads it. JSONL is read here, by line.
BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".json": "json", ".csv": "csv"}
# What `Dataset.save_to_disk` / `DatasetDict.save_to_disk` leave in their directory.
SAVED_DATASET_MARKERS = ("state.json", "dataset_dict.json")
LOADABLE = "a .jsonl, .json, .parquet, .arrow or .csv file, or a directory of those or saved by Dataset.save_to_disk"
# Longest excerpt of a row value quoted in a message.
SHOWN_CHARS = 60

Row = Mapping[str, Any]
ChatTemplate = Callable[[list[dict]], str]


@dataclass(frozen=True)
class Example:
    theta_prompt: str | tuple[int, ...]  # what the base model sees
    t_prompt: str | tuple[int, ...] | None  # what the teacher sees; None = the same as theta_prompt
    row: Row = field(hash=False)  # every field of the source row (answer, tests, ...), passed to rewards
    line: int  # 1-based line/row number in its source, for messages

    @property
    def prompt(self) -> Prompt:
        """The prompt as the coordinator takes it: token ids as a list (a tuple means a pair there)."""
        theta = _as_prompt_part(self.theta_prompt)
        return theta if self.t_prompt is None else (theta, _as_prompt_part(self.t_prompt))


def load_rows(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(row number, row) of a dataset: a .jsonl file (UTF-8 errors and bad JSON named by line,
    blank lines skipped), or anything the `datasets` library loads from a local path: a
    directory saved with `save_to_disk`, or a .parquet / .arrow / .json / .csv file or a
    directory of those (its 'train' split when the file names make splits). Rows of other
    formats are numbered from 1 in order. A missing path, an unreadable file or a format
    that cannot be loaded raises InvalidInputError."""
    if not path.exists():
        raise InvalidInputError(f"the dataset {path} does not exist; give {LOADABLE}")
    if path.is_file() and path.suffix == ".jsonl":
        return read_objects(path, what="dataset")
    if path.is_file() and path.suffix not in BUILDERS:
        raise InvalidInputError(
            f"cannot tell the format of the dataset {path} from its suffix {path.suffix or '(none)'!r}; give {LOADABLE}"
        )
    return _library_rows(path)


def build_examples(
    rows: Iterable[tuple[int, Row]],
    *,
    source: str,
    prompt_template: str | None = None,
    teacher_template: str | None = None,
    chat_template: ChatTemplate | None = None,
    required_fields: Iterable[str] = (),
) -> list[Example]:
    """Validated examples of `rows` (from `load_rows`); `source` names them in messages.

    `prompt_template` builds the base prompt from the row's fields instead of its own prompt
    ("{question}" for GSM8K, or a few-shot prefix + "Q: {question}\\nA:"). `teacher_template`
    builds the teacher's prompt from the row's fields plus `prompt`, the base prompt
    ("{prompt}\\nThe answer is {answer}.\\n": a privileged-information teacher).
    `chat_template` renders a row's `messages` to text; the caller builds it from the base
    tokenizer's `apply_chat_template(..., tokenize=False, add_generation_prompt=True)`.
    `required_fields` are fields every row must hold (e.g. "answer" for the exact reward).

    A malformed template raises InvalidInputError once, before the rows; every problem of
    a row raises InputFormatError(source, its line, what to change); no rows at all raises
    InvalidInputError. A teacher prompt equal to the base prompt is stored as None.
    """
    base_template = _Template.parse(prompt_template, "prompt template") if prompt_template is not None else None
    teacher = _Template.parse(teacher_template, "teacher template") if teacher_template is not None else None
    required = tuple(required_fields)
    examples = []
    for line, row in rows:
        refuse = functools.partial(InputFormatError, source, line)
        if not isinstance(row, Mapping):
            raise refuse(f"a row must be an object of fields, got {_shown(row)}")
        present = {name: value for name, value in row.items() if value is not None}
        if missing := [name for name in required if name not in present]:
            raise refuse(
                f"no {_names(missing)} field, which the reward needs; the row has {_names(present)}. "
                "Add it, or choose a reward that does not read it"
            )
        theta: str | tuple[int, ...]
        origin: str | None  # the field the prompt came from; None: built by the prompt template
        if base_template is not None:
            theta, origin = base_template.format(present, refuse), None
        else:
            theta, origin = _own_prompt(present, chat_template, refuse)
        if "t_prompt" in present and (teacher is not None or origin != "theta_prompt"):
            beside = (
                "a teacher template"
                if teacher is not None
                else "the prompt template"
                if base_template is not None
                else f'"{origin}"'
            )
            raise refuse(
                f'"t_prompt" is set beside {beside}, so the teacher would have two prompts; '
                'drop "t_prompt", or give the pair as "theta_prompt" and "t_prompt" alone'
            )
        t: str | tuple[int, ...] | None
        if teacher is not None:
            t = teacher.format({**present, "prompt": theta}, refuse)
        else:
            t = _checked_part(present["t_prompt"], '"t_prompt"', refuse) if origin == "theta_prompt" else None
        examples.append(Example(theta_prompt=theta, t_prompt=None if t == theta else t, row=dict(row), line=line))
    if not examples:
        raise InvalidInputError(f'{source} has no rows; expected rows like {{"prompt": "...", "answer": "..."}}')
    return examples


def format_template(text: str, name: str, values: Mapping[str, Any], *, source: str, line: int) -> str:
    """`text`, a `str.format` template over `values` (a row's fields), checked as build_examples checks
    its templates: InvalidInputError for a malformed template, InputFormatError(source, line) for a row
    it cannot format. For callers that build prompts outside build_examples (dualvllm.training.trl_rollouts)."""
    return _Template.parse(text, name).format(values, functools.partial(InputFormatError, source, line))


def held_out_split(examples: Sequence[Example], n: int, seed: int) -> tuple[list[Example], list[Example]]:
    """(train, held_out): `n` examples chosen by `seed` are held out; both keep the given order."""
    if not 1 <= n < len(examples):
        raise InvalidInputError(
            f"cannot hold out {n} of {len(examples)} examples: hold out at least 1 and leave "
            "at least 1 to train on. Lower the held-out size, or give a separate eval dataset"
        )
    chosen = set(random.Random(seed).sample(range(len(examples)), n))
    return ([e for i, e in enumerate(examples) if i not in chosen], [e for i, e in enumerate(examples) if i in chosen])


def _library_rows(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """Rows through the `datasets` library, imported only here: JSONL needs none of it."""
    try:
        import datasets
        import pyarrow
    except ImportError as exc:
        raise InvalidInputError(
            f"reading {path} needs the `datasets` library: pip install datasets, or give the dataset as a .jsonl file"
        ) from exc
    try:
        if path.is_dir() and any((path / marker).is_file() for marker in SAVED_DATASET_MARKERS):
            loaded = datasets.load_from_disk(str(path))
        elif path.is_dir():
            loaded = datasets.load_dataset(str(path))
        else:
            loaded = datasets.load_dataset(BUILDERS[path.suffix], data_files=str(path))
    except (OSError, ValueError, TypeError, datasets.exceptions.DatasetsError, pyarrow.ArrowException) as exc:
        # DatasetGenerationError says only "An error occurred"; what went wrong is its cause.
        reason = exc.__cause__ or exc
        raise InvalidInputError(
            f"cannot load the dataset {path}: {type(reason).__name__}: {reason}; fix the file, or give {LOADABLE}"
        ) from exc
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise InvalidInputError(
                f"the dataset {path} has splits {sorted(loaded)} and no 'train'; point at the "
                "split's own files, or name them train*.<suffix>"
            )
        loaded = loaded["train"]
    return list(enumerate(loaded.to_list(), start=1))


@dataclass(frozen=True)
class _Template:
    """A `str.format` template over a row's fields, checked once before any row."""

    text: str
    name: str  # "prompt template" or "teacher template", for messages
    fields: frozenset[str]  # the row fields it names
    bare: frozenset[str]  # those put into the text whole ({x}), not indexed ({x[0]}, {x.y})

    @classmethod
    def parse(cls, text: str, name: str) -> _Template:
        try:
            parsed = list(string.Formatter().parse(text))
        except ValueError as exc:
            raise InvalidInputError(
                f"the {name} {text!r} is malformed ({exc}); write a field as {{name}} and a "
                "literal brace as {{ or }}"
            ) from exc
        fields: set[str] = set()
        bare: set[str] = set()
        for _, field_name, spec, _ in parsed:
            if field_name is None:
                continue
            match = re.match(r"[^.\[]*", field_name)
            assert match is not None, "a pattern of `*` matches, if only the empty string"
            root = match.group()
            if not root or root.isdigit():
                raise InvalidInputError(
                    f"the {name} {text!r} has a positional field {{{field_name}}}; name a "
                    "field of the rows instead, e.g. {question}"
                )
            fields.add(root)
            if root == field_name:
                bare.add(root)
            assert spec is not None, "string.Formatter gives a field's spec as '' when it has none"
            if "{" in spec:  # a nested field, as in {answer:>{width}}
                nested = cls.parse(spec, name)
                fields |= nested.fields
                bare |= nested.bare
        if not fields:
            raise InvalidInputError(
                f"the {name} {text!r} names no field, so every prompt would be the same; "
                "name the rows' fields, e.g. {question}"
            )
        return cls(text, name, frozenset(fields), frozenset(bare))

    def format(self, values: Mapping[str, Any], refuse: Callable[[str], InputFormatError]) -> str:
        if missing := sorted(self.fields - values.keys()):
            raise refuse(
                f"the {self.name} names {_names(missing)}, which this row lacks; it has "
                f"{_names(values)}. Fix the template, or add the field to every row"
            )
        for name in sorted(self.bare):
            if isinstance(values[name], (list, tuple, Mapping)):
                raise refuse(
                    f"the {self.name} puts {name!r} into the text whole, and it is not text but "
                    f"{_shown(values[name])}; name a text field, or index into it (e.g. {{{name}[0]}})"
                )
        try:
            text = self.text.format_map(values)
        except (KeyError, IndexError, AttributeError, ValueError, TypeError) as exc:
            raise refuse(f"the {self.name} {self.text!r} cannot format this row: {type(exc).__name__}: {exc}") from exc
        return _checked_part(text, f"the {self.name}", refuse)


def _own_prompt(
    present: Mapping[str, Any], chat_template: ChatTemplate | None, refuse: Callable[[str], InputFormatError]
) -> tuple[str | tuple[int, ...], str]:
    """(base prompt, the field it came from) of a row that carries its prompt itself."""
    if "prompt" in present:
        return _checked_part(present["prompt"], '"prompt"', refuse), "prompt"
    if "messages" in present:
        return _rendered_chat(present["messages"], chat_template, refuse), "messages"
    if "theta_prompt" in present and "t_prompt" in present:
        return _checked_part(present["theta_prompt"], '"theta_prompt"', refuse), "theta_prompt"
    raise refuse(
        f'needs "prompt", "messages", or both "theta_prompt" and "t_prompt"; the row has '
        f"{_names(present)}. Rename its prompt field, or build the prompt with a prompt template "
        'over its fields (e.g. "{question}")'
    )


def _rendered_chat(messages: Any, chat_template: ChatTemplate | None, refuse: Callable[[str], InputFormatError]) -> str:
    if chat_template is None:
        raise refuse(
            'the row is a chat ("messages"), and the base tokenizer has no chat template to render it; '
            'give the prompt as "prompt" text, build it with a prompt template, or use a base model '
            "whose tokenizer has a chat template"
        )
    if not (
        isinstance(messages, list)
        and messages
        and all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    ):
        raise refuse(
            '"messages" must be a non-empty list of {"role": "...", "content": "..."} objects; '
            f"got {_shown(messages)}"
        )
    try:
        text = chat_template([dict(m) for m in messages])
    except Exception as exc:  # the tokenizer's Jinja template may raise anything (e.g. roles must alternate)
        raise refuse(f"the base tokenizer's chat template refused these messages: {type(exc).__name__}: {exc}") from exc
    return _checked_part(text, "the rendered chat", refuse)


@overload
def _checked_part(part: str, what: str, refuse: Callable[[str], InputFormatError]) -> str: ...
@overload
def _checked_part(part: Any, what: str, refuse: Callable[[str], InputFormatError]) -> str | tuple[int, ...]: ...
def _checked_part(part: Any, what: str, refuse: Callable[[str], InputFormatError]) -> str | tuple[int, ...]:
    """One prompt, checked by the coordinator's own validator; token ids come back as a tuple."""
    # A tuple means a (theta, t) pair to prompt_problem; one part of ids is checked as a list.
    problem = prompt_problem(list(part) if isinstance(part, tuple) else part)
    if problem is not None:
        hint = ' (a chat goes in "messages")' if isinstance(part, list) and part and isinstance(part[0], dict) else ""
        raise refuse(f"{what}: {problem}{hint}")
    return part if isinstance(part, str) else tuple(part)


def _as_prompt_part(part: str | tuple[int, ...]) -> str | list[int]:
    return part if isinstance(part, str) else list(part)


def _names(names: Iterable[str]) -> str:
    listed = ", ".join(repr(n) for n in names)
    return listed or "no fields"


def _shown(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= SHOWN_CHARS else shown[: SHOWN_CHARS - 3] + "..."
