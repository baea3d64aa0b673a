"""The event loop dualvllm's own entry points run on: uvloop, unless told otherwise.

The coordinator is one event loop that a lockstep step crosses four times (two reports in,
two replies out), so the loop's own cost per wake-up is paid per step. uvloop (libuv, in C)
runs the same asyncio code with less of it, as vLLM's own server does. Measured on a 2-core
VM (`python benchmarks/coordinator_capacity.py --floor`, both loops alternated twice), one
report in and its reply out cost 60-76 µs of coordinator CPU on uvloop against 84-94 on the
standard loop at batch 1, where plain blocking sockets cost 30-38; on the whole coordinator
the gain is inside that machine's noise (benchmarks/README.md, "uvloop").

`run` is used by the `dualvllm` command and the benchmarks, `new_event_loop` by the TRL
rollout function's background loop. A program that embeds the coordinator runs it on its own
loop, whichever it is: nothing in dualvllm needs uvloop.

    DUALVLLM_EVENT_LOOP=asyncio dualvllm serve ...   # the standard library's loop instead
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from typing import Any, TypeVar
from collections.abc import Coroutine

from dualvllm.common.errors import InvalidInputError

T = TypeVar("T")
LOOP_ENV = "DUALVLLM_EVENT_LOOP"
LOOPS = ("uvloop", "asyncio")


def chosen() -> str:
    """The loop `run` will use: DUALVLLM_EVENT_LOOP if set, else uvloop when it is installed."""
    name = os.environ.get(LOOP_ENV, "").strip().lower()
    if name and name not in LOOPS:
        raise InvalidInputError(
            f"{LOOP_ENV}={os.environ[LOOP_ENV]!r} is not an event loop dualvllm knows; "
            f"set it to one of {', '.join(LOOPS)}, or unset it (uvloop when installed)"
        )
    if name == "asyncio":
        return name
    if importlib.util.find_spec("uvloop") is None:  # a dependency except on Windows, where it is not built
        if name == "uvloop":
            raise InvalidInputError(
                f"{LOOP_ENV}=uvloop, but uvloop is not installed: `pip install uvloop`, or set {LOOP_ENV}=asyncio"
            )
        return "asyncio"
    return "uvloop"


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(main) on the chosen loop (SIGINT cancels `main` on either, as asyncio.run does)."""
    try:
        name = chosen()
    except InvalidInputError:
        main.close()  # never awaited: close it, or Python warns about it on exit
        raise
    if name == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new loop of the chosen kind, for a thread of its own (training/trl_rollouts.py)."""
    if chosen() == "uvloop":
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()
