"""`dualvllm demo`: q* against the base and the teacher on the bundled arithmetic task.

Three arms sample the same held-out problems: the base alone (alpha = 0), the teacher
alone (alpha = 1), and q* (alpha* per token). The report gives each arm's exact-match
accuracy, its mean alpha and the coordinator's tokens/s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from dualvllm.coordinator.core import DualVLLMCoordinator
from dualvllm.common.errors import GenerationFailedError
from dualvllm.tinymodels.task import Problem, problems, score

# The answer is at most 3 digits and EOS; a little slack shows a model that rambles.
DEMO_MAX_TOKENS = 6
ARMS: tuple[tuple[str, float | None], ...] = (
    ("base (alpha=0)", 0.0),
    ("teacher (alpha=1)", 1.0),
    ("q* (alpha*)", None),
)


@dataclass(frozen=True)
class ArmResult:
    name: str
    accuracy: float
    mean_alpha: float
    tokens: int
    seconds: float
    example: str


@dataclass(frozen=True)
class DemoReport:
    num_prompts: int
    arms: list[ArmResult]

    def render(self) -> str:
        lines = [
            f"dualvllm demo: {self.num_prompts} held-out problems (a+b=, answer digits reversed)",
            f"{'arm':<20}{'accuracy':>10}{'mean alpha':>12}{'tokens/s':>10}   example",
        ]
        for arm in self.arms:
            lines.append(
                f"{arm.name:<20}{arm.accuracy:>10.1%}{arm.mean_alpha:>12.3f}"
                f"{arm.tokens / arm.seconds:>10.1f}   {arm.example}"
            )
        return "\n".join(lines)


async def run_demo(
    coordinator: DualVLLMCoordinator, *, num_prompts: int, temperature: float, seed: int = 0
) -> DemoReport:
    tasks = problems("test", n=num_prompts, seed=seed)
    results = [await _run_arm(coordinator, tasks, name, alpha, temperature, seed) for name, alpha in ARMS]
    return DemoReport(num_prompts=len(tasks), arms=results)


async def _run_arm(
    coordinator: DualVLLMCoordinator,
    tasks: list[Problem],
    name: str,
    fixed_alpha: float | None,
    temperature: float,
    seed: int,
) -> ArmResult:
    started = time.perf_counter()
    outputs = await coordinator.generate_batch(
        [p.prompt for p in tasks],
        max_tokens=DEMO_MAX_TOKENS,
        temperature=temperature,
        seed=seed,
        fixed_alpha=fixed_alpha,
        show_progress=True,
    )
    seconds = time.perf_counter() - started
    failed = [o for o in outputs if not o.ok]
    if failed:
        raise GenerationFailedError(f"{len(failed)} demo generations failed; first: {failed[0].error}")
    alphas = [a for o in outputs for a in o.alpha_history]
    first = outputs[0]
    return ArmResult(
        name=name,
        accuracy=sum(score(p, o.generated_text) for p, o in zip(tasks, outputs)) / len(tasks),
        mean_alpha=sum(alphas) / len(alphas),
        tokens=len(alphas),
        seconds=seconds,
        example=f"{tasks[0].prompt}{first.generated_text!r} (want {tasks[0].answer!r})",
    )
