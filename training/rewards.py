"""Rewards for `--reward`: built-in ones and a user's `module:function`, weighted and summed.

Every reward has TRL's reward-function signature, so a TRL user's function works unchanged:

    f(prompts=[...], completions=[...], **row_fields) -> list[float | None]

Each row field arrives as a keyword holding a list with one value per completion (the
trainer also passes `completion_ids`, the sampled token ids). A function without
`**kwargs` is passed only the keywords it names. `None` means "cannot score this one":
that completion's total is `None` and the trainer leaves it out of the update.

Built-ins (`BUILT_IN`), each reading its reference from a row field (`required_fields`):

    exact    answer   1.0 if the first line (EOS text removed) is the answer
    math     answer   math-verify equivalence: LaTeX, \\boxed{}, "#### N"
    gsm8k    answer   the final number (its "#### N", or else its last) equals the gold's "#### N"
    code     tests    fraction of the tests (asserts, one a line, or a list) passed in the sandbox
    length   -        -(excess / length_budget): tokens with `completion_ids`, else characters
    format   -        1.0 if re.search(format_pattern, completion, re.DOTALL)

Where each piece runs:
- `reward_spec` runs in the parent: it imports every `module:function` there, so a typo
  fails before any server starts. The spec holds names, not functions, so it pickles.
- `score_completions` sends each reward one pool task per batch, one reward after the
  other; the worker resolves the name (cached per process, a user module imported on the
  import path the parent had) and calls the function once for the whole batch.

What a failing reward costs (the run goes on; each failure is one warning per batch):
- It raises or returns the wrong number of values: the batch's completions score `None`
  for it. A non-finite value or a non-number scores that completion `None`.
- It takes longer than `timeout_s`: the batch scores `None` for it, but a running pool
  task cannot be stopped, so the worker stays busy until the function returns. Later
  tasks queue behind it, and the queueing counts against their own timeout: with the
  one-worker `verifier_pool()`, a reward that never returns makes every later reward
  time out, and the pool's shutdown at the end of the run waits for it. `code` cannot
  hang (each sandbox run is killed after `SandboxLimits.wall_timeout_s`, a busy loop after
  `cpu_s` CPU seconds), but its runs are sequential: a batch of n completions that all
  loop costs up to n times that, so give `timeout_s` room for it.
- It kills its worker (os._exit, a segfault, the OOM killer): the pool is broken for
  good and `BrokenProcessPool` propagates, since nothing could be scored after it.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import logging
import math
import re
import sys
from concurrent.futures import BrokenExecutor, Executor
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable, Mapping, Sequence

from dualvllm.common.errors import InvalidInputError
from dualvllm.training.verifiers import code_reward_cases, exact_match, gsm8k_reward, math_reward

log = logging.getLogger("dualvllm.training")

RewardFunction = Callable[..., list[float | None]]


def reward_exact(
    prompts: Sequence[str], completions: Sequence[str], *, answer: Sequence[Any], **_: Any
) -> list[float | None]:
    """1.0 if the completion's first line, EOS text removed, is the row's `answer`."""
    return [None if a is None else exact_match(c, a) for c, a in zip(completions, answer)]


def reward_math(
    prompts: Sequence[str], completions: Sequence[str], *, answer: Sequence[Any], **_: Any
) -> list[float | None]:
    """1.0 if the completion's final answer equals `answer` under math-verify."""
    return [None if a is None else math_reward(c, str(a)) for c, a in zip(completions, answer)]


def reward_gsm8k(
    prompts: Sequence[str], completions: Sequence[str], *, answer: Sequence[Any], **_: Any
) -> list[float | None]:
    """1.0 if the completion's final number equals the "#### N" of the gold solution `answer`."""
    return [None if a is None else gsm8k_reward(c, str(a)) for c, a in zip(completions, answer)]


def reward_code(
    prompts: Sequence[str], completions: Sequence[str], *, tests: Sequence[Any], **_: Any
) -> list[float | None]:
    """Fraction of the row's `tests` the completion passes in the sandbox.

    `tests` is one string of assert statements, one a line, or a list of tests (each of
    which may span lines).
    """
    scores: list[float | None] = []
    for completion, cases in zip(completions, tests):
        if cases is None:
            scores.append(None)
            continue
        if isinstance(cases, str):
            cases = [line for line in cases.splitlines() if line.strip()]
        scores.append(code_reward_cases(completion, [str(case) for case in cases]))
    return scores


def reward_length(
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    length_budget: int,
    completion_ids: Sequence[Sequence[int] | None] | None = None,
    **_: Any,
) -> list[float | None]:
    """-(excess / length_budget), 0 at or under the budget.

    Length is in tokens where the row field `completion_ids` gives them, else in characters.
    """
    ids = completion_ids if completion_ids is not None else [None] * len(completions)
    lengths = [len(text) if tokens is None else len(tokens) for text, tokens in zip(completions, ids)]
    return [-max(0, n - length_budget) / length_budget for n in lengths]


def reward_format(
    prompts: Sequence[str], completions: Sequence[str], *, format_pattern: str, **_: Any
) -> list[float | None]:
    """1.0 if `format_pattern` is found in the completion (re.search, re.DOTALL), else 0.0."""
    return [1.0 if isinstance(c, str) and re.search(format_pattern, c, re.DOTALL) else 0.0 for c in completions]


BUILT_IN: dict[str, RewardFunction] = {
    "exact": reward_exact,
    "math": reward_math,
    "gsm8k": reward_gsm8k,
    "code": reward_code,
    "length": reward_length,
    "format": reward_format,
}
REQUIRED_FIELDS: dict[str, frozenset[str]] = {
    "exact": frozenset({"answer"}),
    "math": frozenset({"answer"}),
    "gsm8k": frozenset({"answer"}),
    "code": frozenset({"tests"}),
}


@dataclass(frozen=True)
class RewardSpec:
    """Which rewards to compute and how to weigh them. Pickles: functions are resolved by name."""

    names: tuple[str, ...]  # built-in names or "module:function", as given
    weights: tuple[float, ...]  # one per name
    length_budget: int | None = None  # for "length": the budget, in tokens (characters without ids)
    format_pattern: str | None = None  # for "format": the regex a completion must contain
    # The parent's sys.path when the spec was built: a worker started another way (spawn,
    # forkserver, or forked earlier) imports user modules from where the parent found them.
    import_path: tuple[str, ...] = field(default=(), repr=False)

    def keywords(self, name: str) -> dict[str, Any]:
        """The spec's parameters that built-in `name` takes."""
        if name == "length":
            return {"length_budget": self.length_budget}
        if name == "format":
            return {"format_pattern": self.format_pattern}
        return {}


def reward_spec(
    names: Sequence[str],
    weights: Sequence[float] | None = None,
    *,
    length_budget: int | None = None,
    format_pattern: str | None = None,
) -> RewardSpec:
    """A validated RewardSpec; every user `module:function` is imported here, in the parent.

    `weights=None` weighs every reward 1.0. Raises InvalidInputError saying what to change.
    """
    names = tuple(names)
    if not names:
        raise InvalidInputError(f"no reward given; name one or more of {', '.join(BUILT_IN)} or module:function")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise InvalidInputError(f"reward {repeated[0]!r} is named twice; name each reward once and weigh it instead")
    try:
        weights = tuple(float(w) for w in weights) if weights is not None else (1.0,) * len(names)
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"reward weights must be numbers, got {weights!r}") from exc
    if len(weights) != len(names):
        raise InvalidInputError(
            f"got {len(weights)} reward weights for {len(names)} rewards ({', '.join(names)}); "
            "give one weight per reward"
        )
    if not all(math.isfinite(w) for w in weights):
        raise InvalidInputError(f"reward weights must be finite numbers, got {list(weights)}")
    if "length" in names and (
        isinstance(length_budget, bool) or not isinstance(length_budget, int) or length_budget < 1
    ):
        raise InvalidInputError(
            f"reward 'length' needs a length budget of at least 1 token, got {length_budget!r}; set the length budget"
        )
    if "format" in names:
        if format_pattern is None:
            raise InvalidInputError("reward 'format' needs a format pattern (a regex); set the format pattern")
        try:
            re.compile(format_pattern, re.DOTALL)
        except re.error as exc:
            raise InvalidInputError(f"format pattern {format_pattern!r} is not a valid regex ({exc}); fix it") from exc
    spec = RewardSpec(
        names=names,
        weights=weights,
        length_budget=length_budget,
        format_pattern=format_pattern,
        import_path=tuple(sys.path),
    )
    for name in names:
        _check_user_function(name, spec.import_path)
    return spec


def required_fields(spec: RewardSpec) -> set[str]:
    """The row fields the spec's built-in rewards read; a user function declares none."""
    return set().union(*(REQUIRED_FIELDS.get(name, frozenset()) for name in spec.names))


@dataclass(frozen=True)
class Scores:
    total: list[float | None]  # weighted sum per completion; None if any reward gave None for it
    by_name: dict[str, list[float | None]]  # each reward separately, for logging


async def score_completions(
    spec: RewardSpec,
    prompts: Sequence[str],
    completions: Sequence[str],
    rows: Sequence[Mapping[str, Any]],
    executor: Executor,
    *,
    timeout_s: float = 60.0,
) -> Scores:
    """Score a batch with every reward of `spec`, each in one `executor` task, off the event loop.

    `rows[i]` holds completion i's row fields; each field reaches a reward as a list over
    the batch (missing in a row: None). The rewards run one after the other; `timeout_s`
    bounds each one, from its submission, so it includes waiting for a free worker. A
    reward that raises, outlives `timeout_s`, or returns the wrong length scores the
    batch `None`; see the module docstring for what a timeout costs the pool.
    """
    if not len(prompts) == len(completions) == len(rows):
        raise InvalidInputError(
            f"got {len(completions)} completions for {len(prompts)} prompts and {len(rows)} rows; "
            "give one prompt and one row per completion"
        )
    if timeout_s <= 0:
        raise InvalidInputError(f"timeout_s must be positive, got {timeout_s}")
    keys = dict.fromkeys(key for row in rows for key in row)
    fields = {key: [row.get(key) for row in rows] for key in keys}
    by_name: dict[str, list[float | None]] = {}
    for name in spec.names:
        by_name[name] = await _score_one(spec, name, list(prompts), list(completions), fields, executor, timeout_s)
    return Scores(total=weighted_total(spec.weights, [by_name[name] for name in spec.names]), by_name=by_name)


def weighted_total(weights: Sequence[float], scores: Sequence[Sequence[float | None]]) -> list[float | None]:
    """sum_k w_k r_k per completion, over rewards k; None where any r_k is None."""
    return [
        None if any(r is None for r in column) else sum(w * r for w, r in zip(weights, column))
        for column in zip(*scores)
    ]


async def _score_one(
    spec: RewardSpec,
    name: str,
    prompts: list[str],
    completions: list[str],
    fields: dict[str, list[Any]],
    executor: Executor,
    timeout_s: float,
) -> list[float | None]:
    n = len(completions)
    if n == 0:
        return []
    future = asyncio.get_running_loop().run_in_executor(executor, _call, spec, name, prompts, completions, fields)
    # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancel that lands as the
    # reward finishes (common/tasks.py), and the cancelled sampler then ran on forever.
    bound = asyncio.timeout(timeout_s)
    try:
        async with bound:
            scores = await future
    except BrokenExecutor:
        raise
    # A user's function may raise anything; it costs this batch its scores, not the run.
    except Exception as exc:  # noqa: BLE001
        if isinstance(exc, TimeoutError) and bound.expired():  # our timeout, not the reward's own
            log.warning(
                "reward %r did not finish within %g s; its %d completions score None "
                "(its pool worker stays busy until the function returns)",
                name,
                timeout_s,
                n,
            )
        else:
            log.warning("reward %r failed; its %d completions score None: %s: %s", name, n, type(exc).__name__, exc)
        return [None] * n
    if len(scores) != n:
        log.warning("reward %r returned %d values for %d completions; they score None", name, len(scores), n)
        return [None] * n
    bad = [s is not None and not math.isfinite(s) for s in scores]
    if any(bad):
        log.warning(
            "reward %r returned a non-number or non-finite value for %d of %d completions; they score None",
            name,
            sum(bad),
            n,
        )
    return [None if b else s for s, b in zip(scores, bad)]


def _call(
    spec: RewardSpec, name: str, prompts: list[str], completions: list[str], fields: dict[str, list[Any]]
) -> list[float | None]:
    """In a pool worker: one reward over the whole batch, values made plain floats."""
    function = _resolve(name, spec.import_path)
    keywords = {**fields, **spec.keywords(name), "prompts": prompts, "completions": completions}
    return [_as_float(value) for value in function(**_accepted(function, keywords))]


def _as_float(value: Any) -> float | None:
    """A number (numpy and torch scalars too) as float; anything else as NaN, so it scores None."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):  # e.g. a tensor of more than one element
        return math.nan


def _accepted(function: Callable[..., Any], keywords: dict[str, Any]) -> dict[str, Any]:
    """All of `keywords` for a function with **kwargs; otherwise only those it names."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # no signature to read: pass everything, as TRL does
        return keywords
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return keywords
    named = {p.name for p in parameters if p.kind is not p.POSITIONAL_ONLY}
    return {key: value for key, value in keywords.items() if key in named}


@functools.cache
def _resolve(name: str, import_path: tuple[str, ...]) -> RewardFunction:
    """The function a reward name stands for; a user module is imported once per process."""
    if name in BUILT_IN:
        return BUILT_IN[name]
    module_name, _, attribute = name.partition(":")
    sys.path.extend(entry for entry in import_path if entry not in sys.path)
    found: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        found = getattr(found, part)
    return found


def _check_user_function(name: str, import_path: tuple[str, ...]) -> None:
    """Refuse a reward name that is neither built in nor an importable, callable module:function."""
    if name in BUILT_IN:
        return
    module_name, colon, attribute = name.partition(":")
    if not colon or not module_name or not attribute:
        raise InvalidInputError(
            f"unknown reward {name!r}; use one of {', '.join(BUILT_IN)} or module:function for your own"
        )
    try:
        function = _resolve(name, import_path)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise InvalidInputError(
                f"reward {name!r}: importing {module_name!r} failed ({exc}); install what it needs"
            ) from exc
        raise InvalidInputError(
            f"reward {name!r}: no module named {module_name!r}; put its directory on PYTHONPATH"
        ) from exc
    except AttributeError as exc:
        raise InvalidInputError(
            f"reward {name!r}: module {module_name!r} has no {attribute!r}; check the function's name"
        ) from exc
    except Exception as exc:  # the module's own code failed while importing
        raise InvalidInputError(
            f"reward {name!r}: importing {module_name!r} raised {type(exc).__name__}: {exc}; fix the module"
        ) from exc
    if not callable(function):
        raise InvalidInputError(
            f"reward {name!r} is a {type(function).__name__}, not a function; "
            "name a function f(prompts, completions, **kwargs)"
        )
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # no signature to read: it will be tried on the first batch
        return
    if not any(
        p.kind is p.VAR_KEYWORD or (p.name == "completions" and p.kind is not p.POSITIONAL_ONLY) for p in parameters
    ):
        raise InvalidInputError(
            f"reward {name!r} takes no 'completions' argument; give it TRL's signature "
            "f(prompts, completions, **kwargs)"
        )
