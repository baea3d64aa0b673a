"""Lockstep recovery: what a sequence does when one of its server requests ends before it does.

- The server ended it on its own (its stop token sampled as an ordinary token, its own
  max_tokens): resubmitted from the agreed tokens, with the position offset. The prefix
  cache makes the resubmission cheap.
- The request broke (a connection reset, a server killed or restarting): the sequence is
  taken off both servers. With another healthy replica of that role (replica pools,
  engines/pool.py) the server is taken out of its pool, every sequence on it is taken off
  too, and they all start again from their agreed tokens on the healthy replicas at once;
  the pool probes the server and lets it rejoin. Without one, they wait until that server
  answers /health again; a server that does not come back within `lockstep_restart_timeout`
  fails them.
- Any other request failure fails its sequence only.
"""

from __future__ import annotations

import asyncio
import logging

from dualvllm.common.errors import ServerError
from dualvllm.coordinator.config import CoordinatorConfig
from dualvllm.coordinator.lockstep.admission import Admission
from dualvllm.coordinator.lockstep.placement import Placement
from dualvllm.coordinator.lockstep.requests import Requests
from dualvllm.coordinator.lockstep.shell import Shell
from dualvllm.coordinator.lockstep.table import Live, LockstepTable, Stream
from dualvllm.engines.vllm_client import VLLMClient

log = logging.getLogger("dualvllm.coordinator")

# A sequence whose requests the servers keep ending on their own this often has
# something wrong with it (a server restarting in a loop); it fails instead.
MAX_RESUBMISSIONS = 64
# A sequence's requests may break this often (each already retried per dualvllm.engines.http's
# rules) before it fails: a connection closing under a reused request is worth a resend,
# a server that stays down is not.
MAX_REQUEST_FAILURES = 3


class Recovery:
    def __init__(
        self,
        table: LockstepTable,
        placement: Placement,
        requests: Requests,
        admission: Admission,
        *,
        config: CoordinatorConfig,
        shell: Shell,
    ) -> None:
        self._table = table
        self._placement = placement
        self._requests = requests
        self._admission = admission
        self._restart_timeout_s = config.lockstep_restart_timeout
        self._shell = shell
        self._recovering: set[str] = set()  # servers whose requests broke, until /health answers
        self.dead: dict[str, str] = {}  # servers that did not come back: why
        self.pauses = 0  # callers inside the scheduler's paused()

    @property
    def holding(self) -> bool:
        """Nothing may start: a server is coming back, or a caller paused generation."""
        return bool(self._recovering) or self.pauses > 0

    def stream_ended(self, stream: Stream, task: asyncio.Task[str]) -> None:
        self._shell.spawn(self._on_stream_end(stream, task))

    def take_off(self, live: Live) -> None:
        """End `live`'s streams (each at its next report) and queue it to start again, first,
        like a new sequence from its agreed tokens."""
        for stream in self._table.take_off(live):
            self._admission.gate.forget((stream.engine.url, stream.id))
        self._admission.requeue(live)

    def resubmit(self, live: Live, role: int) -> None:
        self._table.counters.resubmissions += 1
        self._requests.start(live, role)

    def resubmit_parked(self) -> None:
        parked, self._table.out.resubmit = self._table.out.resubmit, []
        for live, role in parked:
            self.resubmit(live, role)

    async def _on_stream_end(self, stream: Stream, task: asyncio.Task[str]) -> None:
        """A server request finished: expected (retired), or the sequence must go on."""
        async with self._shell.lock:
            if not self._table.stream_ended(stream):
                return
            try:
                self._admission.gate.forget((stream.engine.url, stream.id))
                self._continue_after(stream, task)
                self._shell.settle()
            except Exception as exc:  # a bug must not strand the sequence: fail it, loudly
                log.exception("lockstep: handling the end of a request failed")
                self._table.fail(stream.live, f"internal error in the lockstep coordinator: {exc!r}")
                self._shell.send_ready()

    def _continue_after(self, stream: Stream, task: asyncio.Task[str]) -> None:
        live = stream.live
        error = task.exception()
        if isinstance(error, ServerError) and error.retryable and live.request_failures < MAX_REQUEST_FAILURES:
            # The request broke: the sequence starts again from its agreed tokens on both
            # servers, under new stream ids (if the broken request did reach the server, its
            # rows are unknown here and answered END).
            live.request_failures += 1
            self._suspend(live, stream.role, stream.engine, error)
        elif error is not None:
            log.warning("%s lockstep request of a sequence failed: %s", stream.engine.name, error)
            self._table.fail(live, f"{stream.engine.name} server: {error}")
        elif live.resubmissions >= MAX_RESUBMISSIONS:
            self._table.fail(
                live,
                f"{stream.engine.name} server ended this sequence's request {live.resubmissions} "
                f"times before the coordinator did (last finish_reason {task.result()!r})",
            )
        else:
            live.resubmissions += 1
            self.resubmit(live, stream.role)

    def _suspend(self, live: Live, role: int, engine: VLLMClient, error: ServerError) -> None:
        """Take `live` off both servers until `engine` (its server of `role`) is back, or, when
        the role has another healthy replica, take `engine` out of its pool and move its
        sequences there."""
        self.take_off(live)
        if self._placement.take_out(role, engine, error):
            for other in [
                live for live in self._table.live if any(e.url == engine.url for e in live.engines)
            ]:  # its other sequences
                self.take_off(other)
            return
        if engine.url in self.dead:
            self._admission.fail_waiting(self.dead[engine.url])
        elif engine.url not in self._recovering:
            log.warning(
                "lockstep: a request to the %s server at %s broke (%s); its sequences resume from their "
                "agreed tokens once it answers /health (waiting up to %g s)",
                engine.name,
                engine.url,
                error,
                self._restart_timeout_s,
            )
            self._recovering.add(engine.url)
            self._shell.spawn(self._recover(engine))

    async def _recover(self, engine: VLLMClient) -> None:
        """Wait for a server whose request broke to answer /health, then let its sequences resume."""
        try:
            await engine.wait_healthy(self._restart_timeout_s)
        except ServerError as err:
            reason = (
                f"{engine.name} server at {engine.url} broke a lockstep request and did not answer /health "
                f"within lockstep_restart_timeout={self._restart_timeout_s:g} s ({err})"
            )
            log.error("lockstep: %s; failing its sequences", reason)
            async with self._shell.lock:
                self._recovering.discard(engine.url)
                self.dead[engine.url] = reason
                self._admission.fail_waiting(reason)
                self._table.fail_all(reason)
                self._shell.send_ready()
            return
        async with self._shell.lock:
            self._recovering.discard(engine.url)
            log.info(
                "lockstep: %s server at %s answers again; resuming %d sequences",
                engine.name,
                engine.url,
                self._admission.suspended,
            )
            self._shell.settle()
