"""Per-sequence state while a sequence is being generated, and its stop rules."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from dualvllm.common.errors import InvalidInputError
from dualvllm.coordinator.outputs import FinishReason, GenerationOutput, Prompt
from dualvllm.theory.diagnostics import summarize


# OpenAI's limit on top_logprobs, and vLLM's default.
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """Per-call sampling settings, validated on construction (InvalidInputError names the bad value).

    One value goes through `DualVLLMCoordinator.stream` / `generate_batch`, the HTTP service and
    the CLI: `c.generate_batch(prompts, SamplingParams(max_tokens=8, temperature=0))`, or the same
    fields as keywords (`c.generate_batch(prompts, max_tokens=8)`).
    """

    max_tokens: int
    temperature: float = 1.0  # 0 = greedy over q* (alpha* then solved at temperature 1)
    stop: tuple[str, ...] = ()  # a single string is taken as one stop string
    stop_token_ids: frozenset[int] = frozenset()
    fixed_alpha: float | None = None  # None = solve alpha* per token; 0 = base only, 1 = teacher only
    return_diagnostics: bool = False
    ignore_eos: bool = False  # keep going past EOS (benchmarks that need fixed lengths)
    top_k: int | None = None  # candidates per model to mix (<= the coordinator's top_k); None = all fetched
    top_logprobs: int = 0  # per token, also record q*'s most likely candidates (OpenAI's top_logprobs)
    record_topk: int = 0  # per token, also record each model's k most likely ids and raw logprobs (losses)
    max_alpha: float | None = None  # cap on alpha* (an alpha schedule); None = no cap

    def __post_init__(self) -> None:
        if not _count(self.max_tokens) or self.max_tokens < 1:
            raise InvalidInputError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t >= 0 or not np.isfinite(t):
            raise InvalidInputError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        for name in ("fixed_alpha", "max_alpha"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0
            ):
                raise InvalidInputError(f"{name} must be in [0, 1] (0 = base only) or None, got {value!r}")
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not isinstance(s, str) or not s for s in stops):
            raise InvalidInputError(f"stop strings must be non-empty strings, got {stops!r}")
        ids = tuple(self.stop_token_ids or ())
        if not all(_count(i) for i in ids):
            raise InvalidInputError(f"stop_token_ids must be token ids (integers >= 0), got {ids!r}")
        if self.top_k is not None and (not _count(self.top_k) or self.top_k < 1):
            raise InvalidInputError(
                f"top_k must be a positive integer or None (all fetched candidates), got {self.top_k!r}"
            )
        if not _count(self.top_logprobs) or self.top_logprobs > MAX_TOP_LOGPROBS:
            raise InvalidInputError(
                f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}"
            )
        if not _count(self.record_topk):
            raise InvalidInputError(
                f"record_topk must be an integer >= 0 (0 = record nothing), got {self.record_topk!r}"
            )
        # Normalized forms (the dataclass is frozen: set through object).
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "stop", stops)
        object.__setattr__(self, "stop_token_ids", frozenset(int(i) for i in ids))


def _count(value: object) -> bool:
    """An integer >= 0 that is not a bool (True is 1 to Python, never a count to a caller)."""
    return bool(isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 0)


# Called with (sequence index, tokens that became final since the last call, their log q*,
# their top candidates {token id: log q*} when the call asked for top_logprobs, else empty):
# how a caller streams tokens as they are decided (the HTTP service's server-sent events).
TokenListener = Callable[[int, Sequence[int], Sequence[float], Sequence[Mapping[int, float]]], None]
# Uniforms a sequence draws at once (SequenceState.uniform): a typical completion's tokens.
UNIFORM_BLOCK = 64


@dataclass
class SequenceState:
    """A sequence in flight: both prompts as token ids, the shared continuation, records."""

    index: int
    prompt: Prompt
    # Tuples: CPython stops tracking a tuple of ints at its first collection, so that full
    # collections skip long prompts (a list's every element is visited by each one).
    theta_prompt_ids: tuple[int, ...]
    t_prompt_ids: tuple[int, ...]
    params: SamplingParams
    rng: np.random.Generator
    sink: asyncio.Queue[GenerationOutput]
    key: int = -1  # unique within a coordinator: how replica pools keep a sequence on one replica
    tokens: list[int] = field(default_factory=list)
    # Lists, not array("d"): an array's append costs 2.5x a list's (56 against 22 ns), and with
    # the start-up heap frozen (common/heap.py) full collections, which walk every element,
    # are rare (none in a round of 1,024 sequences of 512 tokens: coordinator_capacity.py).
    alphas: list[float] = field(default_factory=list)
    logprobs_q: list[float] = field(default_factory=list)
    logprobs_theta: list[float] = field(default_factory=list)
    logprobs_t: list[float] = field(default_factory=list)
    diagnostics: dict[str, list[float]] = field(default_factory=dict)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # when params.top_logprobs > 0
    # When params.record_topk > 0, per token: int64 [2, k] ids and float64 [2, k] raw logprobs
    # of the base (row 0) and the teacher (row 1).
    topk_ids: list[np.ndarray] = field(default_factory=list)
    topk_logprobs: list[np.ndarray] = field(default_factory=list)
    listener: TokenListener | None = None
    published: int = 0  # tokens already handed to the listener
    text: str | None = None  # set when stop strings are checked, or at the end
    finish_reason: FinishReason | None = None
    error: str | None = None
    cancelled: bool = False  # the caller stopped listening; drop at the next step
    # Draws of `rng` taken ahead, UNIFORM_BLOCK at a time (see `uniform`).
    _uniforms: list[float] = field(default_factory=list, repr=False)
    # The longer prompt's length: where the context limit counts from.
    context_start: int = field(init=False, default=0, repr=False)

    def uniform(self) -> float:
        """The next uniform in [0, 1) of this sequence's sampler: the draw of its next token.

        numpy's Generator costs ~0.5 µs per call, more than the whole compiled step per row, so
        draws are taken UNIFORM_BLOCK at a time; `rng.random(n)` yields the very numbers n calls
        of `rng.random()` would, so a seed gives the same tokens either way. A scheduler that
        samples through here must not draw from `rng` directly (speculative mode only does that).
        """
        if not self._uniforms:
            self._uniforms = self.rng.random(UNIFORM_BLOCK).tolist()[::-1]
        return self._uniforms.pop()

    def __post_init__(self) -> None:
        self.theta_prompt_ids, self.t_prompt_ids = tuple(self.theta_prompt_ids), tuple(self.t_prompt_ids)
        self.context_start = max(len(self.theta_prompt_ids), len(self.t_prompt_ids))

    def theta_context(self) -> list[int]:
        return [*self.theta_prompt_ids, *self.tokens]

    def t_context(self) -> list[int]:
        return [*self.t_prompt_ids, *self.tokens]

    def fail(self, message: str) -> None:
        self.finish_reason, self.error = "error", message

    def append(
        self,
        token: int,
        alpha: float,
        logprob_q: float,
        logprob_theta: float,
        logprob_t: float,
        diagnostics: Mapping[str, float],
        eos_ids: frozenset[int],
        max_len: int,
    ) -> None:
        """Record one emitted token (the per-token values GenerationOutput reports; `diagnostics`
        kept only if the call asked for them), then finish on EOS, a stop token, max_tokens or
        the context limit (`max_len` tokens of prompt + generation), in that order.

        Called once per token of every sequence, so the arguments are positional: keywords
        made a 64-sequence step's records take 106 µs instead of 93.
        """
        params = self.params
        self.tokens.append(token)
        self.alphas.append(alpha)
        self.logprobs_q.append(logprob_q)
        self.logprobs_theta.append(logprob_theta)
        self.logprobs_t.append(logprob_t)
        if params.return_diagnostics:
            for key, value in diagnostics.items():
                self.diagnostics.setdefault(key, []).append(value)
        if token in eos_ids and not params.ignore_eos:
            self.finish_reason = "eos"
        elif token in params.stop_token_ids:
            self.finish_reason = "stop_token"
        elif len(self.tokens) >= params.max_tokens:
            self.finish_reason = "max_tokens"
        elif self.context_start + len(self.tokens) >= max_len:
            self.finish_reason = "context_limit"

    def publish(self) -> None:
        """Hand the tokens decided since the last call to the listener. Schedulers call it once
        a step's tokens are final (never before a speculative round's stop-string replay)."""
        if self.listener is not None and len(self.tokens) > self.published:
            start, self.published = self.published, len(self.tokens)
            self.listener(self.index, self.tokens[start:], self.logprobs_q[start:], self.top_logprobs[start:])

    def truncate(self, n: int) -> None:
        """Forget every token after the first n (and its records, text and finish)."""
        assert n >= self.published, f"sequence {self.index}: {self.published} tokens were already published"
        records: tuple[list[Any], ...] = (
            self.tokens,
            self.alphas,
            self.logprobs_q,
            self.logprobs_theta,
            self.logprobs_t,
            self.top_logprobs,
            self.topk_ids,
            self.topk_logprobs,
            *self.diagnostics.values(),
        )
        for values in records:
            del values[n:]
        self.finish_reason, self.text = None, None

    def check_stop_strings(self, text: str) -> None:
        """Cut `text` before the earliest stop string; finish if one occurred."""
        cut = min((i for i in (text.find(s) for s in self.params.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text = text[:cut]
            if self.finish_reason is None or self.finish_reason in ("max_tokens", "context_limit"):
                self.finish_reason = "stop_string"
        else:
            self.text = text

    def tokens_for_text(self) -> list[int]:
        """Generated tokens whose text the output shows: a final EOS/stop token is not text."""
        if self.finish_reason in ("eos", "stop_token") and self.tokens:
            return self.tokens[:-1]
        return self.tokens

    def output(self) -> GenerationOutput:
        assert self.finish_reason is not None, f"sequence {self.index} is not finished"
        diagnostics = None
        if self.params.return_diagnostics and self.diagnostics:
            diagnostics = summarize({k: np.asarray(v) for k, v in self.diagnostics.items()})
        return GenerationOutput(
            index=self.index,
            prompt=self.prompt,
            generated_text=self.text or "",
            generated_tokens=list(self.tokens),
            alpha_history=self.alphas,
            logprobs_q=self.logprobs_q,
            logprobs_theta=self.logprobs_theta,
            logprobs_t=self.logprobs_t,
            finish_reason=self.finish_reason,
            diagnostics=diagnostics,
            top_logprobs=self.top_logprobs if self.params.top_logprobs else None,
            error=self.error,
            **self._topk_arrays(),
        )

    def _topk_arrays(self) -> dict[str, np.ndarray]:
        """topk_ids int64 [T, 2, k] and topk_logprobs float64 [T, 2, k], when recorded."""
        k = self.params.record_topk
        if not k:
            return {}
        if not self.topk_ids:  # no token generated (an error before the first step)
            return {"topk_ids": np.zeros((0, 2, k), dtype=np.int64), "topk_logprobs": np.zeros((0, 2, k))}
        return {"topk_ids": np.stack(self.topk_ids), "topk_logprobs": np.stack(self.topk_logprobs)}
