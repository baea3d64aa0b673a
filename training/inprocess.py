"""`--engine transformers`: sampling in this process, from the learner's live weights.

For small models and fast sweeps, as TRL's `use_vllm=False` is: the base role is a
TransformersEngine over the model being trained (no server, no weight push: an update is
visible to the next forward pass), the teacher a TransformersEngine loaded beside it (or
the same engine for `--teacher self`), and the coordinator runs its per-token mode over
them. The coordinator code, rollouts, rewards, losses and evaluation are the ones the
server path uses, so a sweep made here measures the same recipe. Every update runs
inside the base engine's `updating()`, so no forward pass sees half-updated weights and
no cached key/value survives an update.
"""

from __future__ import annotations

import contextlib
from typing import Any
from collections.abc import AsyncIterator

from dualvllm import tinymodels
from dualvllm.coordinator import DualVLLMCoordinator
from dualvllm.engines.transformers_engine import TransformersEngine
from dualvllm.training.config import TrainConfig
from dualvllm.training.serving import coordinator_config


@contextlib.asynccontextmanager
async def in_process(
    config: TrainConfig, model: Any, tokenizer: Any, *, batch_size: int
) -> AsyncIterator[tuple[DualVLLMCoordinator, TransformersEngine]]:
    """(coordinator, the base's live engine) over `model` and the run's teacher, the teacher on
    `model`'s device (the learner's: --learner-device)."""
    device = str(next(model.parameters()).device)
    async with contextlib.AsyncExitStack() as stack:
        base = await stack.enter_async_context(TransformersEngine.live(model, tokenizer, name="theta"))
        if config.teacher == "self":
            teacher = base
        else:
            path = (
                (config.base or tinymodels.BASE_DIR)
                if config.teacher == "self-frozen"
                else (config.teacher or tinymodels.TEACHER_DIR)
            )
            teacher = await stack.enter_async_context(TransformersEngine(path, name="t", device=device))
        coordinator = await stack.enter_async_context(
            DualVLLMCoordinator(
                coordinator_config(config, batch_size=batch_size, mode="per_token"), theta_engine=base, t_engine=teacher
            )
        )
        yield coordinator, base
