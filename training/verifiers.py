"""Verifiers: turn a model's completion into a reward in [0, 1]. They never raise on
malformed model output: a completion that cannot be parsed earns 0.

- `exact_match`: the bundled arithmetic task (and any short-answer task).
- `math_reward`: LaTeX / \\boxed{} answers through the `math-verify` library, and
  GSM8K-style "#### 42" answers.
- `gsm8k_reward`: the completion's final number against a GSM8K solution's "#### 42".
- `code_reward` (`code_reward_cases` for a list of tests): runs a completion against
  test cases in a sandboxed subprocess (see `dualvllm.training.sandbox`), reward = fraction of
  tests passed.

All are plain functions of (completion, reference) so they pickle into a process
pool: `score_in_pool` runs a batch off the event loop, so sampling never stalls.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import re
import signal
from concurrent.futures import Executor, ProcessPoolExecutor
from fractions import Fraction
from collections.abc import Callable, Iterator, Sequence

from dualvllm.common.process import die_with_parent
from dualvllm.training.sandbox import SandboxLimits, run_tests

Verifier = Callable[[str, str], float]

GSM8K_ANSWER = re.compile(r"####\s*([-+]?[\d,]*\.?\d+)")
# A plain number, commas allowed as thousands separators: "72", "-3.5", "1,000", ".5".
NUMBER = re.compile(r"[-+]?(?:\d[\d,]*(?:\.\d+)?|\.\d+)")
# The end-of-sequence text some tokenizers leave in decoded completions.
EOS_MARKERS = ("<eos>", "<|endoftext|>", "<|im_end|>", "</s>")


def exact_match(completion: str, answer: str) -> float:
    """1.0 if the completion's first line (EOS text removed) is exactly the answer."""
    if not isinstance(completion, str):
        return 0.0
    return 1.0 if _before_eos(completion.split("\n", 1)[0]).strip() == str(answer).strip() else 0.0


def _before_eos(text: str) -> str:
    for marker in EOS_MARKERS:
        text = text.split(marker, 1)[0]
    return text


def _gsm8k_number(text: str) -> str | None:
    found = GSM8K_ANSWER.findall(text)
    return found[-1].replace(",", "") if found else None


def math_reward(completion: str, reference: str) -> float:
    """1.0 if the completion's final answer equals the reference mathematically.

    The reference is a LaTeX answer ("\\frac{1}{2}", "\\boxed{3}") or a GSM8K solution
    ending in "#### 42". A completion in GSM8K style is compared by its "####" number;
    otherwise math-verify extracts the last boxed/LaTeX/plain answer from it.
    """
    if not isinstance(completion, str) or not isinstance(reference, str):
        return 0.0
    try:
        from math_verify import parse, verify

        gold_number = _gsm8k_number(reference)
        gold = parse(f"${gold_number}$" if gold_number is not None else reference)
        number = _gsm8k_number(completion)
        answer = parse(f"${number}$" if number is not None else completion)
        if not gold or not answer:
            return 0.0
        return 1.0 if verify(gold, answer) else 0.0
    # Model output is arbitrary text: any failure inside the parser means "not verified".
    except Exception:  # noqa: BLE001
        return 0.0


def gsm8k_reward(completion: str, gold: str) -> float:
    """1.0 if the completion's final number equals the gold solution's "#### N" number.

    The completion's number is the one after its first "####", or else its last number
    (lm-evaluation-harness's strict and flexible GSM8K matches): a few-shot model that goes
    on to write the next question has given its answer by the first "####". A gold without
    "####" is read the same way, so a bare "42" works too. Commas are thousands separators;
    numbers compare as exact rationals, so "72.0" equals "72".
    """
    if not isinstance(completion, str) or not isinstance(gold, str):
        return 0.0
    expected, answer = _final_number(gold), _final_number(_before_eos(completion))
    return 1.0 if expected is not None and answer == expected else 0.0


def _final_number(text: str) -> Fraction | None:
    marked = GSM8K_ANSWER.search(text)
    numbers = [marked.group(1)] if marked else NUMBER.findall(text)
    return Fraction(numbers[-1].replace(",", "")) if numbers else None


def code_reward(completion: str, tests: str, limits: SandboxLimits | None = None) -> float:
    """Fraction of the test cases (newline-separated `assert` statements) the code passes."""
    if not isinstance(tests, str):
        return 0.0
    return code_reward_cases(completion, [line for line in tests.splitlines() if line.strip()], limits)


def code_reward_cases(completion: str, cases: Sequence[str], limits: SandboxLimits | None = None) -> float:
    """Fraction of `cases` (each one test, which may span lines) the code passes."""
    if not isinstance(completion, str) or not cases:
        return 0.0
    result = run_tests(_strip_code_fence(completion), list(cases), limits or SandboxLimits())
    return result.passed / len(cases)


def _strip_code_fence(completion: str) -> str:
    """The code inside the last ```python ... ``` block, or the completion as is."""
    blocks = re.findall(r"```(?:python|py)?\s*\n(.*?)```", completion, flags=re.DOTALL)
    return blocks[-1] if blocks else completion


@contextlib.contextmanager
def verifier_pool(workers: int = 1) -> Iterator[ProcessPoolExecutor]:
    """A process pool for verifiers whose workers die with this process.

    A worker holds no state worth saving, so it gets SIGKILL the moment its parent dies:
    a training run killed by SIGKILL otherwise leaves its workers running, adopted by init.
    Workers are forked, whatever the platform's default: with forkserver (Python 3.14's
    default on Linux) a worker's parent is the fork server, not this process, and spawn
    would re-run `python -m dualvllm` in every worker.
    """
    pool = ProcessPoolExecutor(
        max_workers=workers,
        mp_context=multiprocessing.get_context("fork"),
        initializer=die_with_parent,
        initargs=(os.getpid(), signal.SIGKILL),
    )
    try:
        yield pool
    finally:
        pool.shutdown(cancel_futures=True)


async def score_in_pool(
    verifier: Verifier, completions: Sequence[str], references: Sequence[str], executor: Executor
) -> list[float]:
    """Rewards for a batch, computed in `executor` (a process pool) off the event loop."""
    if len(completions) != len(references):
        raise ValueError(f"got {len(completions)} completions for {len(references)} references")
    loop = asyncio.get_running_loop()
    futures = [loop.run_in_executor(executor, verifier, c, r) for c, r in zip(completions, references)]
    return list(await asyncio.gather(*futures))
