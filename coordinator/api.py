"""One-call convenience for scripts that do not need a long-lived coordinator."""

from __future__ import annotations

from typing import Any
from collections.abc import Sequence

from dualvllm.coordinator.config import CoordinatorConfig
from dualvllm.coordinator.core import DualVLLMCoordinator
from dualvllm.coordinator.outputs import GenerationOutput, Prompt


async def generate_with_optimal_sampling(
    prompts: Sequence[Prompt],
    theta_url: str,
    t_url: str,
    max_tokens: int = 128,
    **kwargs: Any,
) -> list[GenerationOutput]:
    """Open a coordinator on two servers, generate for `prompts`, close it.

    Keyword arguments that are CoordinatorConfig fields (top_k, seed, ...) configure the
    coordinator; the rest (temperature, stop, ...) go to `generate_batch`.
    """
    config_keys = CoordinatorConfig.model_fields.keys() & kwargs.keys()
    config = CoordinatorConfig(theta_url=theta_url, t_url=t_url, **{k: kwargs.pop(k) for k in config_keys})
    async with DualVLLMCoordinator(config) as coordinator:
        return await coordinator.generate_batch(prompts, max_tokens=max_tokens, **kwargs)
