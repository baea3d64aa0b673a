"""The asyncio coordinator: samples text from q* ∝ pi_theta^(1-alpha) pi_t^alpha over two engines.

Importing this package does not import torch.
"""

from dualvllm.coordinator.api import generate_with_optimal_sampling
from dualvllm.coordinator.config import CoordinatorConfig
from dualvllm.coordinator.core import DualVLLMCoordinator
from dualvllm.coordinator.outputs import FinishReason, GenerationOutput, Prompt
from dualvllm.coordinator.sequence import SamplingParams

__all__ = [
    "CoordinatorConfig",
    "DualVLLMCoordinator",
    "FinishReason",
    "GenerationOutput",
    "Prompt",
    "SamplingParams",
    "generate_with_optimal_sampling",
]
