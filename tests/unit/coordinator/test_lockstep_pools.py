"""Lockstep over replica pools (engines/pool.py) and stop strings, against fake lockstep servers:
failover and rejoin with nothing lost, the rejoin checks (see test_lockstep.py for the fakes)."""

from __future__ import annotations

import asyncio

import pytest

from dualvllm.common.errors import LockstepUnavailableError
from dualvllm.coordinator.outputs import GenerationOutput
from dualvllm.coordinator.sequence import SamplingParams
from dualvllm.engines.pool import ReplicaPool
from dualvllm.engines.vllm_plugin import wire
from tests.fake_lockstep import FakeLockstepServer, FakeModel, FakeRequest
from tests.waiting import eventually
from tests.unit.coordinator.lockstep_rig import (
    OUTPUT_TIMEOUT_S,
    Rig,
    assert_per_token_tokens,
    assert_servers_followed,
    collect,
    config,
    crash_during,
    generate,
    key,
    make_sequences,
    replay,
    t_prompt,
    theta_prompt,
)

# A hang is a failure, not a 900 s wait.
pytestmark = pytest.mark.timeout(60)


class PoolRig:
    """Two replicas of each role (fakes of the same models) behind ReplicaPools."""

    def __init__(self, rig: Rig, *, theta: list[dict] | None = None, t: list[dict] | None = None) -> None:
        self.models = (FakeModel(1), FakeModel(2))
        options = (theta or [{}, {}], t or [{}, {}])
        self.replicas = [[FakeLockstepServer(f"{role}{i}", model, **opts) for i, opts in enumerate(role_options)]
                         for role, model, role_options in zip(("theta", "t"), self.models, options)]
        rig.fakes.extend(self.replicas[0] + self.replicas[1])
        self.pools = [ReplicaPool(replicas, name=role, probe_interval_s=0.05)  # type: ignore[arg-type]
                      for role, replicas in zip(("theta", "t"), self.replicas)]
        self.scheduler = rig.scheduler(*self.pools, config())  # type: ignore[arg-type]

    def placement(self, outputs: list[GenerationOutput]) -> dict[int, tuple[set[str], set[str]]]:
        """sequence -> (base replicas, teacher replicas) its requests went to."""
        return {out.index: tuple({fake.name for fake in replicas if fake.requests_of(key(out.index))}
                                 for replicas in self.replicas) for out in outputs}  # type: ignore[misc]

    def assert_lossless(self, outputs: list[GenerationOutput], params: SamplingParams) -> None:
        for out in outputs:
            assert out.ok and out.finish_reason == "max_tokens", out.error
            assert_per_token_tokens(out, *self.models, params, self.scheduler._config)
        for replicas, prompt in zip(self.replicas, (theta_prompt, t_prompt)):
            for fake in replicas:
                assert_servers_followed(fake, [o for o in outputs if fake.requests_of(key(o.index))], prompt)


async def test_a_stop_string_check_holds_only_its_servers_and_stops_where_per_token_mode_would(rig):
    """Detokenizing for stop strings is a server call, made outside the scheduler's lock: while
    the first check is held, the sequence on the other pair of replicas runs to its end (a
    server's step waits for all its rows, so the checked sequence's pair waits); the checked
    sequence's next token waits for the check, so it stops at the token per-token mode stops at."""
    pools = PoolRig(rig)
    cfg = pools.scheduler._config
    sequences = make_sequences(2, max_tokens=12)
    tokens, _ = replay(*pools.models, 0, sequences[0].params, cfg)
    stop = str(tokens[3])
    cut = next(n for n in range(1, len(tokens) + 1) if stop in " ".join(map(str, tokens[:n])))
    sequences[0].params = SamplingParams(12, stop=[stop])
    release, calls = asyncio.Event(), []
    for replica in pools.replicas[0]:
        def held(ids, detokenize=replica.detokenize):
            calls.append(list(ids))
            return _after(release if len(calls) == 1 else None, detokenize(ids))
        replica.detokenize = held  # type: ignore[method-assign]
    pools.scheduler.submit(sequences)
    other = await asyncio.wait_for(sequences[0].sink.get(), OUTPUT_TIMEOUT_S)
    assert other.index == 1 and other.finish_reason == "max_tokens" and len(other.generated_tokens) == 12
    assert calls[0] == tokens[:1]  # the held check: the stop sequence's first token, still its only one
    release.set()
    stopped = await asyncio.wait_for(sequences[0].sink.get(), OUTPUT_TIMEOUT_S)
    assert stopped.finish_reason == "stop_string" and stopped.generated_tokens == tokens[:cut]
    assert stop not in stopped.generated_text
    assert pools.placement([other, stopped]) == {1: ({"theta1"}, {"t1"}), 0: ({"theta0"}, {"t0"})}


async def test_a_stop_string_completed_by_the_last_token_ends_the_sequence_as_per_token_mode_would(rig):
    """Lockstep ends a stream as its last token is decided, so that token's stop-string check
    happens at delivery: a stop string it completed still cuts the text and names the finish."""
    theta_fake, t_fake = rig.servers()
    cfg = config()
    probe = make_sequences(1, max_tokens=12)[0]
    tokens, _ = replay(theta_fake.model, t_fake.model, 0, probe.params, cfg)
    stop = str(tokens[3])
    cut = next(n for n in range(1, len(tokens) + 1) if stop in " ".join(map(str, tokens[:n])))
    [seq] = make_sequences(1, max_tokens=cut, stop=[stop])  # the stop string's last token is the last allowed

    [out] = await generate(rig.scheduler(theta_fake, t_fake, cfg), [seq])
    assert out.finish_reason == "stop_string" and out.generated_tokens == tokens[:cut]
    assert stop not in out.generated_text


async def _after(event: asyncio.Event | None, call):
    if event is not None:
        await event.wait()
    return await call


async def test_a_pool_spreads_sequences_over_replicas_and_keeps_each_on_its_own(rig):
    pools = PoolRig(rig)
    sequences = make_sequences(8, max_tokens=6)
    outputs = await generate(pools.scheduler, sequences)

    pools.assert_lossless(outputs, sequences[0].params)
    placement = pools.placement(outputs)
    assert all(len(thetas) == 1 and len(ts) == 1 for thetas, ts in placement.values())  # one replica per role
    for role in (0, 1):  # balanced: four sequences on each replica
        assert sorted(sum(1 for p in placement.values() if fake.name in p[role]) for fake in pools.replicas[role]) \
            == [4, 4]
    # Aligned admission holds over four servers: all admitted each new sequence in one step.
    assert pools.scheduler.counters.parks == 0 and pools.scheduler.counters.split_reports == 0
    assert pools.scheduler.gate.counters.admitted == 6 and pools.scheduler.gate.counters.misses == 0


async def test_a_base_replica_that_dies_hands_its_sequences_to_the_other_with_nothing_lost(rig):
    pools = PoolRig(rig)
    dead = pools.replicas[0][0]
    sequences = make_sequences(6, max_tokens=10)
    crash = asyncio.create_task(crash_during(dead, after_steps=4, down_s=None))
    outputs = await generate(pools.scheduler, sequences)
    await crash

    pools.assert_lossless(outputs, sequences[0].params)  # same tokens as per-token mode, none twice
    assert pools.pools[0].membership.healthy == [1] and pools.pools[0].membership.counters.downs == 1
    moved = [out for out in outputs if dead.requests_of(key(out.index))]
    assert moved and pools.pools[0].membership.counters.moves == len(moved)
    survivor = pools.replicas[0][1]
    for out in moved:  # each went on from its agreed tokens on the other base replica
        resumed = survivor.requests_of(key(out.index))[-1]
        assert 0 < resumed.offset < 10 and resumed.finish == "stop"
    assert pools.scheduler.counters.suspensions >= len(moved)


async def test_a_replica_that_comes_back_rejoins_and_takes_new_sequences(rig):
    pools = PoolRig(rig)
    pools.pools[0].membership.start_probing()
    try:
        comeback = pools.replicas[0][0]
        crash = asyncio.create_task(crash_during(comeback, after_steps=3, down_s=0.2))
        pools.scheduler.submit(first := make_sequences(4, max_tokens=8))
        for out in await collect(first):
            assert out.ok
            assert_per_token_tokens(out, *pools.models, first[0].params, pools.scheduler._config)
        await crash
        await eventually(lambda: pools.pools[0].membership.healthy == [0, 1], "the restarted replica rejoined")
        before = len(comeback.requests)
        pools.scheduler.submit(second := make_sequences(4, max_tokens=4))
        assert all(out.ok for out in await collect(second))
        assert len(comeback.requests) - before >= 2 and pools.pools[0].membership.counters.rejoins == 1
        await asyncio.wait_for(pools.scheduler.close(), OUTPUT_TIMEOUT_S)
        assert all(fake.idle for fake in pools.replicas[0] + pools.replicas[1])
    finally:
        await pools.pools[0].close()


def admit_only_once(k: int):
    """An admission policy: the first time more than one request waits, admit only sequence k's."""
    fired: list[bool] = []

    def admit(server: FakeLockstepServer, queued: list[FakeRequest]) -> list[FakeRequest]:
        if len(queued) > 1 and any(r.key == key(k) for r in queued) and not fired:
            fired.append(True)
            return [r for r in queued if r.key == key(k)]
        return queued
    return admit


async def test_two_servers_deadlocked_apart_from_the_others_are_parked_while_the_others_run(rig):
    # Pair 1 (theta1, t1) gets sequences 1, 3 and 5; in the round that sends 3 and 5, the base
    # admits 3 alone and the teacher 5 alone: each of the two waits on the other, while
    # theta0 and t0 go on decoding their sequences. Only those two servers are deadlocked.
    pools = PoolRig(rig, theta=[{}, {"admit": admit_only_once(3)}], t=[{}, {"admit": admit_only_once(5)}])
    others_steps: list[int] = []  # theta0's decode steps when each park happened
    table = pools.scheduler._table
    park = table.park

    def watched_park(blocked):
        others_steps.append(pools.replicas[0][0].steps)
        park(blocked)

    table.park = watched_park  # type: ignore[method-assign]
    sequences = make_sequences(6, max_tokens=12)
    outputs = await generate(pools.scheduler, sequences)

    pools.assert_lossless(outputs, sequences[0].params)
    assert pools.placement(outputs)[3] == ({"theta1"}, {"t1"}) and pools.placement(outputs)[5] == ({"theta1"}, {"t1"})
    assert pools.scheduler.counters.parks >= 1
    assert others_steps and others_steps[0] < 12  # parked while the other pair was still decoding


@pytest.mark.parametrize(("restarted_with", "refused_for"), [
    ({"plugin": False}, "no dualvllm lockstep plugin"),
    ({"flags": wire.FLAG_CHUNKED_PREFILL}, "chunked prefill"),
    ({"capacity": 2}, "at most 2 sequences at once"),
])
async def test_a_replica_restarted_with_other_settings_stays_out_of_the_pool(rig, caplog, restarted_with, refused_for):
    """The rejoin check is the start-up probe: a replica restarted without the plugin, with chunked
    prefill, or with a smaller max_num_seqs than this coordinator places on it stays out."""
    pools = PoolRig(rig)
    pools.pools[0].membership.add_rejoin_check(pools.scheduler.check_plugin)
    pools.pools[0].membership.start_probing()
    try:
        plain = pools.replicas[0][0]

        async def restart_with_other_settings() -> None:
            await crash_during(plain, after_steps=3, down_s=None)
            for name, value in restarted_with.items():
                setattr(plain, name, value)
            plain.down = False

        restart = asyncio.create_task(restart_with_other_settings())
        sequences = make_sequences(4, max_tokens=8)
        pools.scheduler.submit(sequences)
        outputs = await collect(sequences)
        await restart
        # The checks run against the open scheduler (a closed one reads no reports, and refuses to check).
        await eventually(lambda: not plain.down and plain.requests and plain.idle, "the plugin probe reached the replica")
        checked = len(plain.requests)
        await eventually(lambda: len(plain.requests) >= checked + 2 and plain.idle,
                         "two more rejoin checks of the replica, each refused")

        pools.assert_lossless(outputs, sequences[0].params)
        assert pools.pools[0].membership.healthy == [1] and pools.pools[0].membership.counters.rejoins == 0
        refusals = [r for r in caplog.records if refused_for in r.getMessage()]
        assert len(refusals) == 1 and plain.url in refusals[0].getMessage()
    finally:
        await asyncio.wait_for(pools.scheduler.close(), OUTPUT_TIMEOUT_S)
        await pools.pools[0].close()


async def test_the_plugin_check_passes_a_replica_that_reports(rig):
    pools = PoolRig(rig)
    replica = pools.replicas[0][1]
    await asyncio.wait_for(pools.scheduler.check_plugin(replica), OUTPUT_TIMEOUT_S)  # type: ignore[arg-type]
    assert len(replica.requests) == 1 and replica.steps >= 1  # its one step reported here


@pytest.mark.parametrize(("setting", "refused_for"), [
    ({"flags": wire.FLAG_CHUNKED_PREFILL}, "chunked prefill"),
    ({"capacity": 8}, "at most 8 sequences at once"),
])
async def test_the_plugin_check_refuses_what_the_start_up_probe_refuses(rig, setting, refused_for):
    """A replica restarted with chunked prefill, or with a smaller max_num_seqs than the coordinator
    places on a server, reports through its plugin all the same: the rejoin check judges the report
    as the start-up probe does, so it stays out of its pool."""
    pools = PoolRig(rig)
    replica = pools.replicas[0][1]
    for name, value in setting.items():
        setattr(replica, name, value)
    with pytest.raises(LockstepUnavailableError, match=refused_for) as refused:
        await asyncio.wait_for(pools.scheduler.check_plugin(replica), OUTPUT_TIMEOUT_S)  # type: ignore[arg-type]
    assert str(refused.value).startswith(f"theta1 server at {replica.url}")
    assert len(replica.requests) == 1 and replica.idle  # the probe's one request, ended


async def test_the_plugin_check_names_a_replica_of_another_dualvllm_version(rig):
    """A replica restarted with another dualvllm, whose plugin speaks another wire version, is
    refused with that reason at once, not after the check's timeout as one without the plugin."""
    pools = PoolRig(rig)
    replica = pools.replicas[0][1]
    replica.wire_version = wire.VERSION - 1
    with pytest.raises(LockstepUnavailableError, match="different dualvllm versions") as refused:
        await asyncio.wait_for(pools.scheduler.check_plugin(replica), 10.0)  # type: ignore[arg-type]
    assert str(refused.value).startswith(f"theta1 server at {replica.url}")
