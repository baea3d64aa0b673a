"""How the service's failures become HTTP answers: OpenAI error objects, in one place.

Requests the service refuses itself raise RequestError (with status, code and field);
everything else is classified by the project's error tree (dualvllm.common.errors).
"""

from __future__ import annotations

import logging
from typing import Any

from dualvllm.common.errors import (
    GenerationFailedError,
    InvalidInputError,
    LifecycleError,
    ServerError,
    ServerRejectedError,
    ServiceBusyError,
    TopKUnsupportedError,
    UnknownModelError,
    WeightSyncError,
)

log = logging.getLogger("dualvllm.service")


class RequestError(InvalidInputError):
    """A request the service refuses, with its HTTP status, OpenAI code and field."""

    def __init__(self, message: str, *, status: int = 400, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


def error_body(message: str, kind: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_of(exc: Exception) -> tuple[int, dict[str, Any]]:
    """(HTTP status, OpenAI error object) of a failure: the one place errors become answers."""

    def answer(
        status: int, message: str, kind: str, code: str | None = None, param: str | None = None
    ) -> tuple[int, dict[str, Any]]:
        return status, error_body(message, kind, code, param)

    if isinstance(exc, RequestError):
        return answer(exc.status, str(exc), "invalid_request_error", exc.code, exc.param)
    if isinstance(exc, UnknownModelError):
        return answer(404, str(exc), "invalid_request_error", "model_not_found", "model")
    if isinstance(exc, ServiceBusyError):
        return answer(429, str(exc), "rate_limit_error", "queue_full")
    if isinstance(exc, TopKUnsupportedError):
        return answer(400, str(exc), "invalid_request_error", "top_k_unsupported", "dualvllm.top_k")
    if isinstance(exc, (InvalidInputError, ServerRejectedError)):
        return answer(400, str(exc), "invalid_request_error")
    if isinstance(exc, (ServerError, GenerationFailedError)):
        return answer(502, f"a model server failed: {exc}", "upstream_error")
    if isinstance(exc, WeightSyncError):
        return answer(502, f"a weight update of the base servers failed: {exc}", "upstream_error")
    if isinstance(exc, LifecycleError):
        return answer(503, f"the coordinator is not running: {exc}", "server_error")
    log.error("unexpected error in the q* service", exc_info=exc)
    return answer(500, f"internal error ({type(exc).__name__}); see the service's log", "server_error")
