"""The asyncio coordinator: samples text from q* ∝ pi_theta^(1-alpha) pi_t^alpha over two engines.

Importing this package does not import torch.
"""

from coordinator.api import generate_with_optimal_sampling
from coordinator.config import CoordinatorConfig
from coordinator.core import DualVLLMCoordinator
from coordinator.outputs import FinishReason, GenerationOutput, Prompt
from coordinator.sequence import SamplingParams

__all__ = [
    "CoordinatorConfig", "DualVLLMCoordinator", "FinishReason", "GenerationOutput", "Prompt",
    "SamplingParams", "generate_with_optimal_sampling",
]
