"""The shared-memory segments a test's weight pushes make, and whether any is left behind.

Asked of the test's own segments alone: other processes (a parallel test worker, a benchmark)
may be pushing meanwhile, so the segment directory as a whole says nothing.
"""

from __future__ import annotations

import contextlib

from dualvllm.engines.weight_transfer import segment_path


def record_segments(monkeypatch) -> list[str]:
    """From now on (until `monkeypatch` undoes it), the names of the segments pushes make, in order."""
    from dualvllm.training import weight_transfer

    made: list[str] = []
    make = weight_transfer._segment

    @contextlib.contextmanager
    def recorded(size):
        with make(size) as (name, buffer):
            made.append(name)
            yield name, buffer

    monkeypatch.setattr(weight_transfer, "_segment", recorded)
    return made


def left_behind(made: list[str]) -> list[str]:
    """Those of `made` that still exist (a push must unlink every segment it made)."""
    assert made, "no segment was made"
    return [name for name in made if segment_path(name).exists()]
