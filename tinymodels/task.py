"""The bundled task: two-digit addition with the answer's digits reversed.

    "12+34=" -> "64"  (12 + 34 = 46)      "57+68=" -> "521"  (57 + 68 = 125)

Writing the sum least-significant digit first lets a tiny left-to-right model carry
as it goes, so a model of a few hundred thousand parameters learns it in a minute on
a CPU. The answer is checkable by exact match, which makes it a verifiable task for
sampling and RL. Pure Python: importing it does not import torch.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

OPERANDS = range(10, 100)
EOS_TEXT = "<eos>"
SPLITS = ("train", "test")
# One pair in TEST_BUCKETS lands in the test split (~506 of the 8,100 pairs).
TEST_BUCKETS = 16


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


def _split_of(problem: Problem) -> str:
    # A hash, not a seeded shuffle: the split of a pair never changes with the code around it.
    digest = hashlib.blake2b(problem.prompt.encode(), digest_size=8).digest()
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


def score(problem: Problem, completion: str) -> float:
    """1.0 if the completion is exactly the answer (before any newline or EOS text), else 0.0."""
    if not isinstance(completion, str):
        return 0.0
    text = completion.split("\n", 1)[0].split(EOS_TEXT, 1)[0].strip()
    return 1.0 if text == problem.answer else 0.0
