"""Rewards: the built-ins on right, wrong and malformed completions, weights and the None rule,
user `module:function` rewards in a real process pool (working, raising, hanging), and
every refusal of `reward_spec`. Expected numbers are worked out by hand."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import textwrap
import uuid
from concurrent.futures import Executor, Future
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable

import pytest

from dualvllm.common.errors import InvalidInputError
from dualvllm.training.rewards import (BUILT_IN, RewardSpec, Scores, reward_code, reward_exact, reward_format,
                              reward_gsm8k, reward_length, reward_math, reward_spec, required_fields,
                              score_completions, weighted_total)
from dualvllm.training.verifiers import verifier_pool

pytest.importorskip("math_verify")

USER_MODULE = '''
import math
import time

def matches(prompts, completions, **kwargs):
    """TRL style: every row field arrives in kwargs, one value per completion."""
    assert len(kwargs["completion_ids"]) == len(completions)
    return [1.0 if c == a else 0.0 for c, a in zip(completions, kwargs["answer"])]

def named_only(completions, answer):
    """No **kwargs: gets only the keywords it names."""
    return [float(len(c) + len(a)) for c, a in zip(completions, answer)]

def half_or_none(prompts, completions, **kwargs):
    return [None if c == "skip" else 0.5 for c in completions]

def raises(prompts, completions, **kwargs):
    raise RuntimeError("reference server down")

def sleeps(prompts, completions, **kwargs):
    time.sleep(2.0)
    return [1.0] * len(completions)

def too_few(prompts, completions, **kwargs):
    return [1.0]

def odd_values(prompts, completions, **kwargs):
    return [math.inf, "1.0", 0.25]

def exits(prompts, completions, **kwargs):
    import os
    os._exit(3)

not_a_function = 42

def no_completions(prompts):
    return []
'''

LOGGER = "dualvllm.training"


@pytest.fixture(scope="module")
def user_module(tmp_path_factory):
    """A module in a fresh directory, on the parent's sys.path and the workers' PYTHONPATH."""
    directory = tmp_path_factory.mktemp("user_rewards")
    name = f"user_rewards_{uuid.uuid4().hex[:8]}"  # unique: imports are cached per process
    (directory / f"{name}.py").write_text(textwrap.dedent(USER_MODULE))
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(directory))
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(directory), os.environ.get("PYTHONPATH")])))
        yield name


@pytest.fixture(scope="module")
def pool(user_module):
    with verifier_pool(workers=2) as executor:
        yield executor


# --- built-ins, called directly -------------------------------------------------------------

def test_exact():
    completions = ["64", " 64<eos>", "64\nmore", "46", "", "64 64", "64"]
    assert reward_exact([""] * 7, completions, answer=["64"] * 6 + [None]) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, None]


def test_math():
    completions = ["So \\boxed{0.5}", "\\boxed{3}", "\\boxed{\\frac{1}{", "#### 1,000", "x"]
    answers = ["\\frac{1}{2}", "\\boxed{4}", "\\boxed{1}", "#### 1000", None]
    assert reward_math([""] * 5, completions, answer=answers) == [1.0, 0.0, 0.0, 1.0, None]


GOLD = "Natalia sold 48/2 = 24 clips in May.\nAltogether she sold 48+24 = 72 clips.\n#### 72"


@pytest.mark.parametrize(("completion", "gold", "reward"), [
    ("48 + 24 = 72\n#### 72", GOLD, 1.0),
    ("She sold 48 + 24 = 72 clips.", GOLD, 1.0),  # no "####": the last number
    ("The total is 72.0", GOLD, 1.0),  # compared as numbers
    ("#### 72\n\nQuestion: Tom has 5 apples", GOLD, 1.0),  # the first "####", not the next question's numbers
    ("72 clips, or 71?", GOLD, 0.0),
    ("#### 71", GOLD, 0.0),
    ("#### 1,234<|endoftext|> 9", "#### 1234", 1.0),  # commas stripped; text after EOS ignored
    ("She sold many clips.", GOLD, 0.0),  # no number at all
    ("", GOLD, 0.0),
    ("#### 72", "42", 0.0),  # a bare gold is read as its number
    ("42", "42", 1.0),
    ("#### 72", "no number here", 0.0),
])
def test_gsm8k(completion, gold, reward):
    assert reward_gsm8k([""], [completion], answer=[gold]) == [reward]


def test_gsm8k_without_a_reference_scores_none():
    assert reward_gsm8k([""], ["#### 72"], answer=[None]) == [None]


ADD = "def add(a, b):\n    return a + b\n"


def test_code_takes_tests_as_lines_or_as_a_list():
    lines = "assert add(1, 2) == 3\nassert add(-1, 1) == 0\nassert add(2, 2) == 5"
    multi_line = ["assert add(1, 2) == 3", "for i in range(3):\n    assert add(i, 0) == i", "assert add(0, 0) == 1"]
    completions = [ADD, f"```python\n{ADD}```", "def add(a, b) return", ADD]
    scores = reward_code([""] * 4, completions, tests=[lines, multi_line, lines, None])
    assert scores == pytest.approx([2 / 3, 2 / 3, 0.0, None])


def test_length_counts_tokens_when_given_else_characters():
    texts = ["abc", "abcd", "abcdef", "abcdefgh"]
    assert reward_length([""] * 4, texts, length_budget=4) == [0.0, 0.0, -0.5, -1.0]
    ids = [[1] * 6, [1] * 12, None]  # 2 and 8 tokens over a budget of 4; the third falls back to its 3 characters
    assert reward_length([""] * 3, ["x", "x", "abc"], length_budget=4, completion_ids=ids) == [-0.5, -2.0, 0.0]


def test_format_searches_across_lines():
    pattern = r"<answer>.*</answer>"
    completions = ["think\n<answer>\n7\n</answer>", "<answer>7", "", None]
    assert reward_format([""] * 4, completions, format_pattern=pattern) == [1.0, 0.0, 0.0, 0.0]


def test_weighted_total_is_none_where_any_reward_is_none():
    # 1.0*1 + 0.5*(-2) = 0; 1.0*0 + 0.5*4 = 2; a None in either reward gives None.
    assert weighted_total([1.0, 0.5], [[1.0, 0.0, None, 1.0], [-2.0, 4.0, 1.0, None]]) == [0.0, 2.0, None, None]


def test_required_fields():
    spec = reward_spec(["exact", "gsm8k", "code", "length"], length_budget=8)
    assert required_fields(spec) == {"answer", "tests"}
    assert required_fields(reward_spec(["format"], format_pattern="x")) == set()


# --- scoring in a process pool ---------------------------------------------------------------

async def test_built_ins_are_weighted_and_logged_separately(pool):
    spec = reward_spec(["gsm8k", "format", "length"], [1.0, 0.5, 2.0], length_budget=10,
                       format_pattern=r"#### \d+$")
    completions = ["72\n#### 72", "it is 72", "a long answer: 70 + 2 = 72 so #### 71"]
    # 10 and 8 characters; the third has 15 tokens, 5 over the budget of 10.
    rows = [{"answer": GOLD}, {"answer": GOLD}, {"answer": GOLD, "completion_ids": list(range(15))}]
    scores = await score_completions(spec, ["q"] * 3, completions, rows, pool)
    assert scores.by_name == {"gsm8k": [1.0, 1.0, 0.0], "format": [1.0, 0.0, 1.0], "length": [0.0, 0.0, -0.5]}
    # 1 + 0.5 + 0 = 1.5;  1 + 0 + 0 = 1;  0 + 0.5 + 2 * (-0.5) = -0.5
    assert scores.total == [1.5, 1.0, -0.5]


async def test_user_functions_with_trl_and_named_signatures(pool, user_module):
    spec = reward_spec([f"{user_module}:matches", f"{user_module}:named_only"], [1.0, 0.1])
    rows = [{"answer": "7", "completion_ids": [5], "extra": 1}, {"answer": "8", "completion_ids": [6, 7], "extra": 2}]
    scores = await score_completions(spec, ["p", "p"], ["7", "88"], rows, pool)
    assert scores.by_name == {f"{user_module}:matches": [1.0, 0.0], f"{user_module}:named_only": [2.0, 3.0]}
    assert scores.total == pytest.approx([1.2, 0.3])


async def test_a_none_from_one_reward_removes_only_that_completion(pool, user_module):
    spec = reward_spec(["exact", f"{user_module}:half_or_none"], [2.0, -1.0])
    rows = [{"answer": "skip"}, {"answer": "x"}, {"answer": "y"}]
    scores = await score_completions(spec, ["p"] * 3, ["skip", "x", "z"], rows, pool)
    assert scores.total == [None, 1.5, -0.5]  # 2*1 - 0.5;  2*0 - 0.5


@pytest.mark.parametrize(("function", "expected", "warning"), [
    ("raises", [None, None], "failed; its 2 completions score None: RuntimeError: reference server down"),
    ("too_few", [None, None], "returned 1 values for 2 completions"),
])
async def test_a_failing_reward_scores_its_batch_none(pool, user_module, caplog, function, expected, warning):
    spec = reward_spec(["exact", f"{user_module}:{function}"])
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        scores = await score_completions(spec, ["p", "p"], ["a", "b"], [{"answer": "a"}] * 2, pool)
    assert scores.by_name["exact"] == [1.0, 0.0]
    assert scores.by_name[f"{user_module}:{function}"] == expected and scores.total == expected
    (record,) = caplog.records
    assert f"reward '{user_module}:{function}'" in record.message and warning in record.message


async def test_non_numbers_and_non_finite_values_score_none(pool, user_module, caplog):
    spec = reward_spec([f"{user_module}:odd_values"])
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        scores = await score_completions(spec, ["p"] * 3, ["a", "b", "c"], [{}] * 3, pool)
    assert scores.total == [None, None, 0.25]
    (record,) = caplog.records
    assert "for 2 of 3 completions" in record.message


async def test_a_reward_past_its_timeout_scores_none(user_module, caplog):
    spec = reward_spec(["exact", f"{user_module}:sleeps"])
    with verifier_pool(workers=1) as own_pool:
        # Started and warm first: a spawned worker's imports alone could take the 0.5 s.
        assert (await score_completions(reward_spec(["exact"]), ["p"], ["a"], [{"answer": "a"}], own_pool)).total == [1.0]
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            scores = await score_completions(spec, ["p"], ["a"], [{"answer": "a"}], own_pool, timeout_s=0.5)
    assert scores.by_name == {"exact": [1.0], f"{user_module}:sleeps": [None]} and scores.total == [None]
    (record,) = caplog.records
    assert f"reward '{user_module}:sleeps' did not finish within 0.5 s" in record.message


async def test_a_worker_started_before_the_module_was_importable_still_finds_it(tmp_path, monkeypatch):
    name = f"late_rewards_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text("def ones(completions, **kwargs):\n    return [1.0] * len(completions)\n")
    with verifier_pool(workers=1) as own_pool:
        assert own_pool.submit(sum, [1, 2]).result() == 3  # the worker now runs, with the old sys.path
        monkeypatch.syspath_prepend(str(tmp_path))
        spec = reward_spec([f"{name}:ones"])
        scores = await score_completions(spec, ["p"], ["a"], [{}], own_pool)
    assert scores.total == [1.0]


async def test_a_reward_that_kills_its_worker_breaks_the_pool_loudly(user_module):
    spec = reward_spec([f"{user_module}:exits"])
    with verifier_pool(workers=1) as own_pool, pytest.raises(BrokenProcessPool):
        await score_completions(spec, ["p"], ["a"], [{}], own_pool)


async def test_an_empty_batch_needs_no_pool():
    scores = await score_completions(reward_spec(["exact"]), [], [], [], executor=None)
    assert scores == Scores(total=[], by_name={"exact": []})


async def test_mismatched_batch_is_refused(pool):
    with pytest.raises(InvalidInputError, match="got 2 completions for 1 prompts and 2 rows"):
        await score_completions(reward_spec(["exact"]), ["p"], ["a", "b"], [{}, {}], pool)


# --- refusals --------------------------------------------------------------------------------

@pytest.mark.parametrize(("names", "weights", "options", "message"), [
    ([], None, {}, "no reward given"),
    (["exakt"], None, {}, "unknown reward 'exakt'; use one of exact, math, gsm8k, code, length, format"),
    (["exact", "exact"], None, {}, "reward 'exact' is named twice"),
    (["exact", "math"], [1.0], {}, "got 1 reward weights for 2 rewards"),
    (["exact"], [float("nan")], {}, "must be finite"),
    (["exact"], [float("inf")], {}, "must be finite"),
    (["exact"], ["heavy"], {}, "must be numbers"),
    (["length"], None, {}, "'length' needs a length budget"),
    (["length"], None, {"length_budget": 0}, "'length' needs a length budget"),
    (["format"], None, {}, "'format' needs a format pattern"),
    (["format"], None, {"format_pattern": "(unclosed"}, "is not a valid regex"),
    (["no_such_module_xyz:f"], None, {}, "no module named 'no_such_module_xyz'; put its directory on PYTHONPATH"),
    (["os.path:no_such_function"], None, {}, "module 'os.path' has no 'no_such_function'"),
    (["{user}:not_a_function"], None, {}, "is a int, not a function"),
    (["{user}:no_completions"], None, {}, "takes no 'completions' argument"),
    (["{user}:"], None, {}, "unknown reward"),
])
def test_reward_spec_refusals(user_module, names, weights, options, message):
    names = [name.replace("{user}", user_module) for name in names]
    with pytest.raises(InvalidInputError, match=message.replace("(", r"\(").replace(")", r"\)")) as caught:
        reward_spec(names, weights, **options)
    assert "\n" not in str(caught.value)


def test_a_module_that_fails_to_import_is_refused_with_its_error(tmp_path, monkeypatch):
    name = f"broken_rewards_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(InvalidInputError, match="importing .* failed .*no_such_dependency_xyz.*install what it needs"):
        reward_spec([f"{name}:f"])


def test_the_spec_pickles_and_defaults_weights_to_one():
    import pickle

    spec = reward_spec(["exact", "length"], length_budget=4)
    assert spec.weights == (1.0, 1.0) and set(BUILT_IN) == {"exact", "math", "gsm8k", "code", "length", "format"}
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert isinstance(spec, RewardSpec) and spec.import_path == tuple(sys.path)


# --- cancellation ---------------------------------------------------------------------------

class HeldExecutor(Executor):
    """Runs nothing until the test finishes a job by hand: the moment a reward finishes is the test's."""

    def __init__(self) -> None:
        self.jobs: list[tuple[Future, Callable[..., Any], tuple[Any, ...]]] = []

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        self.jobs.append((future, fn, args))
        return future


async def test_a_cancel_that_lands_as_the_reward_finishes_is_not_dropped():
    """The cause of issue 23's hang: on Python 3.11 asyncio.wait_for returned the reward's
    scores and dropped a cancel that arrived in the loop iteration in which they came back,
    so a cancelled sampler ran on (and blocked forever on its full queue)."""
    executor = HeldExecutor()
    scoring = asyncio.create_task(score_completions(reward_spec(["exact"]), ["1+1="], ["2"], [{"answer": "2"}],
                                                    executor))
    for _ in range(100):
        if executor.jobs:
            break
        await asyncio.sleep(0)
    [(future, function, args)] = executor.jobs
    future.set_result(function(*args))  # the reward finishes ...
    scoring.cancel()  # ... and the cancel lands before the scoring task runs again
    with pytest.raises(asyncio.CancelledError):
        await scoring
