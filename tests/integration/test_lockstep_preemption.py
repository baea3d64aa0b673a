"""Lockstep on servers whose KV cache cannot hold the batch: vLLM preempts sequences mid-run.

A preempted request loses its KV blocks, waits, and is recomputed (prompt and tokens so far)
when blocks free up, while the other server's copy of the sequence waits on it. The
coordinator must take the sequence up where it was: every token equal to per-token mode's.
"""

from __future__ import annotations

import re

import aiohttp
import numpy as np
import pytest

from coordinator import CoordinatorConfig, DualVLLMCoordinator
from engines.launcher import pair_configs
from tests.integration.pairs import running_pair
from tinymodels.task import problems

# 24 blocks of 32 tokens hold the 16 prompts (one block each, ~7 tokens) but not 16
# sequences of ~47 tokens (two blocks each): preemptions start past 32 tokens.
BLOCK_SIZE = 32
BLOCKS = 24
SEQUENCES = 16
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def tiny_cache_pair(tmp_path_factory):
    configs = pair_configs(log_dir=tmp_path_factory.mktemp("vllm-tiny-cache-logs"), max_logprobs=20, lockstep=True,
                           lockstep_timeout_s=15,
                           extra_args=("--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override", str(BLOCKS)))
    with running_pair(configs) as pair:
        yield pair


async def _preemptions(url: str) -> float:
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as response:
        text = await response.text()
    return sum(float(v) for v in re.findall(r"^vllm:num_preemptions_total\{[^}]*\} (\S+)$", text, re.M))


async def test_preempted_sequences_resume_with_the_per_token_tokens(tiny_cache_pair):
    theta, t = tiny_cache_pair
    prompts = [p.prompt for p in problems("test", n=SEQUENCES, seed=9)]
    results = {}
    for mode in ("lockstep", "per_token"):
        config = CoordinatorConfig(theta_url=theta.url, t_url=t.url, top_k=20, mode=mode, max_batch_size=SEQUENCES)
        async with DualVLLMCoordinator(config) as c:
            results[mode] = await c.generate_batch(prompts, max_tokens=MAX_TOKENS, seed=3, ignore_eos=True)
        if mode == "lockstep":
            preempted = [await _preemptions(theta.url), await _preemptions(t.url)]
    assert max(preempted) > 0, "the KV cache held the whole batch: nothing was preempted"
    for got, want in zip(results["lockstep"], results["per_token"]):
        assert got.ok, got.error
        assert got.finish_reason == "max_tokens" and len(got.generated_tokens) == MAX_TOKENS
        assert got.generated_tokens == want.generated_tokens
        np.testing.assert_allclose(got.logprobs_q, want.logprobs_q, atol=1e-5)
