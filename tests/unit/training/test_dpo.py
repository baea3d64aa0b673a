"""Mining preference pairs from verified rollouts."""

from __future__ import annotations

import json

from dualvllm.training.dpo import Pair, mine_pairs, write_pairs
from dualvllm.training.rollouts import Rollout


def r(text: str, reward: float) -> Rollout:
    return Rollout(prompt_ids=(1,), completion_ids=(2,), logprobs_q=(-1.0,), alphas=(0.3,), text=text, reward=reward)


def test_each_wrong_rollout_is_paired_with_a_right_one(tmp_path):
    groups = (
        (r("64", 1.0), r("65", 0.0), r("46", 0.0), r("64", 1.0)),
        (r("11", 1.0), r("11", 1.0)),  # all right: nothing to prefer
        (r("1", 0.0), r("2", 0.0)),  # all wrong: nothing to prefer
    )
    pairs = mine_pairs(groups, ["12+34=", "5+6=", "0+0="])
    assert pairs == [Pair("12+34=", "64", "65"), Pair("12+34=", "64", "46")]
    path = tmp_path / "pairs.jsonl"
    write_pairs(path, pairs)
    assert [json.loads(line) for line in path.read_text().splitlines()][0] == \
        {"prompt": "12+34=", "chosen": "64", "rejected": "65"}


def test_full_fine_tuning_dpo_trains_on_pairs_in_process(tmp_path):
    """The DPO step itself, full fine-tuning, without servers: TRL's DPOTrainer on pairs, the
    merged weights written (the LoRA run, with its mining and evaluations on real servers, is
    tests/integration/test_cli.py's). The trained base prefers each pair's chosen answer over its
    rejected one by a wider margin than before, DPO's objective."""
    import torch
    from transformers import AutoModelForCausalLM

    from dualvllm.training.config import TrainConfig
    from dualvllm.training.dpo import DPORecipe

    config = TrainConfig.parse(output_dir=tmp_path / "dpo", method="dpo", steps=1, prompts_per_step=8, group_size=2,
                               lora_rank=0, learning_rate=1e-4, dpo_epochs=2, max_tokens=6)
    recipe = DPORecipe(config, show_progress=False)
    recipe.setup()
    try:
        pairs = [Pair(task.prompt_text, answer, answer[::-1] + "1")
                 for task, answer in zip(recipe.chosen, ("64", "11", "95", "38", "72", "13", "50", "27"))]
        final = recipe.train(pairs)
    finally:
        recipe.cleanup()
    assert (final / "model.safetensors").is_file() and not (final / "adapter_config.json").exists()
    tokenizer = recipe.tokenizer

    def margin(model_dir) -> float:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        total = 0.0
        for pair in pairs:
            prompt = tokenizer(pair.prompt, add_special_tokens=False)["input_ids"]
            scores = []
            for answer in (pair.chosen, pair.rejected):
                ids = prompt + tokenizer(answer, add_special_tokens=False)["input_ids"]
                with torch.no_grad():
                    logprobs = model(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
                scores.append(sum(logprobs[i - 1, ids[i]].item() for i in range(len(prompt), len(ids))))
            total += scores[0] - scores[1]
        return total / len(pairs)

    assert margin(final) > margin(recipe.base_dir)
