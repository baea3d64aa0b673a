"""Every training method and objective term, two updates each, against one real dev-mode pair.

Each run names the running servers (--theta-urls/--t-urls), so it first pushes its own
starting weights into the base: runs do not see each other's updates. What is checked is
that each method samples what it should (alpha = 1 for sft, 0 for opd, pooled groups),
computes its terms (their metrics are logged and finite) and pushes verified weights;
whether a method lifts accuracy is benchmarks/train_compare.py's question, not a test's.
"""

from __future__ import annotations

import json
import math

import pytest


torch = pytest.importorskip("torch")
from tests.recipes import TINY_ARITH  # noqa: E402
from dualvllm.training.config import TrainConfig  # noqa: E402
from dualvllm.training.grpo import train_grpo  # noqa: E402



# id -> (TrainConfig fields, a metric the method logs at every update)
METHODS = {
    "sft": ({"method": "sft"}, "sft_rollouts"),
    "rft": ({"method": "rft"}, "sft_rollouts"),
    "opd": ({"method": "opd"}, "teacher_log_ratio"),
    "grpo-opd-term": ({"opd_coef": 0.5}, "teacher_log_ratio"),
    "grpo-distill-term": ({"distill_coef": 1.0, "distill_beta": 0.5}, "distill_divergence"),
    "sft-distill-term": ({"method": "sft", "distill_coef": 1.0}, "distill_divergence"),
    "grpo-vespo": ({"correction": "vespo"}, "vespo_phi_mean"),
    "grpo-pooled-luffy": ({"on_policy_rollouts": 2, "guided_shaping": 0.1, "correction": "none"}, "loss"),
    "grpo-alpha-schedule": ({"alpha_decay_steps": 1, "alpha_cap_start": 0.5}, "loss"),
}


@pytest.mark.parametrize("fields, metric", METHODS.values(), ids=METHODS.keys())
async def test_each_method_trains_two_updates_with_verified_pushes(dev_pair, tmp_path, fields, metric):
    theta, t = dev_pair
    config = TrainConfig.parse(config_file=TINY_ARITH, output_dir=tmp_path / "run", theta_urls=(theta.url,),
                               t_urls=(t.url,), steps=2, prompts_per_step=2, group_size=4, eval_every=2,
                               eval_prompts=8, max_tokens=4, seed=0, **fields)
    report = await train_grpo(config, show_progress=False)

    assert report.steps_done == 2
    records = [json.loads(line) for line in report.metrics_path.read_text().splitlines()]
    updates = [r for r in records if "event" not in r]
    assert [r["step"] for r in updates] == [1, 2]
    assert [r["step"] for r in records if r.get("event") == "eval"] == [0, 2]  # the final evaluation ran once
    for record in updates:
        assert record["push_verified_by"] in ("digest", "digest+probe") and record.get("push_max_abs_diff", 0) < 1e-3
        assert math.isfinite(record["loss"]) and math.isfinite(record[metric])
        if config.sampling_alpha is not None:
            assert record["mean_alpha"] == pytest.approx(config.sampling_alpha)
    if config.method == "opd":  # the learner's tokens are its own: log pi_theta - log pi_t >= 0 on average
        assert all(r["teacher_log_ratio"] > 0 for r in updates)
    if config.pooled_on_policy:  # half of every group at alpha = 0, the other half from q*
        assert all(0 < r["mean_alpha"] < 1 for r in updates)
    if fields.get("alpha_decay_steps"):  # capped at 0.5 before the first update, at 0 after it (the sampler runs ahead)
        assert 0 < updates[0]["mean_alpha"] <= 0.5 and all(r["mean_alpha"] <= 0.5 for r in updates)
