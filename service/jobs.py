"""What a validated request becomes (Job) and the service's bounded queue (RequestQueue).

A leaf of service/: it imports the request schema and the two response formats, nothing
that serves. dualvllm.service.building builds Jobs from requests; dualvllm.service.running, streaming and metrics
read them.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from collections.abc import Callable, Iterator

from dualvllm.common.errors import ServiceBusyError
from dualvllm.coordinator.sequence import SamplingParams
from dualvllm.service.formats import Format
from dualvllm.service.schema import ChatCompletionRequest, CompletionRequest, QStarOptions

# Retry-After bounds: sooner is a busy loop for clients, later leaves the service idle.
RETRY_AFTER_MIN_S = 1
RETRY_AFTER_MAX_S = 60


@dataclass(frozen=True)
class Job:
    """One validated request, ready for the coordinator."""

    format: Format  # completion or chat: how its answers are written
    request: CompletionRequest | ChatCompletionRequest
    prompts: list[tuple[list[int], list[int]]]  # (base ids, teacher ids) per prompt
    max_tokens: int  # 0: echo only, nothing generated
    top_logprobs: int
    want_logprobs: bool
    echo: bool = False  # completions: the prompt comes first in each choice, scored when want_logprobs
    prompt_logprobs: int | None = None  # completions: vLLM's top-N logprobs of every prompt position

    @property
    def options(self) -> QStarOptions:
        return self.request.dualvllm

    @functools.cached_property
    def params(self) -> SamplingParams:
        """The coordinator's settings for the job's sequences. An echo-only job (max_tokens 0)
        gets those of a one-token call: the same settings shape its q*."""
        body, options = self.request, self.options
        return SamplingParams(
            max(self.max_tokens, 1),
            temperature=body.temperature,
            stop=tuple(body.stop_strings()),
            stop_token_ids=body.stop_ids(),
            fixed_alpha=options.fixed_alpha,
            return_diagnostics=options.return_diagnostics,
            ignore_eos=options.ignore_eos or body.ignore_eos,
            top_k=options.top_k,
            top_logprobs=self.top_logprobs,
        )

    @property
    def sequences(self) -> int:
        return len(self.prompts) * self.request.n

    @property
    def prompt_tokens(self) -> int:
        return sum(len(theta) for theta, _ in self.prompts)


class RequestQueue:
    """The service's bounded queue: sequences admitted and not yet finished."""

    def __init__(self, capacity: int, max_queued: int) -> None:
        self.capacity = capacity  # the coordinator's running batch
        self.max_queued = max_queued
        self.sequences = 0
        self.tokens = 0  # the admitted sequences' max_tokens, summed

    @property
    def running(self) -> int:
        """Admitted sequences in the coordinator's running batch; the rest are queued."""
        return min(self.sequences, self.capacity)

    @contextlib.contextmanager
    def hold(self, sequences: int, tokens: int, tokens_per_s: Callable[[], float]) -> Iterator[None]:
        """Admit a request's sequences for the block, or raise ServiceBusyError; `tokens_per_s`
        (the coordinator's recent speed) is asked only then."""
        if self.sequences + sequences > self.capacity + self.max_queued:
            # Time until the work already admitted is done, at the recent speed.
            wait_s = (self.tokens + tokens) / max(tokens_per_s(), 1.0)
            retry = min(max(math.ceil(wait_s), RETRY_AFTER_MIN_S), RETRY_AFTER_MAX_S)
            raise ServiceBusyError(
                f"the service is full: {self.sequences} sequences admitted, room for "
                f"{self.capacity + self.max_queued} ({self.capacity} running, {self.max_queued} queued); "
                f"this request needs {sequences}. Retry after {retry} s, or raise max_queued_sequences",
                retry_after_s=retry,
            )
        self.sequences += sequences
        self.tokens += tokens
        try:
            yield
        finally:
            self.sequences -= sequences
            self.tokens -= tokens
