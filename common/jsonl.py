"""Reading JSONL input files: one JSON object per line, every problem named by its line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dualvllm.common.errors import InputFormatError, InvalidInputError


def read_objects(path: Path, *, what: str = "input") -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank line of a JSONL file.

    A file that cannot be read raises InvalidInputError; a line that is not UTF-8, not
    JSON, or not a JSON object raises InputFormatError with its number. `what` names the
    file in messages ("input", "dataset").
    """
    objects = []
    try:
        with open(path, "rb") as lines:
            for number, raw in enumerate(lines, start=1):
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise InputFormatError(
                        str(path),
                        number,
                        f"not UTF-8 text (byte {raw[exc.start]:#04x} at "
                        f"column {exc.start + 1}); JSONL files are UTF-8: re-encode it",
                    ) from exc
                if not text.strip():
                    continue
                try:
                    record = json.loads(text)
                except ValueError as exc:
                    raise InputFormatError(str(path), number, f"not valid JSON ({exc})") from exc
                if not isinstance(record, dict):
                    raise InputFormatError(str(path), number, "each line must be a JSON object")
                objects.append((number, record))
    except OSError as exc:
        raise InvalidInputError(
            f"cannot read the {what} {path}: {exc.strerror or exc}; give a readable JSONL file"
        ) from exc
    return objects
