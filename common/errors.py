"""The one error tree of dualvllm.

    DualVLLMError
    ├── InvalidInputError (also ValueError)   bad arguments, config or input file
    │   ├── InputFormatError                  a malformed line of a JSONL input file
    │   └── UnknownModelError                 a server does not serve the model name asked for
    ├── IncompatibleModelsError               the two servers' tokenizers disagree
    ├── TopKUnsupportedError                  a server refuses the requested top_k
    ├── LockstepUnavailableError              lockstep mode asked for, and a server cannot do it
    ├── LifecycleError                        a client/coordinator used outside `async with`
    ├── ServerStartupError                    a launched vLLM server died or never got healthy
    ├── GenerationFailedError                 a caller needed every sequence, and some failed
    ├── WeightSyncError                       a weight push did not take: the server serves other weights
    ├── NoTrainingSignalError                 sampled data holds nothing to learn from (e.g. no DPO pair)
    ├── RankStoppedError                      a learner process's rank 0 ended the run with an error
    ├── ServiceBusyError                      the q* service's queue is full (HTTP 429, Retry-After)
    ├── ShutdownTimeoutError                  something being stopped did not stop within its bound
    └── ServerError                           a request to a running server failed
        ├── ServerUnavailableError            connection reset / closed after sending (retried if idempotent)
        │   └── ServerConnectError            no connection opened: refused, DNS, connect timeout (retried)
        ├── ServerTimeoutError                no answer within the timeout (retried if idempotent)
        ├── ServerStatusError                 a non-2xx answer
        │   ├── ServerRejectedError           4xx: the request is wrong, never retried
        │   └── ServerInternalError           5xx: the server failed (retried if idempotent)
        └── MalformedResponseError            2xx, but not the JSON we asked for

Two flags on each ServerError class drive `dualvllm.engines.http`'s retries: `retryable` (a fresh
try may succeed) and `request_sent` (the server may have received the request and acted
on it). An idempotent call is resent on any retryable error; a call that changes state
(a weight reload) only when `request_sent` is False, since otherwise a resend could act twice.

Lower-level exceptions (aiohttp, asyncio, OSError) are translated into this tree at one
place per boundary (`dualvllm.engines.http`, `dualvllm.engines.launcher`) with `raise ... from exc`.
Every message says what failed and what to do about it.
"""

from __future__ import annotations


class DualVLLMError(Exception):
    """Root of every error dualvllm raises on purpose."""


class InvalidInputError(DualVLLMError, ValueError):
    """An argument, config value or input record is invalid."""


class InputFormatError(InvalidInputError):
    """A line of an input file cannot be parsed; names the file and the line number."""

    def __init__(self, path: str, line_number: int, problem: str) -> None:
        self.path = path
        self.line_number = line_number
        super().__init__(f"{path}:{line_number}: {problem}")


class UnknownModelError(InvalidInputError):
    """The model name given for a server is not among the models it serves."""


class IncompatibleModelsError(DualVLLMError):
    """The base and teacher servers do not share a tokenizer, so token ids cannot be mixed."""


class TopKUnsupportedError(DualVLLMError):
    """A server refuses to return as many logprobs as the configured top_k."""


class LockstepUnavailableError(DualVLLMError):
    """mode="lockstep", and a server lacks the dualvllm plugin or runs with chunked prefill."""


class LifecycleError(DualVLLMError):
    """An object was used before `async with` entered it, after it closed, or entered twice."""


class ServerStartupError(DualVLLMError):
    """A vLLM server started by dualvllm exited or did not become healthy in time."""


class GenerationFailedError(DualVLLMError):
    """Sequences came back with errors where the caller cannot go on without them."""


class WeightSyncError(DualVLLMError):
    """Pushed weights are not what the server serves: its logprobs on probe contexts differ
    from the learner's, or the checkpoint could not be written where a push needs it."""


class NoTrainingSignalError(DualVLLMError):
    """A training run sampled data that holds nothing to learn from, such as no preference
    pair because every prompt's rollouts were all right or all wrong."""


class RankStoppedError(DualVLLMError):
    """Rank 0 of several learner processes ended the run with an error, so this rank stops too
    (rank 0's log names the cause; dualvllm.training.data_parallel)."""


class ServiceBusyError(DualVLLMError):
    """The q* HTTP service holds as many sequences as it may queue; retry after `retry_after_s`."""

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        self.retry_after_s = retry_after_s
        super().__init__(message)


class ShutdownTimeoutError(DualVLLMError):
    """A task or resource being stopped did not stop within its bound; names what was awaited,
    so that a process exits non-zero instead of waiting forever."""


class ServerError(DualVLLMError):
    """A request to a running server failed. `server` names which one (e.g. 'theta')."""

    retryable: bool = False  # a fresh try may succeed
    request_sent: bool = True  # the server may have received the request, and acted on it

    def __init__(self, server: str, url: str, message: str) -> None:
        self.server = server
        self.url = url
        super().__init__(f"[{server} {url}] {message}")


class ServerUnavailableError(ServerError):
    """The connection failed (reset, closed by the server) after the request may have gone out."""

    retryable = True


class ServerConnectError(ServerUnavailableError):
    """No connection could be opened (refused, name not resolved, connect timeout): nothing was sent."""

    request_sent = False


class ServerTimeoutError(ServerError):
    """The server did not answer within the configured timeout."""

    retryable = True


class ServerStatusError(ServerError):
    """The server answered with a non-2xx HTTP status."""

    def __init__(self, server: str, url: str, status: int, body: str) -> None:
        self.status = status
        self.body = body
        super().__init__(server, url, f"HTTP {status}: {body[:500]}")


class ServerRejectedError(ServerStatusError):
    """4xx: the request itself is wrong. Retrying cannot help, so it never is."""


class ServerInternalError(ServerStatusError):
    """5xx: the server failed to handle a valid request. Retried with backoff."""

    retryable = True


class MalformedResponseError(ServerError):
    """A 2xx answer whose JSON lacks what the API promises; usually a version mismatch."""
