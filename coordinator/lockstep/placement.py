"""Where lockstep sequences run: one server per role each, kept while healthy.

With replica pools (engines/pool.py) the pool chooses among its healthy replicas
(`ReplicaPool.assign`: the current one while it has room, else the one with the fewest
sequences) and counts the moves; this class only asks it, with the loads the table counts.
"""

from __future__ import annotations

from collections import Counter

from dualvllm.common.errors import ServerError
from dualvllm.coordinator.lockstep.table import ROLES, Live
from dualvllm.engines.pool import ReplicaPool, as_pool, members
from dualvllm.engines.vllm_client import VLLMClient


class Placement:
    def __init__(
        self, theta: VLLMClient | ReplicaPool, t: VLLMClient | ReplicaPool, *, per_server: int, loads: Counter[str]
    ) -> None:
        """`per_server`: the most sequences one server runs at once; `loads`: placed sequences
        per server url (the table's count, read here, never changed)."""
        self._pools = (as_pool(theta), as_pool(t))
        self._replicas: tuple[list[VLLMClient], list[VLLMClient]] = (members(theta), members(t))  # type: ignore[assignment]
        self.per_server = per_server
        self._loads = loads

    @property
    def fewest_replicas(self) -> int:
        return min(len(replicas) for replicas in self._replicas)

    def healthy(self, role: int) -> list[VLLMClient]:
        pool, replicas = self._pools[role], self._replicas[role]
        return replicas if pool is None else [replicas[i] for i in pool.membership.healthy]

    def servers(self) -> set[str]:
        """The healthy servers, where new sequences may start."""
        return {engine.url for role in ROLES for engine in self.healthy(role)}

    def has_slot(self) -> bool:
        """Every role has a healthy server with room for one more sequence."""
        return all(
            min((self._loads[e.url] for e in self.healthy(role)), default=self.per_server) < self.per_server
            for role in ROLES
        )

    def place(self, live: Live) -> None:
        """Keep `live` on its servers while they are healthy and have room; else the pool's choice
        (its old one went down: a move)."""
        for role in ROLES:
            engine = live.engines[role]
            pool, replicas = self._pools[role], self._replicas[role]
            if pool is not None:
                healthy = set(pool.membership.healthy)
                loads = {i: self._loads[e.url] for i, e in enumerate(replicas) if i in healthy}
                current = None if engine is None else replicas.index(engine)
                live.engines[role] = replicas[pool.assign(current, loads, room=self.per_server)]
            elif engine is None:  # one server in this role
                live.engines[role] = replicas[0]

    def roles_on(self, engine: VLLMClient) -> int:
        """In how many roles `engine` serves (2: a self-teacher, both roles on one server)."""
        return sum(engine.url in {e.url for e in replicas} for replicas in self._replicas)

    def take_out(self, role: int, engine: VLLMClient, error: ServerError) -> bool:
        """Take `engine` out of its pool if the role has another healthy replica -> whether it did
        (else its sequences must wait for it to come back)."""
        pool = self._pools[role]
        if pool is None or not any(e is not engine for e in self.healthy(role)):
            return False
        pool.membership.take_out(self._replicas[role].index(engine), error)
        return True
