"""Replica pools (engines/pool.py) under the coordinator, over real HTTP to fake vLLM replicas."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from dualvllm.common.errors import IncompatibleModelsError, InvalidInputError, WeightSyncError
from dualvllm.coordinator import CoordinatorConfig, DualVLLMCoordinator
from dualvllm.engines.pool import ReplicaPool
from tests.fake_vllm import FakeModel, FakeVLLM, Failure, running_fakes, tokenize, write_fake_weights
from tests.waiting import eventually
from dualvllm.training.weight_sync import BasePusher

PROMPTS = ["abc", "de", "fgh", "ij", "klm", "no", "ab", "cd"]


def config(thetas: list[FakeVLLM], ts: list[FakeVLLM], **kw) -> CoordinatorConfig:
    kw = dict(retry_delay=0.0, top_k=8, mode="per_token", max_retries=0, replica_probe_interval=0.05) | kw
    return CoordinatorConfig(theta_urls=[s.url for s in thetas], t_urls=[s.url for s in ts], **kw)


def contexts_seen(server: FakeVLLM, after: int) -> set[tuple[int, ...]]:
    """The prompts (as token-id tuples) of the server's top-k requests after the first `after`."""
    return {tuple(p) for call in server.calls["/v1/completions"][after:] for p in call["prompt"]}


def owner(prompt: str, replicas: list[FakeVLLM], after: list[int]) -> list[int]:
    """Which replicas saw a context that starts with `prompt`'s tokens."""
    ids = tuple(tokenize(prompt))
    return [i for i, r in enumerate(replicas) if any(c[:len(ids)] == ids for c in contexts_seen(r, after[i]))]


async def test_sequences_spread_over_replicas_and_each_stays_on_one():
    models = (FakeModel(1, eos_after=30), FakeModel(1, eos_after=30), FakeModel(2, eos_after=30))
    async with running_fakes(*models) as (a, b, t):
        async with DualVLLMCoordinator(config([a, b], [t])) as c:
            after = [len(a.calls["/v1/completions"]), len(b.calls["/v1/completions"])]  # past the start-up checks
            outputs = await c.generate_batch(PROMPTS, max_tokens=6, seed=1)
            stats = c.get_statistics()
    assert all(o.ok for o in outputs)
    owners = [owner(p, [a, b], after) for p in ("abc", "fgh", "klm")]  # prompts no other prompt starts with
    assert all(len(o) == 1 for o in owners), owners  # every step of a sequence went to one replica
    steps = [len(call["prompt"]) for call in a.calls["/v1/completions"][after[0]:]][-3:]
    assert steps == [4, 4, 4]  # balanced: 8 sequences, 4 per replica, one request per replica per step
    assert stats["theta_replicas_up"] == 2 and stats["theta_replica_moves"] == 0


async def test_a_replica_that_dies_mid_run_hands_its_sequences_over_with_nothing_lost():
    async with running_fakes(FakeModel(1), FakeModel(1), FakeModel(2)) as (a, b, t):
        async with DualVLLMCoordinator(config([a], [t])) as c:
            reference = await c.generate_batch(PROMPTS, max_tokens=8, seed=3)
        async with DualVLLMCoordinator(config([a, b], [t])) as c:
            a.fail_next("/v1/completions", Failure(0), Failure(0), *[Failure(503)] * 1000)  # 2 steps, then down
            outputs = await c.generate_batch(PROMPTS, max_tokens=8, seed=3)
            stats = c.get_statistics()
    assert [o.generated_tokens for o in outputs] == [o.generated_tokens for o in reference]
    for got, want in zip(outputs, reference):
        assert got.logprobs_q == pytest.approx(want.logprobs_q) and got.alpha_history == pytest.approx(want.alpha_history)
    assert all(o.ok for o in outputs)
    assert stats["theta_replica_downs"] == 1 and stats["theta_replica_moves"] == 4
    assert stats["theta_replicas_up"] == 1 and stats["sequences_failed"] == 0


async def test_with_every_replica_of_a_role_down_its_sequences_fail_as_before():
    async with running_fakes(FakeModel(1), FakeModel(1), FakeModel(2)) as (a, b, t):
        async with DualVLLMCoordinator(config([a, b], [t])) as c:
            for replica in (a, b):
                replica.fail_next("/v1/completions", *[Failure(503)] * 50)
            outputs = await c.generate_batch(PROMPTS[:4], max_tokens=4, seed=1)
    assert all(not o.ok and "503" in o.error for o in outputs)


async def test_a_down_replica_rejoins_once_it_answers_with_the_same_weights():
    async with running_fakes(FakeModel(1), FakeModel(1), FakeModel(2)) as (a, b, t):
        async with DualVLLMCoordinator(config([a, b], [t])) as c:
            a.fail_next("/v1/completions", Failure(503))
            await c.generate_batch(PROMPTS, max_tokens=4, seed=1)
            assert c.get_statistics()["theta_replica_downs"] == 1
            await eventually(lambda: c.get_statistics()["theta_replicas_up"] == 2, "the replica rejoined")
            stats = c.get_statistics()
            before = len(a.calls["/v1/completions"])
            await c.generate_batch(PROMPTS, max_tokens=4, seed=2)
    assert stats["theta_replica_rejoins"] == 1 and stats["theta_replicas_up"] == 2
    assert len(a.calls["/v1/completions"]) > before  # new sequences go to it again


async def test_a_replica_that_comes_back_with_other_weights_stays_out(caplog):
    async with running_fakes(FakeModel(1), FakeModel(1), FakeModel(2)) as (a, b, t):
        async with DualVLLMCoordinator(config([a, b], [t])) as c:
            a.model = FakeModel(7)  # it will come back from its failure with another checkpoint
            a.fail_next("/v1/completions", Failure(503))
            await c.generate_batch(PROMPTS[:2], max_tokens=2, seed=1)
            down_at, url = len(a.calls["/v1/completions"]), a.url
            await eventually(lambda: len(a.calls["/v1/completions"]) >= down_at + 4, "four weights probes of a")
            stats = c.get_statistics()
    assert stats["theta_replica_downs"] == 1 and stats["theta_replicas_up"] == 1
    assert stats["theta_replica_rejoins"] == 0
    # Its weights are probed at doubling intervals (0.05, 0.1, 0.2 s after each refusal), not at
    # every probe interval; a loaded machine only stretches the gaps, so their lower bounds hold.
    probed = a.call_times["/v1/completions"][down_at:down_at + 4]
    gaps = np.diff(probed)
    assert (gaps >= 0.9 * np.array([0.05, 0.1, 0.2])).all(), gaps
    # and the operator is told once.
    warnings = [r for r in caplog.records if "serves other weights" in r.getMessage()]
    assert len(warnings) == 1 and url in warnings[0].getMessage()


async def test_a_refused_replica_that_restarts_is_probed_at_once_not_after_its_backoff():
    """A replica refused at its rejoin waits out a backoff of up to a minute before its checks
    run again, but /health is still asked at every probe interval: one that fails it has gone
    down (an operator restarting it), and whatever comes back is checked at once."""
    import asyncio

    async with running_fakes(FakeModel(1), FakeModel(1), FakeModel(2)) as (a, b, t):
        async with DualVLLMCoordinator(config([a, b], [t])) as c:
            pool = c.base_engine
            assert isinstance(pool, ReplicaPool)
            broken = True

            async def check(replica) -> None:  # as the lockstep check refuses a chunked-prefill server
                if broken and replica.url == a.url:
                    raise InvalidInputError("started with chunked prefill")

            pool.membership.add_rejoin_check(check)
            a.fail_next("/v1/completions", Failure(503))
            await c.generate_batch(PROMPTS[:2], max_tokens=2, seed=1)
            await eventually(lambda: c.get_statistics()["theta_replica_refusals"] >= 1, "a's rejoin refused")
            # Deep in its backoff: the next check of its weights would be an hour away.
            loop = asyncio.get_running_loop()
            _, _, reason = pool.membership._refused[0]
            pool.membership._refused[0] = (loop.time() + 3600, 3600, reason)
            refusals = c.get_statistics()["theta_replica_refusals"]
            broken = False  # fixed, and restarted: its /health fails once while it starts
            a.fail_next("/health", Failure(503))
            await eventually(lambda: c.get_statistics()["theta_replicas_up"] == 2, "the restarted replica rejoined")
            stats = c.get_statistics()
    assert stats["theta_replica_rejoins"] == 1 and stats["theta_replica_refusals"] == refusals


async def test_replicas_with_different_weights_are_refused_by_url():
    async with running_fakes(FakeModel(1), FakeModel(5), FakeModel(2)) as (a, b, t):
        with pytest.raises(IncompatibleModelsError, match="serve different weights") as refused:
            async with DualVLLMCoordinator(config([a, b], [t])):
                pass
        assert a.url in str(refused.value) and b.url in str(refused.value)


def test_pools_refuse_speculative_mode_and_urls_come_comma_separated(monkeypatch):
    monkeypatch.setenv("DUALVLLM_T_URLS", "http://a:1, http://b:2/")
    assert CoordinatorConfig().t_pool == ("http://a:1", "http://b:2")
    assert CoordinatorConfig(mode="lockstep").mode == "lockstep"
    with pytest.raises(InvalidInputError, match="not speculative"):
        CoordinatorConfig(speculative_gamma=4)
    with pytest.raises(InvalidInputError, match="listed twice"):
        CoordinatorConfig(theta_urls=["http://a:1", "http://a:1"])


def test_the_command_line_takes_replica_lists():
    from dualvllm.cli import COORDINATOR_FLAGS, _given, _parser

    args = _parser().parse_args(["generate", "--input", "in.jsonl", "--output", "out.jsonl",
                                 "--theta-urls", "http://a:1", "http://b:1", "--t-urls", "http://c:1"])
    config = CoordinatorConfig(**_given(args, CoordinatorConfig, COORDINATOR_FLAGS))
    assert config.theta_pool == ("http://a:1", "http://b:1") and config.t_pool == ("http://c:1",)


def learner(seed: int, probes: list[list[int]]) -> np.ndarray:
    """The learner's logprobs on `probes` if its weights were FakeModel(seed) -> [B, vocab]."""
    return np.stack([FakeModel(seed).logprobs(p) for p in probes])


async def test_a_push_reaches_every_replica_and_one_that_fails_it_catches_up_before_it_rejoins(tmp_path):
    probes = [tokenize("abc"), tokenize("de")]
    async with running_fakes(FakeModel(1), FakeModel(1), FakeModel(2)) as (a, b, t):
        async with DualVLLMCoordinator(config([a, b], [t])) as c:
            pusher = BasePusher(c.base_engine, probes, top_k=5)
            b.fail_next("/pause", Failure(503))  # b fails the push; /health keeps answering
            first = await pusher.push_saved(write_fake_weights(tmp_path / "step-1", 7), learner(7, probes))
            assert (first.replicas, first.dropped) == (1, (b.url,))
            assert (a.model.seed, b.model.seed) == (7, 1)
            await eventually(lambda: c.get_statistics()["theta_replicas_up"] == 2, "b rejoined its pool")
            assert b.model.seed == 7  # the newest weights were pushed into it before it rejoined
            second = await pusher.push_saved(write_fake_weights(tmp_path / "step-2", 9), learner(9, probes))
            outputs = await c.generate_batch(PROMPTS, max_tokens=3, seed=1)
            stats = c.get_statistics()
    assert (second.replicas, second.dropped) == (2, ()) and (a.model.seed, b.model.seed) == (9, 9)
    assert second.max_abs_diff < 1e-9 and all(o.ok for o in outputs)
    assert stats["theta_replica_downs"] == 1 and stats["theta_replica_rejoins"] == 1


async def test_a_push_no_replica_takes_fails_and_names_them(tmp_path):
    probes = [tokenize("abc")]
    async with running_fakes(FakeModel(1), FakeModel(1), FakeModel(2)) as (a, b, t):
        async with DualVLLMCoordinator(config([a, b], [t])) as c:
            pusher = BasePusher(c.base_engine, probes, top_k=5)
            with pytest.raises(WeightSyncError, match="no base replica serves") as failed:
                # The checkpoint holds seed 7 and the learner says seed 8: no replica can match it.
                await pusher.push_saved(write_fake_weights(tmp_path / "step-1", 7), learner(8, probes))
            assert a.url in str(failed.value) and b.url in str(failed.value)


def test_serve_prints_pool_variables_and_stops_only_when_a_whole_role_is_gone(capsys):
    from types import SimpleNamespace

    from dualvllm.serve import _print_servers, _role_lost

    servers = [SimpleNamespace(name=n, url=f"http://127.0.0.1:{p}", log_path=f"{n}.log", running=True)
               for n, p in (("theta-0", 1), ("t-0", 2), ("theta-1", 3), ("t-1", 4))]
    _print_servers(*servers)
    assert ("export DUALVLLM_THETA_URLS=http://127.0.0.1:1,http://127.0.0.1:3 "
            "DUALVLLM_T_URLS=http://127.0.0.1:2,http://127.0.0.1:4") in capsys.readouterr().out
    servers[2].running = False  # one base replica: the pool fails over, the endpoint serves on
    assert _role_lost(servers) is None
    servers[0].running = False  # every base replica
    assert _role_lost(servers) is servers[0]


def test_assign_keeps_a_sequence_on_its_replica_until_it_is_down_or_full_and_counts_its_moves():
    replicas = [SimpleNamespace(name="theta", url=f"http://127.0.0.1:{8000 + i}") for i in range(3)]
    pool = ReplicaPool(replicas, name="theta")  # type: ignore[arg-type]
    assert pool.assign(None, {0: 2, 1: 0, 2: 1}) == 1 and pool.membership.counters.moves == 0  # a new one: the emptiest
    assert pool.assign(0, {0: 2, 1: 0, 2: 1}) == 0  # kept while its replica is up
    assert pool.assign(0, {0: 2, 1: 0, 2: 1}, room=2) == 1 and pool.membership.counters.moves == 1  # its replica is full
    pool.membership.take_out(1, "connection reset")
    assert pool.assign(1, {0: 2, 2: 1}) == 2 and pool.membership.counters.moves == 2  # its replica is down


async def test_a_replica_whose_rejoin_overlaps_a_push_is_probed_again_after_it(caplog):
    """No lock across I/O: the pool counts its changes, and a replica whose checks ran across one
    (a push that began while it was being checked) stays out until it is checked again after."""
    import asyncio

    caplog.set_level("INFO", logger="dualvllm")
    async with running_fakes(FakeModel(1), FakeModel(1), FakeModel(2)) as (a, b, t):
        async with DualVLLMCoordinator(config([a, b], [t])) as c:
            pool = c.base_engine
            assert isinstance(pool, ReplicaPool)
            entered, release, checks = asyncio.Event(), asyncio.Event(), []

            async def slow_check(replica) -> None:  # a trainer's catch-up push takes a while
                checks.append(replica.url)
                entered.set()
                await release.wait()

            pool.membership.add_rejoin_check(slow_check)
            b.fail_next("/v1/completions", Failure(503))
            await c.generate_batch(PROMPTS[:4], max_tokens=2, seed=1)
            assert c.get_statistics()["theta_replicas_up"] == 1
            await asyncio.wait_for(entered.wait(), 30)  # b answers /health and is being checked
            async with pool.membership.changing() as live:
                assert [index for index, _ in live] == [0]  # the push reaches a alone
                release.set()  # b's checks pass, but they started before the push
                await eventually(lambda: "probed again after the change" in caplog.text, "b's checks were set aside")
                assert c.get_statistics()["theta_replicas_up"] == 1
            await eventually(lambda: c.get_statistics()["theta_replicas_up"] == 2, "b rejoined after the push")
            url = b.url
    assert len(checks) >= 2 and set(checks) == {url}  # checked again after the push, then let in
