"""Lockstep through disruptions, on a pair of its own: preemption, a weight push, a restart.

- The pair's KV cache cannot hold the batch, so vLLM preempts sequences mid-run. A
  preempted request loses its KV blocks, waits, and is recomputed (prompt and tokens so
  far) when blocks free up, while the other server's copy of the sequence waits on it.
- Weights are pushed into the base mid-run, inside `coordinator.paused()`: every sequence
  is taken off both servers at its agreed tokens and resumed after the push.
- The teacher is killed mid-run and started again: every request it held breaks, and the
  base's copies of those sequences wait on rows that will never come.
Either way the coordinator must take every sequence up where it was: every token equal to
per-token mode's, none lost. The restart test runs last: it replaces the pair's teacher.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal

import aiohttp
import numpy as np
import pytest
import transformers

from dualvllm import tinymodels

from dualvllm.coordinator import CoordinatorConfig, DualVLLMCoordinator
from dualvllm.engines.launcher import VLLMServer, pair_configs
from dualvllm.engines.vllm_client import VLLMClient
from tests.integration.pairs import running_pair
from tests.waiting import eventually
from dualvllm.tinymodels.task import problems
from dualvllm.training.weight_sync import push_weights

# 24 blocks of 32 tokens hold the 16 prompts (one block each, ~7 tokens) but not 16
# sequences of ~47 tokens (two blocks each): preemptions start past 32 tokens.
BLOCK_SIZE = 32
BLOCKS = 24
SEQUENCES = 16
MAX_TOKENS = 40
# A wait for the run's progress: the run itself ends sooner (then the wait fails at once).
RUN_WAIT_S = 300
# How often that wait asks the coordinator for its statistics: each ask takes ~1 ms of the
# loop the coordinator runs in (benchmarks/README.md, service_load.py).
STATS_POLL_S = 0.05


@pytest.fixture(scope="module")
def tiny_cache_pair(tmp_path_factory):
    configs = pair_configs(log_dir=tmp_path_factory.mktemp("vllm-tiny-cache-logs"), max_logprobs=20, lockstep=True,
                           lockstep_timeout_s=15, dev_mode=True,
                           extra_args=("--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override", str(BLOCKS)))
    with running_pair(configs) as pair:
        yield pair


async def _preemptions(url: str) -> float:
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as response:
        text = await response.text()
    return sum(float(v) for v in re.findall(r"^vllm:num_preemptions_total\{[^}]*\} (\S+)$", text, re.M))


def _config(theta: VLLMServer, t: VLLMServer, mode: str) -> CoordinatorConfig:
    return CoordinatorConfig(theta_url=theta.url, t_url=t.url, top_k=20, mode=mode, max_batch_size=SEQUENCES)


async def _per_token(theta: VLLMServer, t: VLLMServer, prompts: list[str]):
    async with DualVLLMCoordinator(_config(theta, t, "per_token")) as c:
        return await c.generate_batch(prompts, max_tokens=MAX_TOKENS, seed=3, ignore_eos=True)


def _assert_same_tokens(lockstep, per_token) -> None:
    for got, want in zip(lockstep, per_token):
        assert got.ok, got.error
        assert got.finish_reason == "max_tokens" and len(got.generated_tokens) == MAX_TOKENS
        assert got.generated_tokens == want.generated_tokens
        np.testing.assert_allclose(got.logprobs_q, want.logprobs_q, atol=1e-5)


async def test_preempted_sequences_resume_with_the_per_token_tokens(tiny_cache_pair):
    theta, t = tiny_cache_pair
    prompts = [p.prompt for p in problems("test", n=SEQUENCES, seed=9)]
    async with DualVLLMCoordinator(_config(theta, t, "lockstep")) as c:
        lockstep = await c.generate_batch(prompts, max_tokens=MAX_TOKENS, seed=3, ignore_eos=True)
    preempted = [await _preemptions(theta.url), await _preemptions(t.url)]
    assert max(preempted) > 0, "the KV cache held the whole batch: nothing was preempted"
    _assert_same_tokens(lockstep, await _per_token(theta, t, prompts))


async def _wait_for_tokens(c: DualVLLMCoordinator, run: asyncio.Task, tokens: int) -> None:
    def reached() -> bool:
        assert not run.done(), "the run ended before the disruption"
        return c.get_statistics()["tokens"] >= tokens

    await eventually(reached, f"{tokens} tokens sampled", timeout_s=RUN_WAIT_S, poll_s=STATS_POLL_S)


async def test_a_weight_push_mid_run_resumes_every_sequence(tiny_cache_pair, tmp_path):
    theta, t = tiny_cache_pair
    prompts = [p.prompt for p in problems("test", n=SEQUENCES, seed=10)]
    # The base's own weights: the push goes through every stage (save, /pause, reload,
    # prefix-cache reset, /resume, verification) and the tokens stay comparable.
    tokenizer = transformers.AutoTokenizer.from_pretrained(tinymodels.BASE_DIR)
    learner = transformers.AutoModelForCausalLM.from_pretrained(tinymodels.BASE_DIR)
    probes = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts[:4]]
    async with DualVLLMCoordinator(_config(theta, t, "lockstep")) as c, \
            VLLMClient(theta.url, name="theta") as base:
        run = asyncio.create_task(c.generate_batch(prompts, max_tokens=MAX_TOKENS, seed=3, ignore_eos=True))
        await _wait_for_tokens(c, run, SEQUENCES * MAX_TOKENS // 4)
        async with c.paused():
            push = await push_weights(base, learner, tokenizer, tmp_path / "pushed", probes)
        assert not run.done()
        lockstep = await run
        suspended = c.get_statistics()["lockstep_suspensions"]
    assert push.max_abs_diff < 1e-3
    assert suspended >= 1
    _assert_same_tokens(lockstep, await _per_token(theta, t, prompts))


async def test_sequences_resume_after_the_teacher_is_killed_and_restarted(tiny_cache_pair, tmp_path):
    theta, t = tiny_cache_pair
    prompts = [p.prompt for p in problems("test", n=SEQUENCES, seed=11)]
    # Where the coordinator looks; a log of its own, so the first one shows the kill.
    restarted = VLLMServer(t.config.model_copy(update={"port": t.port, "log_path": tmp_path / "t-restarted.log"}),
                           name=t.name)
    try:
        async with DualVLLMCoordinator(_config(theta, t, "lockstep")) as c:
            assert c.mode == "lockstep"
            run = asyncio.create_task(c.generate_batch(prompts, max_tokens=MAX_TOKENS, seed=3, ignore_eos=True))
            await _wait_for_tokens(c, run, SEQUENCES * MAX_TOKENS // 4)
            assert t.pid is not None
            os.killpg(t.pid, signal.SIGKILL)  # a crash: no shutdown, every request breaks
            t.stop()  # reaps it
            await restarted.start()  # same port, same model
            lockstep = await run
        _assert_same_tokens(lockstep, await _per_token(theta, restarted, prompts))
    finally:
        restarted.stop()
