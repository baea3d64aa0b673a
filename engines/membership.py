"""Who is in a replica pool: which replicas are up, the weights they must agree on, rejoins.

`dualvllm.engines.pool.ReplicaPool` routes requests; its `membership` (this) decides which replicas
may take them:
- `take_out` marks a replica down (a request still failing after its retries, a failed push);
- a prober asks every down replica for /health, then the checks added with
  `add_rejoin_check`, then the weights probe, and lets it rejoin when it answers with the
  same weights as the others (`refresh_reference` after each push moves that reference); a
  replica refused there is checked again at doubling intervals, but asked /health at every
  one, so that a restart (its /health failing for a while) ends the backoff;
- `changing()` brackets a state change to every healthy replica (a weight push): a replica
  whose checks overlap one stays down and is probed again after it. A generation counter, not
  a lock: nothing is held across the change's I/O.

Every down, refusal and rejoin is logged and counted (`PoolCounters`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from dataclasses import dataclass
from typing import TypeVar
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import numpy as np

from dualvllm.common.errors import DualVLLMError, IncompatibleModelsError, ServerError, ServerRejectedError
from dualvllm.common.tasks import stop
from dualvllm.engines.protocol import Engine, TopKBatch

log = logging.getLogger("dualvllm.pool")
T = TypeVar("T")

# How often a down replica is asked whether it is back: often enough that a restarted
# server rejoins within seconds, rarely enough to cost nothing.
PROBE_INTERVAL_S = 2.0
# A replica that answers /health but cannot rejoin (other weights, a failed catch-up push)
# is a state an operator has to fix; it is retried at doubling intervals up to this, and
# warned about once per distinct reason, not every probe interval.
MAX_RECHECK_S = 60.0
# Replicas of one role must report the same top-k logprobs on the probe contexts within
# this (nats). One build on one kind of device agrees exactly; float32 against bfloat16 is ~0.01.
WEIGHTS_TOLERANCE_NATS = 1e-3
WEIGHTS_PROBE_K = 5
# The prober ends at its next await once cancelled (a /health call or a sleep).
STOP_S = 30.0


@dataclass
class PoolCounters:
    moves: int = 0  # sequences moved off a replica that went down
    downs: int = 0  # replicas marked down
    rejoins: int = 0  # replicas back after a probe
    refusals: int = 0  # probes of a replica that answered /health but failed a rejoin check

    def summary(self, prefix: str) -> dict[str, float]:
        return {
            f"{prefix}_replica_moves": self.moves,
            f"{prefix}_replica_downs": self.downs,
            f"{prefix}_replica_rejoins": self.rejoins,
            f"{prefix}_replica_refusals": self.refusals,
        }


class Membership:
    """The replicas of one role and which of them are up."""

    def __init__(
        self,
        replicas: Sequence[Engine],
        *,
        name: str,
        url: str,
        probe_contexts: Sequence[Sequence[int]] = (),
        probe_interval_s: float = PROBE_INTERVAL_S,
        tolerance: float = WEIGHTS_TOLERANCE_NATS,
    ) -> None:
        self.name, self.url = name, url
        self.replicas = list(replicas)
        self._up = [True] * len(self.replicas)
        self._probe_contexts = [list(c) for c in probe_contexts]
        self._reference: TopKBatch | None = None  # what healthy replicas answer on the probe contexts
        self._probe_interval_s = probe_interval_s
        self._tolerance = tolerance
        self._prober: asyncio.Task[None] | None = None
        # Down replicas that answer /health but failed to rejoin: replica -> (retry at, delay, reason).
        self._refused: dict[int, tuple[float, float, str]] = {}
        self.counters = PoolCounters()
        # Awaited in the order added on a down replica that passed /health, before its weights
        # probe; a raise keeps it down (add_rejoin_check).
        self._rejoin_checks: list[Callable[[Engine], Awaitable[None]]] = []
        # State changes to every replica (weight pushes, `changing`): how many began or ended, and
        # how many are in flight. A replica whose rejoin checks overlapped one is not admitted:
        # it is probed again after the change, and caught up then. No lock is held across I/O.
        self._generation = 0
        self._changes_in_flight = 0

    def is_up(self, replica: int) -> bool:
        return self._up[replica]

    def add_rejoin_check(self, check: Callable[[Engine], Awaitable[None]]) -> None:
        """Await `check(replica)` on every down replica that answers /health again, after the
        checks added before it and before the weights probe; a raise keeps the replica down.
        The coordinator adds one (lockstep: does it carry the plugin), a trainer another (push
        it the newest weights, which it missed while down)."""
        self._rejoin_checks.append(check)

    @contextlib.asynccontextmanager
    async def changing(self) -> AsyncIterator[list[tuple[int, Engine]]]:
        """A state change (a weight push) to every healthy replica: yields them with their indexes. A replica
        that passes its rejoin checks while a change is in flight, or across one, stays down and
        is probed again after it: it either got the change or rejoins after it, through the
        checks (a trainer's catches it up), never in between."""
        self._generation += 1
        self._changes_in_flight += 1
        try:
            yield [(i, self.replicas[i]) for i in self.healthy]
        finally:
            self._changes_in_flight -= 1
            self._generation += 1

    @property
    def healthy(self) -> list[int]:
        return [i for i, up in enumerate(self._up) if up]

    def describe(self, index: int) -> str:
        return f"{self.name} replica {getattr(self.replicas[index], 'url', index)}"

    # -- start-up ------------------------------------------------------------------------

    async def check_same_weights(self) -> None:
        """Refuse replicas that answer the probe contexts differently, naming them."""
        answers = await asyncio.gather(*(self._probe(r) for r in self.replicas))
        self._reference = answers[0]
        for index, answer in enumerate(answers[1:], start=1):
            gap = _gap(self._reference, answer)
            if gap > self._tolerance:
                raise IncompatibleModelsError(
                    f"{self.describe(0)} and {self.describe(index)} serve different weights: their top-"
                    f"{WEIGHTS_PROBE_K} logprobs on probe prompts differ by up to {gap:.4f} nats (tolerance "
                    f"{self._tolerance}). Replicas of one role must serve the same model; restart or remove "
                    f"{getattr(self.replicas[index], 'url', index)}."
                )

    async def _probe(self, replica: Engine) -> TopKBatch:
        return await replica.next_token_topk(self._probe_contexts, WEIGHTS_PROBE_K)

    def start_probing(self) -> None:
        if self._prober is None and len(self.replicas) > 1:
            self._prober = asyncio.create_task(self._probe_down_replicas(), name=f"dualvllm-{self.name}-prober")

    # -- down, and calls that fail over ---------------------------------------------------

    def take_out(self, replica: int, reason: object) -> None:
        """Mark `replica` down: its sequences move at their next step, and it is probed until it passes."""
        if self._up[replica]:
            self._up[replica] = False
            self.counters.downs += 1
            log.warning(
                "%s is down (%s); its sequences move to %d healthy replica(s)",
                self.describe(replica),
                reason,
                len(self.healthy),
            )

    async def call_any(self, call: Callable[[Engine], Awaitable[T]]) -> T:
        """`call` on the first healthy replica, the next one if it fails, and so on."""
        error: ServerError | None = None
        for replica in self.healthy:
            try:
                return await call(self.replicas[replica])
            except ServerRejectedError:
                raise
            except ServerError as exc:
                self.take_out(replica, exc)
                error = exc
        if error is None:  # none was healthy to begin with
            raise ServerError(self.name, self.url, "every replica of this role is down")
        raise error

    # -- shutdown ------------------------------------------------------------------------

    async def close(self) -> None:
        await stop(self._prober, what=f"the {self.name} pool's prober", timeout_s=STOP_S)
        self._prober = None

    # -- rejoin --------------------------------------------------------------------------

    async def _probe_down_replicas(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self._probe_interval_s)
            for replica in [i for i, up in enumerate(self._up) if not up]:
                if replica in self._refused and loop.time() < self._refused[replica][0]:
                    # Waiting out its backoff, it is still asked /health: an operator who fixes it
                    # restarts it, and what comes back is probed at once, not up to a minute later.
                    await self._still_answers(replica)
                    continue
                generation = self._generation
                if self._changes_in_flight or not await self._passes(replica):
                    continue
                if self._changes_in_flight or self._generation != generation:  # checked against the old state
                    log.info(
                        "%s passed its checks while the pool's replicas changed; probed again after the change",
                        self.describe(replica),
                    )
                    continue
                self._up[replica] = True  # no await since the check above: nothing changed in between
                self._refused.pop(replica, None)
                self.counters.rejoins += 1
                log.warning("%s passed /health and the weights probe: it rejoins the pool", self.describe(replica))

    async def _still_answers(self, replica: int) -> bool:
        """/health of a down replica; one that fails it forgets its refusal: whatever answers next
        (a restarted server) is probed afresh."""
        try:
            await self.replicas[replica].health()
        except ServerError:
            self._refused.pop(replica, None)
            return False  # still down: no log line every probe interval
        return True

    async def _passes(self, replica: int) -> bool:
        engine = self.replicas[replica]
        if not await self._still_answers(replica):
            return False
        try:
            for check in self._rejoin_checks:
                await check(engine)
            if self._reference is None or not self._probe_contexts:
                return True
            gap = _gap(self._reference, await self._probe(engine))
        except DualVLLMError as exc:
            self._refuse(replica, f"answers /health but cannot rejoin yet: {exc}")
            return False
        if gap > self._tolerance:
            self._refuse(
                replica,
                f"answers /health but serves other weights (top-{WEIGHTS_PROBE_K} logprobs "
                f"differ by {gap:.4f} nats); it stays out",
            )
        return gap <= self._tolerance

    def _refuse(self, replica: int, reason: str) -> None:
        """Keep a replica that answers /health out, retried at doubling intervals; warn on a new reason."""
        self.counters.refusals += 1
        _, delay, before = self._refused.get(replica, (0.0, self._probe_interval_s / 2, ""))
        delay = min(2 * delay, max(MAX_RECHECK_S, self._probe_interval_s))
        self._refused[replica] = (asyncio.get_running_loop().time() + delay, delay, reason)
        if _without_numbers(reason) != _without_numbers(before):
            log.warning(
                "%s %s (retried at doubling intervals up to %.0f s)", self.describe(replica), reason, MAX_RECHECK_S
            )

    async def refresh_reference(self) -> None:
        """New weights were pushed to the healthy replicas: a rejoining replica must match them."""
        if self._probe_contexts:
            self._reference = await self.call_any(self._probe)


def _without_numbers(reason: str) -> str:
    """A reason with its measured numbers blanked: the same failure measured again is not news."""
    return re.sub(r"[0-9.]+", "#", reason)


def _gap(a: TopKBatch, b: TopKBatch) -> float:
    """Largest |logprob difference| over the tokens both list per row; inf when the top-1 differs."""
    if a.token_ids.shape != b.token_ids.shape or not np.array_equal(a.token_ids[:, 0], b.token_ids[:, 0]):
        return float("inf")
    worst = 0.0
    for ids_a, lp_a, ids_b, lp_b in zip(a.token_ids, a.logprobs, b.token_ids, b.logprobs):
        other = dict(zip(ids_b.tolist(), lp_b.tolist()))
        shared = [(lp, other[i]) for i, lp in zip(ids_a.tolist(), lp_a.tolist()) if i in other and i >= 0]
        worst = max([worst, *(abs(x - y) for x, y in shared)])
    return worst
