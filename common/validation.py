"""Make pydantic models raise the project's InvalidInputError instead of ValidationError."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from common.errors import InvalidInputError


class RaisesInvalidInput:
    """Mixin for pydantic models: construction errors become InvalidInputError.

    ValidationError is already a ValueError, but callers of this project catch one
    error tree; the message keeps pydantic's per-field detail.
    """

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise InvalidInputError(f"invalid {type(self).__name__}: {exc}") from exc
