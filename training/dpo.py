"""DPO on preference pairs mined from verified q* rollouts, trained with TRL's DPOTrainer.

    sample    `steps x prompts_per_step` prompts, `group_size` q* rollouts each, scored
    mine      pair a correct and an incorrect completion of the same prompt
              -> OUTPUT/pairs.jsonl ({"prompt", "chosen", "rejected"}, reusable with TRL)
    train     trl.DPOTrainer on the base model (reference = the base as it started)
    evaluate  held-out greedy accuracy of the base before and after -> OUTPUT/final/
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Sequence

from common.errors import NoTrainingSignalError
from training.config import DPOTrainConfig
from training.recipe import held_out, prepare
from training.rollouts import Groups, sample_batch
from training.serving import serving
from training.verifiers import verifier_pool


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
    pairs = []
    for group, prompt in zip(groups, prompts):
        best = max(r.reward for r in group)
        chosen = [r.text for r in group if r.reward == best]
        worse = [r.text for r in group if r.reward < best]
        pairs.extend(Pair(prompt=prompt, chosen=chosen[i % len(chosen)], rejected=rejected)
                     for i, rejected in enumerate(worse))
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
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    from training import lora

    out: Path = config.output_dir
    inputs = prepare(config)
    base_dir, tokenizer, problems = inputs.base_dir, inputs.tokenizer, inputs.problems
    chosen = problems.train[:config.steps * config.prompts_per_step]
    batch_size = len(chosen) * config.group_size
    with verifier_pool() as pool:
        async with serving(config, base_dir, log_dir=out, batch_size=batch_size) as coordinator:
            accuracy_before = (await held_out(coordinator, config, problems, pool))["held_out_accuracy"]
            sampled = await sample_batch(
                coordinator, chosen, group_size=config.group_size, max_tokens=config.max_tokens,
                temperature=config.temperature, fixed_alpha=config.fixed_alpha, seed=config.seed,
                spec=problems.spec, executor=pool, reward_timeout_s=config.reward_timeout)
        # sample_batch drops groups with fewer than 2 rollouts; match prompts by prompt ids.
        prompt_of = {task.prompt_ids: task.prompt_text for task in chosen}
        groups = sampled.groups
        pairs = mine_pairs(groups, [prompt_of[g[0].prompt_ids] for g in groups])
        pairs_path = out / "pairs.jsonl"
        write_pairs(pairs_path, pairs)
        if not pairs:
            raise NoTrainingSignalError(
                f"no preference pairs in {len(groups)} prompts: every prompt's rollouts were all right or all "
                "wrong. Sample more per prompt (--group-size), more prompts (--steps, --prompts-per-step), or "
                "at a higher --temperature")

        torch.manual_seed(config.seed)
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        args = DPOConfig(output_dir=str(out / "trl"), per_device_train_batch_size=32, num_train_epochs=config.dpo_epochs,
                         learning_rate=config.learning_rate, beta=config.dpo_beta, save_strategy="no", report_to=[],
                         use_cpu=not torch.cuda.is_available(), seed=config.seed, logging_steps=5,
                         disable_tqdm=not show_progress)
        dataset = Dataset.from_list([{"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected} for p in pairs])
        peft_config = None
        if config.lora_rank:
            from peft import LoraConfig

            peft_config = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=0.0,
                                     target_modules=list(lora.TARGET_MODULES), task_type="CAUSAL_LM")
        trainer = DPOTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                             peft_config=peft_config)
        trainer.train()
        final = out / "final"
        lora.save_full(trainer.model, final)  # merged weights when trained with LoRA
        tokenizer.save_pretrained(final)
        async with serving(config, str(final), log_dir=out / "final-servers") as coordinator:
            accuracy_after = (await held_out(coordinator, config, problems, pool))["held_out_accuracy"]
    return DPOReport(pairs=len(pairs), accuracy_before=accuracy_before, accuracy_after=accuracy_after,
                     pairs_path=pairs_path, model_dir=final)

