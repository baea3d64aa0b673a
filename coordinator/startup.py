"""A coordinator's start-up: its engines, the checks both models must pass, and its scheduler.

`open_session` is what `async with DualVLLMCoordinator(...)` runs: the clients (or replica
pools) of both roles, entered on the caller's exit stack so that they close with it; the
checks of dualvllm.coordinator.checks on every pair of replicas (health, one tokenizer, one EOS, the
top-k both accept); the replicas of a pool checked to serve the same weights; then the
scheduler of the decoding mode. Returns a `Session`: what the coordinator knows once open.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import cast

from dualvllm.coordinator.checks import (
    TOKENIZER_PROBES,
    check_health,
    check_tokenizers,
    check_top_k,
    replica_pairs,
    resolve_eos,
)
from dualvllm.coordinator.config import CoordinatorConfig
from dualvllm.coordinator.lockstep import LockstepScheduler
from dualvllm.coordinator.lockstep.probe import lockstep_stop_token, probe_servers
from dualvllm.coordinator.scheduler import Scheduler, Scheduling
from dualvllm.coordinator.speculative import speculative_scheduler
from dualvllm.coordinator.stats import Statistics
from dualvllm.common.errors import LockstepUnavailableError
from dualvllm.engines.lockstep_channel import LockstepChannel
from dualvllm.engines.pool import ReplicaPool, as_pool, vllm_members
from dualvllm.engines.protocol import Engine, ModelInfo
from dualvllm.engines.vllm_client import VLLMClient

log = logging.getLogger("dualvllm.coordinator")
LockstepRole = VLLMClient | ReplicaPool


@dataclass(frozen=True)
class Session:
    """An open coordinator's engines, what its models agreed on, and its scheduler."""

    theta: Engine  # the base role: its server's client, or a ReplicaPool of its replicas' clients
    t: Engine  # the teacher role, likewise
    infos: tuple[ModelInfo, ModelInfo]  # (base, teacher) as their servers report them
    eos_ids: frozenset[int]  # the end-of-sequence ids generation stops at
    vocab_size: int | None  # token ids both models accept (0 .. vocab_size - 1), when their configs tell
    scheduler: Scheduling

    @property
    def model_names(self) -> tuple[str, str]:
        """The served names of the base and the teacher model."""
        return self.infos[0].name, self.infos[1].name

    @property
    def max_model_len(self) -> int:
        """Prompt + generated tokens both servers accept."""
        return self.scheduler.max_len


async def open_session(
    config: CoordinatorConfig,
    given: tuple[Engine | None, Engine | None],
    stack: contextlib.AsyncExitStack,
    stats: Statistics,
) -> Session:
    """Start-up: engines (`given` ones, else clients of the configured servers, closed by `stack`),
    the checks, the pools' prober, the scheduler. Raises what a check refuses."""
    theta, t = given
    api_key = config.api_key.get_secret_value() if config.api_key else None
    if theta is None:
        theta = await _role(config, stack, config.theta_pool, "theta", config.theta_model, api_key)
    if t is None:
        t = await _role(config, stack, config.t_pool, "t", config.t_model, api_key)
    await check_health(theta, t)
    infos = (await theta.model_info(), await t.model_info())
    eos_ids = frozenset[int]()
    vocab_sizes = [info.vocab_size for info in infos if info.vocab_size]
    probe = await theta.tokenize("Hello", add_special_tokens=True)
    for theta_one, t_one in replica_pairs(theta, t):  # every replica passes every check
        pair_infos = (await theta_one.model_info(), await t_one.model_info())
        await check_tokenizers(theta_one, t_one, pair_infos)
        eos_ids = await resolve_eos(theta_one, t_one, pair_infos, config.eos_token_ids)
        await check_top_k(theta_one, t_one, config.top_k, probe, min(vocab_sizes) if vocab_sizes else None)
    for pool in filter(None, map(as_pool, (theta, t))):
        await pool.membership.check_same_weights()
        pool.membership.start_probing()
        stack.push_async_callback(pool.close)
    max_len = min(infos[0].max_model_len, infos[1].max_model_len)
    log.info(
        "coordinator ready: base %s, teacher %s, top_k=%d, eos=%s, max_model_len=%d",
        infos[0].name,
        infos[1].name,
        config.top_k,
        sorted(eos_ids),
        max_len,
    )
    vocab_size = min(vocab_sizes) if vocab_sizes else None
    scheduler: Scheduling | None = await _lockstep_scheduler(
        config, stats, theta, t, eos_ids, max_len, vocab_size, stop_token=lockstep_stop_token(infos, eos_ids)
    )
    if scheduler is None:
        per_step = speculative_scheduler(theta, t) if config.speculative_gamma else Scheduler
        scheduler = per_step(
            theta, t, config=config, eos_ids=eos_ids, max_len=max_len, stats=stats, vocab_size=vocab_size
        )
    log.info("decoding mode: %s", scheduler.mode)
    return Session(theta=theta, t=t, infos=infos, eos_ids=eos_ids, vocab_size=vocab_size, scheduler=scheduler)


async def _lockstep_scheduler(
    config: CoordinatorConfig,
    stats: Statistics,
    theta: Engine,
    t: Engine,
    eos_ids: frozenset[int],
    max_len: int,
    vocab_size: int | None,
    stop_token: int,
) -> LockstepScheduler | None:
    """A lockstep scheduler when the mode allows it and both servers carry the plugin; None
    for per-token mode. mode="lockstep" without the plugin raises LockstepUnavailableError."""
    if config.mode == "per_token" or config.speculative_gamma:
        return None
    roles = (vllm_members(theta), vllm_members(t))
    if roles[0] is None or roles[1] is None:
        if config.mode == "lockstep":
            raise LockstepUnavailableError("lockstep mode needs vLLM servers (VLLMClient engines)")
        return None
    channel = LockstepChannel(config.lockstep_host)
    probe = await probe_servers(
        channel, roles[0] + roles[1], await theta.tokenize("Hello"), stop_token, config.request_timeout
    )
    if probe.unavailable is not None:
        channel.close()
        if config.mode == "lockstep":
            raise LockstepUnavailableError(f"lockstep mode: {probe.unavailable}")
        log.info("per-token mode: %s", probe.unavailable)
        return None
    # Every member of each role is a VLLMClient (vllm_members said so): a client, or a pool of them.
    scheduler = LockstepScheduler(
        cast(LockstepRole, theta),
        cast(LockstepRole, t),
        config=config,
        eos_ids=eos_ids,
        max_len=max_len,
        stats=stats,
        channel=channel,
        stop_token=stop_token,
        capacity=probe.capacity,
        vocab_size=vocab_size,
    )

    async def check_plugin(replica: Engine) -> None:
        await scheduler.check_plugin(cast(VLLMClient, replica))

    for pool in filter(None, map(as_pool, (theta, t))):  # a replica restarted without the plugin stays out
        pool.membership.add_rejoin_check(check_plugin)
    if scheduler.capacity < config.max_batch_size:
        log.info(
            "lockstep: at most %d sequences at once (%d per server, the servers' max_num_seqs), not max_batch_size=%d",
            scheduler.capacity,
            probe.capacity,
            config.max_batch_size,
        )
    return scheduler


async def _role(
    config: CoordinatorConfig,
    stack: contextlib.AsyncExitStack,
    urls: tuple[str, ...],
    name: str,
    model: str | None,
    api_key: str | None,
) -> Engine:
    """The engine of one role: a client of its server, or a pool of its replicas' clients."""
    clients = [await stack.enter_async_context(_client(config, url, name, model, api_key)) for url in urls]
    if len(clients) == 1:
        return clients[0]
    probes = [await clients[0].tokenize(text, add_special_tokens=False) for text in TOKENIZER_PROBES]
    return ReplicaPool(clients, name=name, probe_contexts=probes, probe_interval_s=config.replica_probe_interval)


def _client(config: CoordinatorConfig, url: str, name: str, model: str | None, api_key: str | None) -> VLLMClient:
    pool = config.connection_pool_size
    if config.mode != "per_token":
        # Lockstep holds one request open per sequence and role (both roles on one server
        # for a self-teacher); waiting for a connection would start the roles apart.
        pool = max(pool, 2 * config.max_batch_size + 8)
    return VLLMClient(
        url,
        name=name,
        model=model,
        api_key=api_key,
        request_timeout_s=config.request_timeout,
        connect_timeout_s=config.connect_timeout,
        connection_pool_size=pool,
        max_retries=config.max_retries,
        retry_delay_s=config.retry_delay,
        local_tokenizer=config.local_tokenizers,
    )
