"""Replica pools over 2 + 2 real vLLM servers (the bundled models): a base replica is killed.

- Mid-run, with SIGKILL: its sequences move to the other base replica and continue from
  their recorded tokens, so every token and log q* equals an uninterrupted run's with the
  same seed, and no sequence fails. Restarted on its port, it passes /health and the
  weights probe and rejoins; a weight push then reaches both replicas, verified on each.
- In lockstep mode, with SIGKILL on a teacher replica: its sequences start again from
  their agreed tokens on the other teacher, and every token equals per-token mode's.
  Restarted with the plugin, it passes the plugin check and rejoins; restarted with chunked
  prefill on, it fails the same check and stays out.
- During `dualvllm train` (lockstep, the default with these servers): the run goes on,
  pushing verified weights into the survivor.

The servers run in dev mode (weight pushes) with the lockstep plugin; per-token runs ask
for mode="per_token". Only the second pair's servers are killed (the first is the session's
dev pair). The training test runs last: it leaves a base replica dead.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess

import pytest
import transformers

from dualvllm import tinymodels
from dualvllm.coordinator import CoordinatorConfig, DualVLLMCoordinator
from dualvllm.engines.launcher import VLLMServer, pair_configs
from tests.integration.pairs import running_servers
from tests.integration.test_cli import FILE_POLL_S, dualvllm
from tests.recipes import TINY_ARITH
from tests.waiting import eventually
from dualvllm.tinymodels.task import problems
from dualvllm.training.weight_sync import BasePusher

SEQUENCES = 16
MAX_TOKENS = 24
PROBE_INTERVAL_S = 0.5
# How often a wait asks the coordinator for its statistics: each ask takes ~1 ms of the loop
# the coordinator runs in (benchmarks/README.md, service_load.py).
STATS_POLL_S = 0.1


@pytest.fixture(scope="module")
def pools(dev_servers, tmp_path_factory):
    """[theta-0, t-0, theta-1, t-1]: two pairs of servers, the bases in dev mode. The first pair is
    the session's dev pair; the second, started here, is the one whose servers the tests kill."""
    theta, t = pair_configs(log_dir=tmp_path_factory.mktemp("vllm-pool-logs"), dev_mode=True, max_logprobs=100,
                            lockstep=True, lockstep_timeout_s=15)
    with running_servers([(theta, "theta-1"), (t, "t-1")]) as servers:
        pool = [*dev_servers, *servers]
        try:
            yield pool
        finally:
            servers[:] = pool[2:]  # what the tests restarted in their place, stopped on the way out


def pool_config(servers: list[VLLMServer], mode: str = "per_token") -> CoordinatorConfig:
    return CoordinatorConfig(theta_urls=[s.url for s in servers[0::2]], t_urls=[s.url for s in servers[1::2]],
                             top_k=20, mode=mode, replica_probe_interval=PROBE_INTERVAL_S)


def kill(server: VLLMServer) -> None:
    assert server.pid is not None
    os.killpg(server.pid, signal.SIGKILL)  # a crash: no shutdown, every request to it breaks
    server.stop()  # reaps it


def restarted(server: VLLMServer, log_dir) -> VLLMServer:
    """A new server on the port of `server` (killed), with the same model and flags."""
    return VLLMServer(server.config.model_copy(update={"port": server.port,
                                                       "log_path": log_dir / f"{server.name}-restarted.log"}),
                      name=server.name)


def assert_lost_nothing(outputs, reference, stats: dict, role: str, atol: float) -> None:
    """No sequence failed, each has the reference run's tokens and log q*, and the killed
    replica of `role` was marked down with its sequences moved."""
    assert all(o.ok for o in outputs) and stats["sequences_failed"] == 0
    assert [o.generated_tokens for o in outputs] == [o.generated_tokens for o in reference]
    for got, want in zip(outputs, reference):
        assert got.logprobs_q == pytest.approx(want.logprobs_q, abs=atol)
    assert stats[f"{role}_replica_downs"] == 1 and stats[f"{role}_replicas_up"] == 1
    assert 1 <= stats[f"{role}_replica_moves"] <= SEQUENCES


async def test_a_killed_base_replica_loses_no_token_and_rejoins_after_a_restart(pools, dev_pair, tmp_path):
    prompts = [p.prompt for p in problems("test", n=SEQUENCES, seed=12)]
    theta1 = restarted(pools[2], tmp_path)
    async with DualVLLMCoordinator(pool_config(pools)) as c:
        reference = await c.generate_batch(prompts, max_tokens=MAX_TOKENS, seed=4, ignore_eos=True)
        before = c.get_statistics()
        run = asyncio.create_task(c.generate_batch(prompts, max_tokens=MAX_TOKENS, seed=4, ignore_eos=True))
        await eventually(lambda: c.get_statistics()["tokens"] >= before["tokens"] + SEQUENCES * MAX_TOKENS // 4,
                         "a quarter of the run's tokens", timeout_s=300, poll_s=STATS_POLL_S)
        assert not run.done(), "the run ended before the kill"
        kill(pools[2])
        outputs = await run
        after_kill = c.get_statistics()

        await theta1.start()  # same port, same model
        pools[2] = theta1  # the fixture stops it
        await eventually(lambda: c.get_statistics()["theta_replicas_up"] == 2, "the restarted base replica up",
                         timeout_s=60, poll_s=STATS_POLL_S)

        # Both base replicas take a push of other weights (the teacher's), each verified.
        tokenizer = transformers.AutoTokenizer.from_pretrained(tinymodels.TEACHER_DIR)
        learner = transformers.AutoModelForCausalLM.from_pretrained(tinymodels.TEACHER_DIR)
        probes = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts[:4]]
        push = await BasePusher(c.base_engine, probes).push(learner, tokenizer, tmp_path / "pushed")
        # and the same through the disk, the path of servers without a weight-transfer engine
        disk = await BasePusher(c.base_engine, probes, via="disk").push(learner, tokenizer, tmp_path / "on-disk")
        final = c.get_statistics()
        # Both back on the bundled base, as the next tests expect of one pool's replicas.
        base = transformers.AutoModelForCausalLM.from_pretrained(tinymodels.BASE_DIR)
        await BasePusher(c.base_engine, probes).push(base, tokenizer, tmp_path / "restored")

    assert_lost_nothing(outputs, reference, after_kill, "theta", atol=1e-6)
    assert final["theta_replica_rejoins"] == 1
    assert push.via == "memory" and disk.via == "disk"
    for report in (push, disk):
        assert (report.replicas, report.dropped) == (2, ()) and report.max_abs_diff < 1e-3


async def test_a_killed_teacher_replica_in_lockstep_mode_loses_no_token_and_rejoins(pools, tmp_path):
    prompts = [p.prompt for p in problems("test", n=SEQUENCES, seed=13)]
    async with DualVLLMCoordinator(pool_config(pools)) as c:
        reference = await c.generate_batch(prompts, max_tokens=MAX_TOKENS, seed=5, ignore_eos=True)
    t1 = restarted(pools[3], tmp_path)
    async with DualVLLMCoordinator(pool_config(pools, mode="lockstep")) as c:
        run = asyncio.create_task(c.generate_batch(prompts, max_tokens=MAX_TOKENS, seed=5, ignore_eos=True))
        await eventually(lambda: c.get_statistics()["tokens"] >= SEQUENCES * MAX_TOKENS // 4,
                         "a quarter of the run's tokens", timeout_s=300, poll_s=STATS_POLL_S)
        assert not run.done(), "the run ended before the kill"
        kill(pools[3])
        outputs = await run
        stats = c.get_statistics()
        # Back with the plugin: it passes /health, the plugin check and the weights probe.
        await t1.start()
        pools[3] = t1  # the fixture stops it
        await eventually(lambda: c.get_statistics()["t_replicas_up"] == 2, "the restarted teacher replica up",
                         timeout_s=60, poll_s=STATS_POLL_S)
        again = await c.generate_batch(prompts, max_tokens=4, seed=5, ignore_eos=True)

    assert_lost_nothing(outputs, reference, stats, "t", atol=1e-5)
    assert all(o.ok for o in again) and c.get_statistics()["t_replica_rejoins"] == 1


# Slow (two restarts, ~90 s): the refusal is tests/unit/coordinator/test_lockstep_pools.py's, over fake servers.
@pytest.mark.slow
async def test_a_teacher_replica_restarted_with_chunked_prefill_stays_out_of_lockstep(pools, tmp_path, caplog):
    """The rejoin check is the start-up probe's: a replica restarted with the plugin but with
    chunked prefill on (its plugin would count half-computed prompts as decode steps) answers
    /health yet stays out of its pool, and lockstep sequences run on the other replica."""
    prompts = [p.prompt for p in problems("test", n=SEQUENCES, seed=14)]
    config = pools[3].config
    chunked = VLLMServer(config.model_copy(update={
        "port": pools[3].port, "log_path": tmp_path / "t-1-chunked.log",
        "extra_args": (*config.extra_args, "--enable-chunked-prefill")}), name=pools[3].name)
    async with DualVLLMCoordinator(pool_config(pools, mode="lockstep")) as c:
        run = asyncio.create_task(c.generate_batch(prompts, max_tokens=MAX_TOKENS, seed=6, ignore_eos=True))
        await eventually(lambda: c.get_statistics()["tokens"] >= SEQUENCES * MAX_TOKENS // 4,
                         "a quarter of the run's tokens", timeout_s=300, poll_s=STATS_POLL_S)
        kill(pools[3])
        assert all(o.ok for o in await run)
        await chunked.start()
        pools[3] = chunked  # the fixture stops it
        await eventually(lambda: c.get_statistics()["t_replica_refusals"] >= 1,
                         "the restarted replica's rejoin refused", timeout_s=120, poll_s=STATS_POLL_S)
        again = await c.generate_batch(prompts, max_tokens=4, seed=6, ignore_eos=True)
        stats = c.get_statistics()

    assert all(o.ok for o in again)
    assert stats["t_replicas_up"] == 1 and stats["t_replica_rejoins"] == 0
    assert "chunked prefill" in caplog.text  # the pool's warning gives the probe's reason
    # The training test after this one expects lockstep: a teacher replica as it was.
    kill(chunked)
    plain = VLLMServer(config.model_copy(update={"port": chunked.port, "log_path": tmp_path / "t-1-plain.log"}),
                       name=chunked.name)
    pools[3] = plain
    await plain.start()


def test_training_goes_on_pushing_verified_weights_when_a_base_replica_dies(pools, dev_pair, tmp_path):
    out, log = tmp_path / "run", tmp_path / "train.log"
    with open(log, "w") as stderr:  # a file, not a pipe: nobody reads it while the run goes on
        run = dualvllm("train", "--config", str(TINY_ARITH), "--output-dir", str(out), "--theta-urls", pools[0].url,
                       pools[2].url, "--t-urls", pools[1].url, pools[3].url, "--steps", "4", "--prompts-per-step", "2",
                       "--group-size", "4", "--eval-prompts", "8", "--max-tokens", "4", "--eval-every", "4",
                       "--weights-via", "disk",  # the other tests of `train` push in memory
                       stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        metrics = out / "metrics.jsonl"

        def first_step() -> bool:
            assert run.poll() is None, log.read_text()[-3000:]
            return metrics.is_file() and '"step": 1,' in metrics.read_text()

        asyncio.run(eventually(first_step, "the first training step", timeout_s=600, poll_s=FILE_POLL_S))
        kill(pools[2])  # after the first update's push, before the second's
        run.wait(timeout=600)
    finally:
        run.kill()
    text = log.read_text()
    assert run.returncode == 0, text[-3000:]
    steps = [r for r in map(json.loads, metrics.read_text().splitlines()) if "event" not in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert steps[0]["push_replicas"] == 2  # both took the first update's weights
    assert all(r["push_via"] == "disk" for r in steps)
    assert all(r["push_replicas"] == 1 for r in steps[1:])  # then the survivor alone, verified
    assert all(r["push_max_abs_diff"] < 1e-3 for r in steps)
    assert f"theta replica {pools[2].url} is down" in text  # the loss was logged, naming the replica
    assert "decoding mode: lockstep" in text  # the default with servers that carry the plugin
