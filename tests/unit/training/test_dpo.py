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
