"""The one error tree of dualvllm.

    DualVLLMError
    ├── InvalidInputError (also ValueError)   bad arguments, config or input file
    │   ├── InputFormatError                  a malformed line of a JSONL input file
    │   └── UnknownModelError                 a server does not serve the model name asked for
    ├── IncompatibleModelsError               the two servers' tokenizers disagree
    ├── TopKUnsupportedError                  a server refuses the requested top_k
    ├── LifecycleError                        a client/coordinator used outside `async with`
    ├── ServerStartupError                    a launched vLLM server died or never got healthy
    ├── GenerationFailedError                 a caller needed every sequence, and some failed
    └── ServerError                           a request to a running server failed
        ├── ServerUnavailableError            connection refused / reset / DNS (retried)
        ├── ServerTimeoutError                no answer within the timeout (retried)
        ├── ServerStatusError                 a non-2xx answer
        │   ├── ServerRejectedError           4xx: the request is wrong, never retried
        │   └── ServerInternalError           5xx: the server failed (retried)
        └── MalformedResponseError            2xx, but not the JSON we asked for

Lower-level exceptions (aiohttp, asyncio, OSError) are translated into this tree at one
place per boundary (`engines.http`, `engines.launcher`) with `raise ... from exc`.
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


class LifecycleError(DualVLLMError):
    """An object was used before `async with` entered it, after it closed, or entered twice."""


class ServerStartupError(DualVLLMError):
    """A vLLM server started by dualvllm exited or did not become healthy in time."""


class GenerationFailedError(DualVLLMError):
    """Sequences came back with errors where the caller cannot go on without them."""


class ServerError(DualVLLMError):
    """A request to a running server failed. `server` names which one (e.g. 'theta')."""

    retryable: bool = False

    def __init__(self, server: str, url: str, message: str) -> None:
        self.server = server
        self.url = url
        super().__init__(f"[{server} {url}] {message}")


class ServerUnavailableError(ServerError):
    """The server could not be reached (connection refused, reset, name not resolved)."""

    retryable = True


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
