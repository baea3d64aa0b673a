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
- leaves who is up to its `membership` (dualvllm.engines.membership): which replicas are down, the
  prober that lets one rejoin when it answers with the same weights as the others, and the
  hooks a trainer uses (a rejoin check that pushes its newest weights first, `take_out` of a
  replica that failed a push, `refresh_reference` after each push, `changing()` around one).

Every move is counted here, every down and rejoin there (`PoolCounters`).

In lockstep mode requests are not per token: the lockstep scheduler (coordinator/lockstep/)
places each sequence on a replica itself (`assign`) and uses the pool's membership for the
rest: which replicas are up, `take_out` when one breaks, the prober and its hook for rejoins.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any
from collections.abc import Mapping, Sequence

import numpy as np

from dualvllm.common.errors import ServerError, ServerRejectedError
from dualvllm.engines.membership import PROBE_INTERVAL_S, WEIGHTS_TOLERANCE_NATS, Membership
from dualvllm.engines.protocol import PAD_TOKEN_ID, Engine, ModelInfo, RequestCounting, TopKBatch
from dualvllm.engines.vllm_client import VLLMClient

log = logging.getLogger("dualvllm.pool")
# The answer of a chunk whose replica failed (its rows went elsewhere).
_EMPTY = TopKBatch(token_ids=np.zeros((0, 0), dtype=np.int64), logprobs=np.zeros((0, 0)))


class ReplicaPool:
    """Implements `dualvllm.engines.protocol.Engine` for one role over several engines of the same weights."""

    def __init__(
        self,
        replicas: Sequence[Engine],
        *,
        name: str,
        probe_contexts: Sequence[Sequence[int]] = (),
        probe_interval_s: float = PROBE_INTERVAL_S,
        tolerance: float = WEIGHTS_TOLERANCE_NATS,
    ) -> None:
        assert replicas, "a pool needs at least one replica"
        self.name = name
        self.url = ",".join(getattr(r, "url", r.name) for r in replicas)
        self.membership = Membership(
            replicas,
            name=name,
            url=self.url,
            probe_contexts=probe_contexts,
            probe_interval_s=probe_interval_s,
            tolerance=tolerance,
        )
        self._assigned: dict[int, int] = {}  # sequence key -> replica index

    async def close(self) -> None:
        await self.membership.close()

    # -- Engine protocol -----------------------------------------------------------------

    async def health(self) -> None:
        """Every replica is healthy (the start-up check); raises the first replica's error."""
        await asyncio.gather(*(r.health() for r in self.membership.replicas))

    async def model_info(self) -> ModelInfo:
        return await self.membership.call_any(lambda r: r.model_info())

    async def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return await self.membership.call_any(lambda r: r.tokenize(text, add_special_tokens=add_special_tokens))

    async def tokenize_chat(
        self, messages: Sequence[Mapping[str, Any]], template_kwargs: Mapping[str, Any] | None = None
    ) -> list[int]:
        return await self.membership.call_any(lambda r: r.tokenize_chat(messages, template_kwargs))

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        return await self.membership.call_any(lambda r: r.detokenize(token_ids))

    async def eos_token_ids(self) -> frozenset[int]:
        return await self.membership.call_any(lambda r: r.eos_token_ids())

    async def prompt_topk(self, prompts: Sequence[Sequence[int]], k: int) -> list[TopKBatch]:
        """Prompt logprobs (dualvllm.engines.protocol.PromptScoringEngine) from any healthy replica: they
        hold the same weights (checked at start-up)."""
        return await self.membership.call_any(lambda r: r.prompt_topk(prompts, k))  # type: ignore[attr-defined]

    async def prompt_logprobs(self, prompts: Sequence[Sequence[int]], k: int) -> list[list[dict[str, Any] | None]]:
        """vLLM's prompt logprobs (dualvllm.engines.protocol.PromptScoringEngine), from any healthy replica."""
        return await self.membership.call_any(lambda r: r.prompt_logprobs(prompts, k))  # type: ignore[attr-defined]

    async def next_token_topk(
        self, contexts: Sequence[Sequence[int]], k: int, keys: Sequence[int] | None = None
    ) -> TopKBatch:
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
                *(
                    self.membership.replicas[chunks[c][0]].next_token_topk([contexts[i] for i in chunks[c][1]], k)
                    for c in pending
                ),
                return_exceptions=True,
            )
            orphans: list[int] = []
            for c, answer in zip(pending, got):
                replica, rows = chunks[c]
                if isinstance(answer, ServerError) and not isinstance(answer, ServerRejectedError):
                    self.membership.take_out(replica, answer)
                    if not self.membership.healthy:
                        raise answer
                    orphans.extend(rows)
                    answers[c] = _EMPTY
                elif isinstance(answer, BaseException):
                    raise answer
                else:
                    answers[c] = answer
            if orphans:  # their replica is down now: `assign` moves (and counts) the kept ones
                chunks.extend(self._route([keys[i] for i in orphans], orphans).items())
        return _reassemble(
            len(contexts), [(rows, answers[c]) for c, (_, rows) in enumerate(chunks) if answers[c] is not _EMPTY]
        )

    # -- routing -------------------------------------------------------------------------

    def _route(self, keys: list[int], rows: list[int]) -> dict[int, list[int]]:
        """replica -> rows (indexes into the call): a kept key stays on its replica while that
        is up; a new or moved one goes to the healthy replica with the fewest sequences."""
        healthy = self.membership.healthy
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
        members = self.membership
        if current is not None and members.is_up(current) and (room is None or loads.get(current, 0) < room):
            return current
        best = min(members.healthy, key=lambda r: loads.get(r, 0))
        if current is not None:
            members.counters.moves += 1
            log.debug(
                "%s: a sequence moves from %s to %s", self.name, members.describe(current), members.describe(best)
            )
        return best


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
    if not isinstance(engine, ReplicaPool):
        return [engine]
    return [engine.membership.replicas[i] for i in engine.membership.healthy]


def members(engine: Engine) -> list[Engine]:
    """Every engine of a role, up or down: a pool's replicas, or the engine itself."""
    return list(engine.membership.replicas) if isinstance(engine, ReplicaPool) else [engine]


def request_counts(roles: Sequence[Engine]) -> dict[str, int]:
    """Requests, retries and request failures over every member of `roles` that counts them
    (vLLM clients, the in-process engine; a test's fake engine may not)."""
    # A vLLM client's counts are its transport's (dualvllm.engines.vllm_transport).
    counters = [m.transport if isinstance(m, VLLMClient) else m for role in roles for m in members(role)]
    counting = [m for m in counters if isinstance(m, RequestCounting)]
    return {
        "requests": sum(m.requests for m in counting),
        "retries": sum(m.retries for m in counting),
        "request_failures": sum(m.failures for m in counting),
    }


def as_pool(engine: Engine) -> ReplicaPool | None:
    """The role's pool, for what only a pool has (membership, its counters); None for one server."""
    return engine if isinstance(engine, ReplicaPool) else None


def vllm_members(engine: Engine) -> list[VLLMClient] | None:
    """Every member of a role as a vLLM server client, or None if any is another kind of engine
    (an in-process one, a test's): what lockstep, weight pushes and call observers need."""
    servers = members(engine)
    return servers if all(isinstance(s, VLLMClient) for s in servers) else None  # type: ignore[return-value]
