"""The bundled task: two-digit addition with the answer's digits reversed.

    "12+34=" -> "64"  (12 + 34 = 46)      "57+68=" -> "521"  (57 + 68 = 125)

Writing the sum least-significant digit first lets a tiny left-to-right model carry
as it goes, so a model of a few hundred thousand parameters learns it in a minute on
a CPU. The answer is checkable by exact match, which makes it a verifiable task for
sampling and RL. Pure Python: importing it does not import torch.

The splits are also committed as dataset files, one {"prompt", "answer"} row per problem
(`DATA_DIR`/train.jsonl and test.jsonl), which training reads like any user dataset.
`python -m dualvllm.tinymodels.task` rewrites them; a unit test keeps them equal to `problems`.

The hard task is the same with three-digit operands ("123+456=" -> "975"). Its 810,000
pairs are too many to enumerate, so `hard_problems` draws a seeded sample of a split and
the dataset files (hard_train.jsonl, hard_test.jsonl) hold HARD_ROWS of each. The bundled
base never sees it; the hard teacher (tinymodels/teacher-hard) learns it.

The long task has answers of 20 digits, where a sampled slip early in the answer can
derail the rest (exposure bias): two 19-digit numbers and their sum, every number
written least-significant digit first, the sum padded to 20 digits
("0123...+4567...=..."). With the operands reversed as well, answer digit i sits at a
fixed distance from operand digits i, which a two-layer model can attend to. The
bundled base never sees it and gets 0%; the long teacher (tinymodels/teacher-long)
learns it. Its dataset files are long_train.jsonl and long_test.jsonl (LONG_ROWS rows).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar
from collections.abc import Callable

OPERANDS = range(10, 100)
EOS_TEXT = "<eos>"
SPLITS = ("train", "test")
# One pair in TEST_BUCKETS lands in the test split (~506 of the 8,100 pairs).
TEST_BUCKETS = 16
DATA_DIR = Path(__file__).resolve().parent / "data"

HARD_OPERANDS = range(100, 1000)
HARD_ROWS = {"train": 20_000, "test": 500}
HARD_TRAIN = DATA_DIR / "hard_train.jsonl"
HARD_TEST = DATA_DIR / "hard_test.jsonl"
# The privileged-information prompt: the answer itself, then the question ("579 123+456=").
# The hint-reading base (tinymodels/base-hint) learned to copy it; `--teacher self
# --teacher-template` uses it to make that base its own teacher.
HINT_TEMPLATE = "{answer} {prompt}"
LONG_DIGITS = 19  # prompt 40 tokens + answer 20 + <eos> = 61, inside the models' 64 positions
LONG_ROWS = {"train": 20_000, "test": 500}
LONG_TRAIN = DATA_DIR / "long_train.jsonl"
LONG_TEST = DATA_DIR / "long_test.jsonl"
# Rejection sampling needs distinct pairs to stay plentiful: half the ~50,600 hard test pairs.
HARD_MAX_SAMPLE = 25_000
# The mixed task mixes the three difficulties in one dataset, as real datasets do; each row
# names its own ("difficulty"), so that accuracy is reported per difficulty. Rows per
# difficulty and split: "val" is drawn from the train split, disjoint from "train", so that
# every selection (early stopping, best-on-the-way, a tuned threshold) is made off the test set.
MIXED_DIFFICULTIES = ("two-digit", "three-digit", "long")
MIXED_ROWS = {"train": 3_000, "val": 100, "test": 200}
MIXED_DATA = {split: DATA_DIR / f"mixed_{split}.jsonl" for split in MIXED_ROWS}
# The skill the mixed task's base keeps and its training set never asks for (tinymodels/
# base-mixed): copying a hint, on two- and three-digit test problems, RETAINED_ROWS of each.
RETAINED_ROWS = 200
RETAINED_TEST = DATA_DIR / "retained_test.jsonl"


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> str:
        return str(self.a + self.b)[::-1]


@dataclass(frozen=True)
class HintedProblem(Problem):
    """The same problem asked with its answer in front (HINT_TEMPLATE)."""

    @property
    def prompt(self) -> str:
        return HINT_TEMPLATE.format(answer=self.answer, prompt=super().prompt)


@dataclass(frozen=True)
class LongProblem:
    """Two digit strings, least-significant digit first, and their sum written the same way."""

    a: str
    b: str

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> str:
        # zfill pads the sum to one digit more than the operands, so every answer has one length.
        return str(int(self.a[::-1]) + int(self.b[::-1])).zfill(len(self.a) + 1)[::-1]


P = TypeVar("P", Problem, LongProblem)


def hinted(batch: list[Problem]) -> list[HintedProblem]:
    return [HintedProblem(p.a, p.b) for p in batch]


def _split_of(problem: Problem | LongProblem) -> str:
    # A hash, not a seeded shuffle: the split of a pair never changes with the code around it.
    digest = hashlib.blake2b(f"{problem.a}+{problem.b}=".encode(), digest_size=8).digest()
    return "test" if int.from_bytes(digest, "big") % TEST_BUCKETS == 0 else "train"


def problems(split: str, n: int | None = None, seed: int = 0) -> list[Problem]:
    """The first `n` problems of `split` ("train" or "test") in an order shuffled by `seed`."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {SPLITS}")
    if n is not None and n < 0:
        raise ValueError(f"n must be >= 0 or None, got {n}")
    chosen = [p for p in (Problem(a, b) for a in OPERANDS for b in OPERANDS) if _split_of(p) == split]
    random.Random(seed).shuffle(chosen)
    return chosen if n is None else chosen[:n]


def hard_problems(split: str, n: int, seed: int = 0) -> list[Problem]:
    """The first `n` distinct three-digit problems of `split` drawn in an order seeded by `seed`.

    A pair's split is `_split_of`'s hash, as for the two-digit task, so it never changes;
    pairs are drawn uniformly and those of the other split or already drawn are skipped,
    so a smaller `n` with the same seed gives a prefix of a larger one.
    """
    if not 0 <= n <= HARD_MAX_SAMPLE:
        raise ValueError(f"n must be in [0, {HARD_MAX_SAMPLE}] for a sample of the hard task, got {n}")
    return _draw(split, n, seed, lambda rng: Problem(rng.choice(HARD_OPERANDS), rng.choice(HARD_OPERANDS)))


def long_problems(split: str, n: int, seed: int = 0) -> list[LongProblem]:
    """The first `n` distinct long problems of `split` drawn in an order seeded by `seed`, as
    `hard_problems` draws its own."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return _draw(
        split, n, seed, lambda rng: LongProblem(*("".join(rng.choices("0123456789", k=LONG_DIGITS)) for _ in range(2)))
    )


def _draw(split: str, n: int, seed: int, draw: Callable[[random.Random], P]) -> list[P]:
    """`n` distinct problems of `split`, each from `draw(rng)`, skipping the other split's."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {SPLITS}")
    rng, chosen, seen = random.Random(seed), list[P](), set[P]()
    while len(chosen) < n:
        problem = draw(rng)
        if problem not in seen and _split_of(problem) == split:
            seen.add(problem)
            chosen.append(problem)
    return chosen


def score(problem: Problem | LongProblem, completion: str) -> float:
    """1.0 if the completion is exactly the answer (before any newline or EOS text), else 0.0."""
    if not isinstance(completion, str):
        return 0.0
    text = completion.split("\n", 1)[0].split(EOS_TEXT, 1)[0].strip()
    return 1.0 if text == problem.answer else 0.0


def write_dataset(split: str, path: Path, hard: bool = False, long: bool = False) -> None:
    """`split` as a JSONL dataset: one {"prompt", "answer"} row per problem, in `problems(split)` order.

    With `hard`, the rows are `hard_problems(split, HARD_ROWS[split])`, in that order; with `long`,
    `long_problems(split, LONG_ROWS[split])`.
    """
    if hard and long:
        raise ValueError("choose one of hard and long")
    if long:
        chosen: list = long_problems(split, LONG_ROWS[split])
    else:
        chosen = hard_problems(split, HARD_ROWS[split]) if hard else problems(split)
    rows = (json.dumps({"prompt": p.prompt, "answer": p.answer}) + "\n" for p in chosen)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(rows), encoding="utf-8")


def mixed_problems(split: str) -> list[tuple[str, Problem | LongProblem]]:
    """(difficulty, problem) rows of the mixed task's `split` ("train", "val" or "test"): MIXED_ROWS
    of each difficulty, interleaved so that any prefix mixes them. "val" is the first rows of a
    train-split draw and "train" the rows after them, so the two never share a problem."""
    if split not in MIXED_ROWS:
        raise ValueError(f"unknown split {split!r}; use one of {tuple(MIXED_ROWS)}")
    n, source = MIXED_ROWS[split], "test" if split == "test" else "train"
    skip = MIXED_ROWS["val"] if split == "train" else 0
    drawn: list[list[Problem] | list[LongProblem]] = [
        problems(source, seed=1)[skip : skip + n],
        hard_problems(source, skip + n, seed=1)[skip:],
        long_problems(source, skip + n, seed=1)[skip:],
    ]
    return [(difficulty, rows[i]) for i in range(n) for difficulty, rows in zip(MIXED_DIFFICULTIES, drawn)]


def retained_problems() -> list[HintedProblem]:
    """The retained-skill test: RETAINED_ROWS hinted two-digit and as many three-digit test problems."""
    return hinted(problems("test", seed=1)[:RETAINED_ROWS]) + hinted(hard_problems("test", RETAINED_ROWS, seed=1))


def write_mixed_datasets(directory: Path = DATA_DIR) -> None:
    """MIXED_DATA's three files ({"prompt", "answer", "difficulty"} rows) and RETAINED_TEST, in `directory`."""
    for split, path in MIXED_DATA.items():
        (directory / path.name).write_text(
            "".join(
                json.dumps({"prompt": p.prompt, "answer": p.answer, "difficulty": d}) + "\n"
                for d, p in mixed_problems(split)
            ),
            encoding="utf-8",
        )
    (directory / RETAINED_TEST.name).write_text(
        "".join(
            json.dumps(
                {
                    "prompt": p.prompt,
                    "answer": p.answer,
                    "difficulty": "hint, two-digit" if p.a < 100 else "hint, three-digit",
                }
            )
            + "\n"
            for p in retained_problems()
        ),
        encoding="utf-8",
    )


if __name__ == "__main__":
    for name in SPLITS:
        write_dataset(name, DATA_DIR / f"{name}.jsonl")
    write_dataset("train", HARD_TRAIN, hard=True)
    write_dataset("test", HARD_TEST, hard=True)
    write_dataset("train", LONG_TRAIN, long=True)
    write_dataset("test", LONG_TEST, long=True)
    write_mixed_datasets()
