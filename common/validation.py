"""Make pydantic models raise the project's InvalidInputError, in one line, instead of ValidationError."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from dualvllm.common.errors import InvalidInputError


class RaisesInvalidInput:
    """Mixin for pydantic models: construction errors become a one-line InvalidInputError.

    ValidationError is already a ValueError, but callers of this project catch one error
    tree, and the command line prints an error as one line: each failed field becomes
    "field=value: what is wrong", and the messages of model validators are kept as written.
    """

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            assert isinstance(self, BaseModel), f"{type(self).__name__}: RaisesInvalidInput mixes into pydantic models"
            problems = "; ".join(_describe(error, type(self).model_fields) for error in exc.errors(include_url=False))
            raise InvalidInputError(f"invalid {type(self).__name__}: {problems}") from exc


def _describe(error: Any, fields: dict[str, Any]) -> str:
    message = error["msg"].removeprefix("Value error, ")
    name = ".".join(str(part) for part in error["loc"])
    if not name:  # a model validator: its message names the fields itself
        return message
    if error["type"] == "extra_forbidden":
        return f"unknown option {name!r}; the options are {', '.join(fields)}"
    if error["type"] == "missing":  # its input is every other value: not worth echoing
        return f"{name} is required"
    if "key" in name or "secret" in name:  # never echo a credential
        return f"{name}: {message}"
    shown = repr(error["input"])
    return f"{name}={shown if len(shown) <= 60 else shown[:57] + '...'}: {message}"
