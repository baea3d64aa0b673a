"""Replicas of one role (base or teacher) behind the Engine protocol: sticky routing, failover, rejoin.

A per-token request carries each sequence's whole context, so any healthy replica of the
same weights can continue a sequence from its recorded tokens. The pool:
- routes each sequence (by the key the scheduler gives) to one replica and keeps it there,
  so that replica's prefix cache keeps working; new sequences go to the replica with the
  fewest;
- sends one batched request per replica that has rows, all concurrently, and puts the
  rows back in the caller's order;
- marks a replica down when a request to it still fails after its retries (never for a
  4xx: the request was wrong, not the server), moves its rows to the healthy replicas and
  sends them there in the same call. The caller sees one answer or, when no replica of
  the role is left, the last error;
- probes a down replica in the background (/health, then the checks added with
  `add_rejoin_check`, then the weights probe) and lets it rejoin when it answers with the same weights as the
  others. A trainer adds a check that pushes its newest weights first, takes a replica that
  failed a push out (`take_out`), and after each push makes the pushed weights the ones a
  rejoining replica must match (`refresh_reference`).

Every move, down and rejoin is logged and counted (`PoolCounters`).

In lockstep mode requests are not per token: the lockstep scheduler (coordinator/lockstep/)
places each sequence on a replica itself and uses the pool for the rest: which replicas
are up, `take_out` when one breaks, the prober and its hook for rejoins, the counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from dataclasses import dataclass
from typing import Any, TypeVar
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence

import numpy as np

from common.errors import DualVLLMError, IncompatibleModelsError, ServerError, ServerRejectedError
from common.tasks import stop
from engines.protocol import PAD_TOKEN_ID, Engine, ModelInfo, TopKBatch
from engines.vllm_client import VLLMClient

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
# The answer of a chunk whose replica failed (its rows went elsewhere).
_EMPTY = TopKBatch(token_ids=np.zeros((0, 0), dtype=np.int64), logprobs=np.zeros((0, 0)))


@dataclass
class PoolCounters:
    moves: int = 0  # sequences moved off a replica that went down
    downs: int = 0  # replicas marked down
    rejoins: int = 0  # replicas back after a probe
    refusals: int = 0  # probes of a replica that answered /health but failed a rejoin check

    def summary(self, prefix: str) -> dict[str, float]:
        return {f"{prefix}_replica_moves": self.moves, f"{prefix}_replica_downs": self.downs,
                f"{prefix}_replica_rejoins": self.rejoins, f"{prefix}_replica_refusals": self.refusals}


class ReplicaPool:
    """Implements `engines.protocol.Engine` for one role over several engines of the same weights."""

    def __init__(self, replicas: Sequence[Engine], *, name: str, probe_contexts: Sequence[Sequence[int]] = (),
                 probe_interval_s: float = PROBE_INTERVAL_S, tolerance: float = WEIGHTS_TOLERANCE_NATS) -> None:
        assert replicas, "a pool needs at least one replica"
        self.name = name
        self.replicas = list(replicas)
        self.url = ",".join(getattr(r, "url", r.name) for r in self.replicas)
        self._up = [True] * len(self.replicas)
        self._assigned: dict[int, int] = {}  # sequence key -> replica index
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

    def add_rejoin_check(self, check: Callable[[Engine], Awaitable[None]]) -> None:
        """Await `check(replica)` on every down replica that answers /health again, after the
        checks added before it and before the weights probe; a raise keeps the replica down.
        The coordinator adds one (lockstep: does it carry the plugin), a trainer another (push
        it the newest weights, which it missed while down)."""
        self._rejoin_checks.append(check)

    @contextlib.asynccontextmanager
    async def changing(self) -> AsyncIterator[list[int]]:
        """A state change (a weight push) to every healthy replica: yields their indexes. A replica
        that passes its rejoin checks while a change is in flight, or across one, stays down and
        is probed again after it: it either got the change or rejoins after it, through the
        checks (a trainer's catches it up), never in between."""
        self._generation += 1
        self._changes_in_flight += 1
        try:
            yield self.healthy
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
                    f"{getattr(self.replicas[index], 'url', index)}.")

    async def _probe(self, replica: Engine) -> TopKBatch:
        return await replica.next_token_topk(self._probe_contexts, WEIGHTS_PROBE_K)

    def start_probing(self) -> None:
        if self._prober is None and len(self.replicas) > 1:
            self._prober = asyncio.create_task(self._probe_down_replicas(), name=f"dualvllm-{self.name}-prober")

    async def close(self) -> None:
        await stop(self._prober, what=f"the {self.name} pool's prober", timeout_s=STOP_S)
        self._prober = None

    # -- Engine protocol -----------------------------------------------------------------

    async def health(self) -> None:
        """Every replica is healthy (the start-up check); raises the first replica's error."""
        await asyncio.gather(*(r.health() for r in self.replicas))

    async def model_info(self) -> ModelInfo:
        return await self._any(lambda r: r.model_info())

    async def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return await self._any(lambda r: r.tokenize(text, add_special_tokens=add_special_tokens))

    async def tokenize_chat(self, messages: Sequence[Mapping[str, Any]],
                            template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        return await self._any(lambda r: r.tokenize_chat(messages, template_kwargs))

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        return await self._any(lambda r: r.detokenize(token_ids))

    async def eos_token_ids(self) -> frozenset[int]:
        return await self._any(lambda r: r.eos_token_ids())

    async def prompt_topk(self, prompts: Sequence[Sequence[int]], k: int) -> list[TopKBatch]:
        """Prompt logprobs (engines.protocol.PromptScoringEngine) from any healthy replica: they
        hold the same weights (checked at start-up)."""
        return await self._any(lambda r: r.prompt_topk(prompts, k))  # type: ignore[attr-defined]

    async def prompt_logprobs(self, prompts: Sequence[Sequence[int]], k: int) -> list[list[dict[str, Any] | None]]:
        """vLLM's prompt logprobs (engines.protocol.PromptScoringEngine), from any healthy replica."""
        return await self._any(lambda r: r.prompt_logprobs(prompts, k))  # type: ignore[attr-defined]

    async def next_token_topk(self, contexts: Sequence[Sequence[int]], k: int,
                              keys: Sequence[int] | None = None) -> TopKBatch:
        """Top-k after each context; `keys` name the sequences (None: one-off rows, spread anew)."""
        if keys is None:  # one-off rows: spread, not kept
            keys = [-1 - i for i in range(len(contexts))]
        else:  # a per-token step carries every active sequence: the others finished
            keys = list(keys)
            self._assigned = {key: self._assigned[key] for key in keys if key in self._assigned}
        chunks = list(self._route(keys, list(range(len(contexts)))).items())  # (replica, rows)
        answers: dict[int, TopKBatch] = {}  # chunk index -> its rows' answer
        while len(answers) < len(chunks):
            pending = [c for c in range(len(chunks)) if c not in answers]
            got = await asyncio.gather(
                *(self.replicas[chunks[c][0]].next_token_topk([contexts[i] for i in chunks[c][1]], k) for c in pending),
                return_exceptions=True)
            orphans: list[int] = []
            for c, answer in zip(pending, got):
                replica, rows = chunks[c]
                if isinstance(answer, ServerError) and not isinstance(answer, ServerRejectedError):
                    self.take_out(replica, answer)
                    if not self.healthy:
                        raise answer
                    orphans.extend(rows)
                    answers[c] = _EMPTY
                elif isinstance(answer, BaseException):
                    raise answer
                else:
                    answers[c] = answer
            if orphans:  # their replica is down now: `assign` moves (and counts) the kept ones
                chunks.extend(self._route([keys[i] for i in orphans], orphans).items())
        return _reassemble(len(contexts), [(rows, answers[c]) for c, (_, rows) in enumerate(chunks)
                                           if answers[c] is not _EMPTY])

    # -- routing -------------------------------------------------------------------------

    def _route(self, keys: list[int], rows: list[int]) -> dict[int, list[int]]:
        """replica -> rows (indexes into the call): a kept key stays on its replica while that
        is up; a new or moved one goes to the healthy replica with the fewest sequences."""
        healthy = self.healthy
        load = {r: 0 for r in healthy}
        for replica in self._assigned.values():
            if replica in load:
                load[replica] += 1
        route: dict[int, list[int]] = {}
        for key, row in zip(keys, rows):
            kept = self._assigned.get(key)
            replica = self.assign(kept, load)
            if replica != kept:
                load[replica] += 1
                if key >= 0:
                    self._assigned[key] = replica
            route.setdefault(replica, []).append(row)
        return route

    def assign(self, current: int | None, loads: Mapping[int, int], room: int | None = None) -> int:
        """The replica a sequence runs on: `current` while it is up (and, given `room`, holds fewer
        than `room` in `loads`), else the healthy replica with the fewest in `loads`, which is a
        move (counted here) when the sequence had a replica. Per-token routing and lockstep
        placement both place through it; only the pool changes its counters."""
        if current is not None and self._up[current] and (room is None or loads.get(current, 0) < room):
            return current
        best = min(self.healthy, key=lambda r: loads.get(r, 0))
        if current is not None:
            self.counters.moves += 1
            log.debug("%s: a sequence moves from %s to %s", self.name, self.describe(current), self.describe(best))
        return best

    def take_out(self, replica: int, reason: object) -> None:
        """Mark `replica` down: its sequences move at their next step, and it is probed until it passes."""
        if self._up[replica]:
            self._up[replica] = False
            self.counters.downs += 1
            log.warning("%s is down (%s); its sequences move to %d healthy replica(s)",
                        self.describe(replica), reason, len(self.healthy))

    async def _any(self, call: Callable[[Engine], Awaitable[T]]) -> T:
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

    # -- rejoin --------------------------------------------------------------------------

    async def _probe_down_replicas(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self._probe_interval_s)
            for replica in [i for i, up in enumerate(self._up) if not up]:
                if replica in self._refused and loop.time() < self._refused[replica][0]:
                    continue
                generation = self._generation
                if self._changes_in_flight or not await self._passes(replica):
                    continue
                if self._changes_in_flight or self._generation != generation:  # checked against the old state
                    log.info("%s passed its checks while the pool's replicas changed; probed again after the change",
                             self.describe(replica))
                    continue
                self._up[replica] = True  # no await since the check above: nothing changed in between
                self._refused.pop(replica, None)
                self.counters.rejoins += 1
                log.warning("%s passed /health and the weights probe: it rejoins the pool", self.describe(replica))

    async def _passes(self, replica: int) -> bool:
        engine = self.replicas[replica]
        try:
            await engine.health()
        except ServerError:
            self._refused.pop(replica, None)  # down again: whatever comes back is probed afresh
            return False  # still down: no log line every probe interval
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
            self._refuse(replica, f"answers /health but serves other weights (top-{WEIGHTS_PROBE_K} logprobs "
                                  f"differ by {gap:.4f} nats); it stays out")
        return gap <= self._tolerance

    def _refuse(self, replica: int, reason: str) -> None:
        """Keep a replica that answers /health out, retried at doubling intervals; warn on a new reason."""
        self.counters.refusals += 1
        _, delay, before = self._refused.get(replica, (0.0, self._probe_interval_s / 2, ""))
        delay = min(2 * delay, max(MAX_RECHECK_S, self._probe_interval_s))
        self._refused[replica] = (asyncio.get_running_loop().time() + delay, delay, reason)
        if _without_numbers(reason) != _without_numbers(before):
            log.warning("%s %s (retried at doubling intervals up to %.0f s)", self.describe(replica), reason,
                        MAX_RECHECK_S)

    async def refresh_reference(self) -> None:
        """New weights were pushed to the healthy replicas: a rejoining replica must match them."""
        if self._probe_contexts:
            self._reference = await self._any(self._probe)


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


def _reassemble(size: int, parts: list[tuple[list[int], TopKBatch]]) -> TopKBatch:
    """One TopKBatch in call order from each replica's answer for its rows."""
    width = max(batch.token_ids.shape[1] for _, batch in parts)
    ids = np.full((size, width), PAD_TOKEN_ID, dtype=np.int64)
    logprobs = np.full((size, width), -np.inf, dtype=np.float64)
    for rows, batch in parts:
        w = batch.token_ids.shape[1]
        ids[rows, :w], logprobs[rows, :w] = batch.token_ids, batch.logprobs
    return TopKBatch(token_ids=ids, logprobs=logprobs)


def live_members(engine: Engine) -> list[Engine]:
    """The engines a role's calls reach: a pool's healthy replicas, or the engine itself (one
    server). Kept here so that nothing outside engines/ tells a pool from a server."""
    return [engine.replicas[i] for i in engine.healthy] if isinstance(engine, ReplicaPool) else [engine]


def members(engine: Engine) -> list[Engine]:
    """Every engine of a role, up or down: a pool's replicas, or the engine itself."""
    return list(engine.replicas) if isinstance(engine, ReplicaPool) else [engine]


def as_pool(engine: Engine) -> ReplicaPool | None:
    """The role's pool, for what only a pool has (membership, its counters); None for one server."""
    return engine if isinstance(engine, ReplicaPool) else None


def vllm_members(engine: Engine) -> list[VLLMClient] | None:
    """Every member of a role as a vLLM server client, or None if any is another kind of engine
    (an in-process one, a test's): what lockstep, weight pushes and call observers need."""
    servers = members(engine)
    return servers if all(isinstance(s, VLLMClient) for s in servers) else None  # type: ignore[return-value]
