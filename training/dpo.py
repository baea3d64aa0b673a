"""DPO on preference pairs mined from verified q* rollouts, trained with TRL's DPOTrainer.

sample    `steps x prompts_per_step` prompts, `group_size` q* rollouts each, scored
mine      pair a correct and an incorrect completion of the same prompt
          -> OUTPUT/pairs.jsonl ({"prompt", "chosen", "rejected"}, reusable with TRL)
train     trl.DPOTrainer on the base model (reference = the base as it started)
evaluate  held-out greedy accuracy of the base before and after -> OUTPUT/final/
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Sequence

from dualvllm.common.errors import NoTrainingSignalError
from dualvllm.coordinator import DualVLLMCoordinator
from dualvllm.training.config import DPOTrainConfig
from dualvllm.training.recipe import held_out, prepare
from dualvllm.training.rollouts import Groups, sample_batch
from dualvllm.training.serving import serving
from dualvllm.training.verifiers import verifier_pool


@dataclass(frozen=True)
class Pair:
    prompt: str
    chosen: str
    rejected: str


def mine_pairs(groups: Groups, prompts: Sequence[str]) -> list[Pair]:
    """Every rollout of a prompt below the group's best reward, paired with one of the best
    (round-robin): with a 0/1 reward, every wrong answer against a right one.

    Groups whose rollouts all scored alike give no pair: there is nothing to prefer.
    """
    pairs: list[Pair] = []
    for group, prompt in zip(groups, prompts):
        best = max(r.reward for r in group)
        chosen = [r.text for r in group if r.reward == best]
        worse = [r.text for r in group if r.reward < best]
        pairs.extend(
            Pair(prompt=prompt, chosen=chosen[i % len(chosen)], rejected=rejected) for i, rejected in enumerate(worse)
        )
    return pairs


def write_pairs(path: Path, pairs: Sequence[Pair]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for pair in pairs:
            f.write(json.dumps({"prompt": pair.prompt, "chosen": pair.chosen, "rejected": pair.rejected}) + "\n")


@dataclass(frozen=True)
class DPOReport:
    pairs: int
    accuracy_before: float
    accuracy_after: float
    pairs_path: Path
    model_dir: Path


async def train_dpo(config: DPOTrainConfig, *, show_progress: bool = True) -> DPOReport:
    """`dualvllm train --method dpo`: the recipe below, set up, trained and cleaned up."""
    return await DPORecipe(config, show_progress=show_progress).run()


class DPORecipe:
    """setup / evaluate / sample_pairs / train / cleanup, shaped as GRPORecipe is (torchtune's shape).

    Offline, unlike GRPO: one batch of q* rollouts, sampled once, mined into pairs, then TRL's
    DPOTrainer over them; the servers are closed while it trains and the trained weights are
    evaluated on servers of their own."""

    def __init__(self, config: DPOTrainConfig, *, show_progress: bool = True) -> None:
        self.config = config
        self.show_progress = show_progress
        self.out: Path = config.output_dir
        self._stack = contextlib.ExitStack()

    async def run(self) -> DPOReport:
        try:
            self.setup()
            async with serving(self.config, self.base_dir, log_dir=self.out, batch_size=self.batch_size) as coordinator:
                before = await self.evaluate(coordinator)
                pairs = await self.sample_pairs(coordinator)
            final = self.train(pairs)
            async with serving(self.config, str(final), log_dir=self.out / "final-servers") as coordinator:
                after = await self.evaluate(coordinator)
            return DPOReport(
                pairs=len(pairs),
                accuracy_before=before,
                accuracy_after=after,
                pairs_path=self.pairs_path,
                model_dir=final,
            )
        finally:
            self.cleanup()

    def setup(self) -> None:
        """The learner's device, inputs (both checked before any server starts) and the verifier pool."""
        from dualvllm.training.device import autocast_dtype, learner_device

        self.device = learner_device(self.config.learner_device)
        self.precision = autocast_dtype(self.device, self.config.mixed_precision)
        inputs = prepare(self.config)
        self.base_dir, self.tokenizer, self.problems = inputs.base_dir, inputs.tokenizer, inputs.problems
        self.chosen = self.problems.train[: self.config.steps * self.config.prompts_per_step]
        self.batch_size = len(self.chosen) * self.config.group_size
        self.pairs_path = self.out / "pairs.jsonl"
        self.pool = self._stack.enter_context(verifier_pool())

    async def evaluate(self, coordinator: DualVLLMCoordinator) -> float:
        """Held-out greedy accuracy of the weights `coordinator`'s base serves."""
        return (await held_out(coordinator, self.config, self.problems, self.pool))["held_out_accuracy"]

    async def sample_pairs(self, coordinator: DualVLLMCoordinator) -> list[Pair]:
        """One batch of q* rollouts, scored, mined into pairs -> OUTPUT/pairs.jsonl."""
        config = self.config
        sampled = await sample_batch(
            coordinator,
            self.chosen,
            config.sampling_params(fixed_alpha=config.fixed_alpha),
            group_size=config.group_size,
            seed=config.seed,
            spec=self.problems.spec,
            executor=self.pool,
            reward_timeout_s=config.reward_timeout,
        )
        # sample_batch drops groups with fewer than 2 rollouts; match prompts by prompt ids.
        prompt_of = {task.prompt_ids: task.prompt_text for task in self.chosen}
        groups = sampled.groups
        pairs = mine_pairs(groups, [prompt_of[g[0].prompt_ids] for g in groups])
        write_pairs(self.pairs_path, pairs)
        if not pairs:
            raise NoTrainingSignalError(
                f"no preference pairs in {len(groups)} prompts: every prompt's rollouts were all right or all "
                "wrong. Sample more per prompt (--group-size), more prompts (--steps, --prompts-per-step), or "
                "at a higher --temperature"
            )
        return pairs

    def train(self, pairs: Sequence[Pair]) -> Path:
        """TRL's DPOTrainer on `pairs` from the base (LoRA with --lora-rank; reference = the base as it
        started); the trained weights, merged, -> OUTPUT/final."""
        import torch
        from datasets import Dataset
        from transformers import AutoModelForCausalLM
        from trl import DPOConfig, DPOTrainer

        from dualvllm.training import lora

        config = self.config
        torch.manual_seed(config.seed)
        if self.device.type == "cuda":  # accelerate puts a single-process run on the current device ("cuda")
            torch.cuda.set_device(self.device)
        model = AutoModelForCausalLM.from_pretrained(self.base_dir, dtype=torch.float32)  # the master weights
        args = DPOConfig(
            output_dir=str(self.out / "trl"),
            per_device_train_batch_size=32,
            num_train_epochs=config.dpo_epochs,
            learning_rate=config.learning_rate,
            beta=config.dpo_beta,
            save_strategy="no",
            report_to=[],
            use_cpu=self.device.type == "cpu",
            bf16=self.precision == torch.bfloat16,  # transformers' autocast over the float32 weights
            fp16=self.precision == torch.float16,
            seed=config.seed,
            logging_steps=5,
            disable_tqdm=not self.show_progress,
        )
        dataset = Dataset.from_list([{"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected} for p in pairs])
        peft_config = None
        if config.lora_rank:
            from peft import LoraConfig

            peft_config = LoraConfig(
                r=config.lora_rank,
                lora_alpha=config.lora_alpha,
                lora_dropout=0.0,
                target_modules=list(lora.TARGET_MODULES),
                task_type="CAUSAL_LM",
            )
        trainer = DPOTrainer(
            model=model, args=args, train_dataset=dataset, processing_class=self.tokenizer, peft_config=peft_config
        )
        trainer.train()
        final = self.out / "final"
        lora.save_full(trainer.model, final)  # merged weights when trained with LoRA
        self.tokenizer.save_pretrained(final)
        return final

    def cleanup(self) -> None:
        """The verifier pool (the servers close with their `serving` blocks)."""
        self._stack.close()
