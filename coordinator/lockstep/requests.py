"""The servers' lockstep requests: one long completion request per stream.

Each is tagged with this coordinator's address and the stream's id, so the server's plugin
reports the stream's rows here. A request is sent once and ends when the coordinator
answers END, when the server ends it on its own, or when it breaks; its end is handed to
`on_end` (the scheduler decides what the sequence does next).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import secrets
from dataclasses import dataclass
from collections.abc import Callable

from dualvllm.coordinator.lockstep.table import THETA, Live, LockstepTable, Stream
from dualvllm.engines.vllm_plugin import wire


@dataclass(eq=False)
class _Request:
    stream: Stream
    task: asyncio.Task[str]
    # Done when the server has taken the request in (its answer started) or the request ended.
    accepted: asyncio.Future[None]


class Requests:
    def __init__(
        self,
        table: LockstepTable,
        *,
        address: str,
        top_k: int,
        stop_token: int,
        max_len: int,
        on_end: Callable[[Stream, asyncio.Task[str]], None],
    ) -> None:
        self._table = table
        self._address = address
        self._top_k = top_k
        self._stop_token = stop_token
        self._max_len = max_len
        self._on_end = on_end
        self._running: dict[int, _Request] = {}  # by stream id, until the request's task ends
        # Ids start at a random point: a plugin that still counts positions for a previous
        # coordinator on the same port must never mistake these streams for its old ones.
        self._ids = itertools.count(secrets.randbits(40) << 20)

    def new_id(self) -> int:
        return next(self._ids)

    def start(self, live: Live, role: int) -> Stream:
        """Send `live`'s request to the role's server, continuing from its agreed tokens."""
        seq = live.seq
        prompt = seq.theta_context() if role == THETA else seq.t_context()
        agreed = len(seq.tokens)
        stream = self._table.open_stream(live, role, self.new_id(), offset=agreed)
        # One more than needed: the coordinator ends the request (END) before the server would.
        max_tokens = max(1, min(seq.params.max_tokens - agreed + 1, self._max_len - len(prompt)))
        args = wire.request_args(
            wire.Tagged(self._address, stream.id, offset=agreed, top_k=self._top_k, stop=self._stop_token)
        )
        accepted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(
            stream.engine.forced_generation(
                prompt,
                max_tokens=max_tokens,
                stop_token=self._stop_token,
                lockstep_args=args,
                on_accepted=functools.partial(_resolve, accepted),
            )
        )
        request = self._running[stream.id] = _Request(stream, task, accepted)
        task.add_done_callback(functools.partial(self._ended, request))
        return stream

    def accepted(self, streams: list[Stream]) -> list[asyncio.Future[None]]:
        """When each of `streams`' requests is taken in by its server (or has ended)."""
        return [self._running[s.id].accepted for s in streams if s.id in self._running]

    def tasks(self) -> list[asyncio.Task[str]]:
        return [request.task for request in self._running.values()]

    async def drain(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the running requests to end (each at its server's next step,
        once its rows are answered END)."""
        tasks = self.tasks()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)

    def _ended(self, request: _Request, task: asyncio.Task[str]) -> None:
        self._running.pop(request.stream.id, None)
        _resolve(request.accepted)
        if task.cancelled():
            self._table.streams.pop(request.stream.id, None)
            return
        task.exception()  # retrieved here: a retired stream's break (a dead server) is expected
        self._on_end(request.stream, task)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
