"""The servers a training run samples from, and the held-out evaluation both methods share."""

from __future__ import annotations

import contextlib
from concurrent.futures import ProcessPoolExecutor
from typing import AsyncIterator

import tinymodels
from coordinator import CoordinatorConfig, DualVLLMCoordinator
from engines.launcher import launch_pair, pair_configs
from engines.vllm_client import VLLMClient
from training.config import TrainConfig
from training.rollouts import Task
from training.verifiers import exact_match, score_in_pool

# One per-token request carries every active sequence: no more than the servers accept.
MAX_PROMPTS = CoordinatorConfig.model_fields["max_prompts_per_request"].default


async def held_out_accuracy(coordinator: DualVLLMCoordinator, tasks: list[Task], max_tokens: int,
                            pool: ProcessPoolExecutor) -> float:
    """Greedy exact-match accuracy of the base model alone (alpha = 0) on `tasks`."""
    outputs = await coordinator.generate_batch([list(t.prompt_ids) for t in tasks], max_tokens=max_tokens,
                                               temperature=0.0, fixed_alpha=0.0)
    rewards = await score_in_pool(exact_match, [o.generated_text for o in outputs], [t.reference for t in tasks], pool)
    return sum(rewards) / len(rewards)


@contextlib.asynccontextmanager
async def serving(config: TrainConfig, start_dir: str) -> AsyncIterator[tuple[DualVLLMCoordinator, VLLMClient]]:
    """The base server (dev mode, loopback, on `start_dir`) and the teacher, with a coordinator."""
    bundled = {"dtype": tinymodels.SERVER_DTYPE} if config.base is None else {}  # start_dir is a copy of it
    servers = pair_configs(start_dir, config.teacher, log_dir=config.output_dir, dev_mode=True,
                           max_logprobs=max(config.top_k, 20), **bundled)
    async with launch_pair(*servers) as (theta_server, t_server):
        coordinator_config = CoordinatorConfig(theta_url=theta_server.url, t_url=t_server.url, top_k=config.top_k,
                                               max_batch_size=min(max(64, config.prompts_per_step * config.group_size),
                                                                  MAX_PROMPTS),
                                               seed=config.seed)
        async with DualVLLMCoordinator(coordinator_config) as coordinator, \
                VLLMClient(theta_server.url, name="theta") as base_client:
            yield coordinator, base_client
