"""The servers a training or evaluation run samples from, and the coordinator over them.

Which weights each server holds, by `--teacher`:

    a model directory   two servers: the base (start_dir; the weights pushed during training)
                        and that teacher
    self                one server: the base, sent the teacher's prompts too, so the teacher
                        is always the current policy shown privileged information
    self-frozen         two servers: the base, and the starting base weights as the teacher
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import AsyncIterator

import tinymodels
from coordinator import CoordinatorConfig, DualVLLMCoordinator
from engines.launcher import VLLMServer, launch_pair, pair_configs
from engines.vllm_client import VLLMClient
from training.config import TaskConfig

# One per-token request carries every active sequence: no more than the servers accept.
MAX_PROMPTS = CoordinatorConfig.model_fields["max_prompts_per_request"].default


@contextlib.asynccontextmanager
async def serving(config: TaskConfig, start_dir: str, *, log_dir: Path | None = None, dev_mode: bool = False,
                  batch_size: int = 64) -> AsyncIterator[tuple[DualVLLMCoordinator, VLLMClient]]:
    """(coordinator, a client of the base server) over the servers of `config`.

    The base serves `start_dir` (the base, or a checkpoint when resuming), in dev mode for
    weight pushes when asked (loopback only). `batch_size` is the coordinator's batch.
    """
    base_dir = config.base or str(tinymodels.BASE_DIR)
    teacher = base_dir if config.teacher == "self-frozen" else config.teacher
    bundled = {"dtype": tinymodels.SERVER_DTYPE} if config.base is None else {}  # start_dir is a copy of it
    base_config, teacher_config = pair_configs(start_dir, None if teacher == "self" else teacher, log_dir=log_dir,
                                               dev_mode=dev_mode, max_logprobs=max(config.top_k, 20), lockstep=config.lockstep,
                                               **bundled)
    async with contextlib.AsyncExitStack() as stack:
        if teacher == "self":
            theta_server = t_server = await stack.enter_async_context(VLLMServer(base_config, name="theta"))
        else:
            theta_server, t_server = await stack.enter_async_context(launch_pair(base_config, teacher_config))
        coordinator_config = CoordinatorConfig(theta_url=theta_server.url, t_url=t_server.url, top_k=config.top_k,
                                               max_batch_size=min(max(64, batch_size), MAX_PROMPTS), seed=config.seed)
        coordinator = await stack.enter_async_context(DualVLLMCoordinator(coordinator_config))
        base_client = await stack.enter_async_context(VLLMClient(theta_server.url, name="theta"))
        yield coordinator, base_client
