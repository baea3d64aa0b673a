"""TRL's GRPOTrainer with q* rollouts: its loss and gradient against this project's learner.

One fixed batch (2 prompts x 4 rollouts of the bundled task, with recorded log q*, log pi_t,
the teacher's top-k and rewards) goes through real TRL (QStarGRPOTrainer, fed by a rollout
function that returns the batch) and through dualvllm.training.learner.Learner; both start from the
bundled base's weights. Nothing of TRL or transformers is mocked.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
import torch

from dualvllm import tinymodels
from dualvllm.common.errors import InvalidInputError
from dualvllm.training.learner import Learner, Objective
from dualvllm.training.rollouts import Rollout, ScoredBatch

datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")
from dualvllm.training.trl_trainer import QStarGRPOConfig, QStarGRPOTrainer  # noqa: E402

PROMPTS = ("12+34=", "507+18=")  # different lengths: TRL pads prompts on the left, the learner on the right
COMPLETIONS = (("64<eos>", "46<eos>", "6<eos>", "64"), ("525<eos>", "52<eos>", "5255", "1<eos>"))
REWARDS = ((1.0, 0.0, 0.0, 1.0), (0.0, 1.0, 0.0, 0.0))
GROUP = 4
MAX_TOKENS = 6
TOPK = 5


def _fixed_batch(tokenizer: Any) -> list[list[dict[str, Any]]]:
    """Per prompt, its rollouts: token ids, log q* (off the base by up to ±1.5 nats), log pi_t, top-k."""
    rng = np.random.default_rng(7)
    groups = []
    for prompt, completions, rewards in zip(PROMPTS, COMPLETIONS, REWARDS):
        group = []
        for text, reward in zip(completions, rewards):
            ids = [tokenizer.eos_token_id if piece == "<eos>" else tokenizer.convert_tokens_to_ids(piece)
                   for piece in _pieces(text)]
            n = len(ids)
            topk_ids = np.stack([rng.choice(len(tokenizer), TOPK, replace=False) for _ in range(n)])  # [T, k]
            topk_lp = np.stack([np.sort(np.log(rng.dirichlet(np.ones(TOPK + 1))[:TOPK]))[::-1] for _ in range(n)])
            group.append({
                "prompt": prompt, "completion_ids": ids, "reward": reward,
                "log_q": rng.uniform(-3.0, -0.05, n).tolist(), "logprob_t": rng.uniform(-4.0, -0.01, n).tolist(),
                "topk_ids": topk_ids, "topk_logprobs": topk_lp,
            })
        groups.append(group)
    return groups


def _pieces(text: str) -> list[str]:
    out, rest = [], text
    while rest:
        if rest.startswith("<eos>"):
            out.append("<eos>")
            rest = rest[5:]
        else:
            out.append(rest[0])
            rest = rest[1:]
    return out


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tinymodels.BASE_DIR)


@pytest.fixture(scope="module")
def batch(tokenizer):
    return _fixed_batch(tokenizer)


def _model():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tinymodels.BASE_DIR, dtype=torch.float32)


class FixedRollouts:
    """A rollout function that returns the fixed batch: each occurrence of a prompt gets its next rollout."""

    def __init__(self, groups: list[list[dict[str, Any]]]) -> None:
        self.groups = {g[0]["prompt"]: g for g in groups}
        self.calls = 0

    def __call__(self, prompts: list[str], trainer: Any) -> dict[str, list]:
        self.calls += 1
        seen: dict[str, int] = {}
        rows = []
        for prompt in prompts:
            rows.append(self.groups[prompt][seen.get(prompt, 0)])
            seen[prompt] = seen.get(prompt, 0) + 1
        return {
            "prompt_ids": [trainer.processing_class(text=r["prompt"])["input_ids"] for r in rows],
            "completion_ids": [r["completion_ids"] for r in rows],
            "logprobs": [r["log_q"] for r in rows],
            "reward": [r["reward"] for r in rows],
            "logprob_t": [r["logprob_t"] for r in rows],
            "teacher_topk_ids": [r["topk_ids"].tolist() for r in rows],
            "teacher_topk_logprobs": [r["topk_logprobs"].tolist() for r in rows],
        }


def recorded_reward(prompts, completions, reward, **_):
    return list(reward)


def _trl_loss_and_grads(tmp_path, tokenizer, groups, *, trainer_class=QStarGRPOTrainer, config_class=QStarGRPOConfig,
                        **settings) -> tuple[float, torch.Tensor]:
    model = _model()
    # bf16=False: TRL's default (True) runs the policy's forward under bfloat16 autocast, which moves
    # the bundled base's logprobs by up to 0.05 nats against the float32 learner.
    config = config_class(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(groups) * GROUP,
                          num_generations=GROUP, max_completion_length=MAX_TOKENS, report_to=[], use_cpu=True,
                          temperature=1.0, seed=0, bf16=False, **settings)
    dataset = datasets.Dataset.from_dict({"prompt": list(PROMPTS)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rollout_func is experimental upstream: TRL says so once per trainer
        trainer = trainer_class(model=model, reward_funcs=recorded_reward, args=config, train_dataset=dataset,
                                processing_class=tokenizer, rollout_func=FixedRollouts(groups))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # what Trainer's loop sets for each optimizer step
    # What TRL's RepeatSampler hands one process: every prompt GROUP times in a row.
    generation_batch = [{"prompt": p} for p in PROMPTS for _ in range(GROUP)]
    inputs = trainer._prepare_inputs(generation_batch)
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    return float(loss.detach()), _flat_grads(trainer.model)


def _learner_loss_and_grads(tokenizer, groups, objective: Objective) -> tuple[float, torch.Tensor]:
    model = _model()
    learner = Learner(model, learning_rate=1e-3, kl_coef=0.0, pad_id=tokenizer.pad_token_id)
    loss, _ = learner.loss(_scored_batch(tokenizer, groups), objective)
    loss.backward()
    return float(loss.detach()), _flat_grads(model)


def _scored_batch(tokenizer, groups) -> ScoredBatch:
    rollouts = tuple(tuple(
        Rollout(prompt_ids=tuple(tokenizer(r["prompt"])["input_ids"]), completion_ids=tuple(r["completion_ids"]),
                logprobs_q=tuple(r["log_q"]), alphas=(0.5,) * len(r["completion_ids"]), text="", reward=r["reward"],
                logprobs_t=tuple(r["logprob_t"]), teacher_topk=(r["topk_ids"], r["topk_logprobs"]))
        for r in group) for group in groups)
    return ScoredBatch(groups=rollouts, policy_version=0, data_position=0, sample_seconds=1.0, tokens=0)


def _flat_grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() if p.grad is not None else torch.zeros(p.numel())
                      for _, p in sorted(model.named_parameters())])


CASES = {
    "none-dapo": dict(correction="none", loss_type="dapo"),
    "sequence-dapo": dict(correction="sequence", loss_type="dapo"),
    "token-dapo": dict(correction="token", loss_type="dapo"),
    "vespo-dapo": dict(correction="vespo", loss_type="dapo"),
    "sequence-grpo-unscaled": dict(correction="sequence", loss_type="grpo", scale_rewards="none"),
    "none-dr_grpo": dict(correction="none", loss_type="dr_grpo"),
    "sequence-opd-distill": dict(correction="sequence", loss_type="dapo", opd_coef=0.5, distill_coef=0.3,
                                 distill_beta=0.5),
}


def _objective(settings: dict[str, Any]) -> Objective:
    return Objective(method="grpo", correction=settings["correction"], normalization=settings["loss_type"],
                     scale_advantages=settings.get("scale_rewards", "group") == "group",
                     max_completion_length=MAX_TOKENS, teacher_advantage_coef=settings.get("opd_coef", 0.0),
                     distill_coef=settings.get("distill_coef", 0.0), distill_beta=settings.get("distill_beta", 0.0))


@pytest.mark.parametrize("case", list(CASES))
def test_trl_loss_and_gradient_equal_the_learners(case, tmp_path, tokenizer, batch):
    settings = CASES[case]
    trl_loss, trl_grads = _trl_loss_and_grads(tmp_path, tokenizer, batch, **settings)
    own_loss, own_grads = _learner_loss_and_grads(tokenizer, batch, _objective(settings))
    largest = float(own_grads.abs().max())
    assert largest > 1e-4, "the batch must give a real gradient, or the comparison says nothing"
    assert trl_loss == pytest.approx(own_loss, rel=1e-5, abs=1e-7)
    # Measured: at most 2.4e-6 apart (float32 round-off of two code paths), with gradients up to 4.3.
    torch.testing.assert_close(trl_grads, own_grads, rtol=1e-4, atol=1e-4 * largest)


def test_the_corrections_differ_on_this_batch(tmp_path, tokenizer, batch):
    """Otherwise the equality above would not tell the corrections apart."""
    grads = {c: _learner_loss_and_grads(tokenizer, batch, _objective(dict(correction=c, loss_type="dapo")))[1]
             for c in ("none", "sequence", "token", "vespo")}
    names = list(grads)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not torch.allclose(grads[a], grads[b], rtol=1e-3, atol=1e-6), (a, b)


def test_plain_trl_without_vllm_is_correction_none(tmp_path, tokenizer, batch):
    """GRPOTrainer as it is (use_vllm=False, loss_type dapo) ignores log q*: its gradient is correction none's.

    Its loss value differs (TRL's surrogate is -A · pi/pi_old = -A at the sampled weights, the
    learner's -A log pi), so only the gradients are compared.
    """
    _, plain = _trl_loss_and_grads(tmp_path, tokenizer, batch, trainer_class=trl.GRPOTrainer,
                                   config_class=trl.GRPOConfig, loss_type="dapo")
    _, none = _learner_loss_and_grads(tokenizer, batch, _objective(dict(correction="none", loss_type="dapo")))
    _, sequence = _learner_loss_and_grads(tokenizer, batch, _objective(dict(correction="sequence", loss_type="dapo")))
    torch.testing.assert_close(plain, none, rtol=1e-4, atol=1e-6)
    assert not torch.allclose(plain, sequence, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("settings, fragment", [
    (dict(loss_type="vespo"), "correction='vespo'"),
    (dict(loss_type="cispo"), "normalization"),
    (dict(correction="tokens"), "correction='tokens'"),
    (dict(num_iterations=2), "num_iterations"),
    (dict(scale_rewards="batch"), "group-relative"),
    (dict(top_entropy_quantile=0.5), "top_entropy_quantile"),
    (dict(beta=0.01), "use_bias_correction_kl"),
])
def test_config_refuses_what_the_loss_would_ignore(tmp_path, settings, fragment):
    with pytest.raises(InvalidInputError, match=fragment.replace("(", r"\(")):
        QStarGRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, **settings)


def test_trainer_refuses_to_run_without_a_rollout_function(tmp_path, tokenizer):
    config = QStarGRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=GROUP, num_generations=GROUP,
                             report_to=[], use_cpu=True)
    dataset = datasets.Dataset.from_dict({"prompt": list(PROMPTS)})
    with pytest.raises(InvalidInputError, match="rollout_func"):
        QStarGRPOTrainer(model=_model(), reward_funcs=recorded_reward, args=config, train_dataset=dataset,
                         processing_class=tokenizer)


def test_trls_own_training_loop_moves_the_weights_as_the_learner_does(tmp_path, tokenizer, batch):
    """Three optimizer steps through Trainer.train (TRL's AdamW, clipping, scheduler, accumulation) with the
    settings benchmarks/trl_compare.py uses, against three Learner.train_step on the same batch.

    Not bit-equal: TRL's AdamW leaves biases and norm weights out of weight decay, and Adam's first steps
    turn float32 round-off in tiny gradient entries into differences of up to lr. Measured after three
    steps at lr 2e-4: |difference| 8e-4 of |update| (0.18), largest entry 5.4e-5.
    """
    learning_rate, steps = 2e-4, 3
    settings = dict(correction="sequence", loss_type="dapo")
    config = QStarGRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(batch) * GROUP,
                             num_generations=GROUP, max_completion_length=MAX_TOKENS, report_to=[], use_cpu=True,
                             temperature=1.0, seed=0, bf16=False, max_steps=steps, learning_rate=learning_rate,
                             lr_scheduler_type="constant", weight_decay=0.01, max_grad_norm=1.0, save_strategy="no",
                             gradient_checkpointing=False, disable_tqdm=True, **settings)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = QStarGRPOTrainer(model=_model(), reward_funcs=recorded_reward, args=config,
                                   train_dataset=datasets.Dataset.from_dict({"prompt": list(PROMPTS)}),
                                   processing_class=tokenizer, rollout_func=FixedRollouts(batch))
    trainer.train()
    model = _model()
    learner = Learner(model, learning_rate=learning_rate, kl_coef=0.0, pad_id=tokenizer.pad_token_id)
    for _ in range(steps):
        learner.train_step(_scored_batch(tokenizer, batch), _objective(settings))
    start = dict(_model().named_parameters())
    trl_update = torch.cat([(p - start[n]).detach().flatten() for n, p in sorted(trainer.model.named_parameters())])
    own_update = torch.cat([(p - start[n]).detach().flatten() for n, p in sorted(model.named_parameters())])
    assert float(own_update.norm()) > 0.1, "the steps must move the weights, or the comparison says nothing"
    assert float((trl_update - own_update).norm()) < 1e-2 * float(own_update.norm())
    assert float((trl_update - own_update).abs().max()) < learning_rate


def test_every_trl_private_method_overridden_still_exists_with_its_signature():
    """A TRL upgrade that renames or reshapes a private method QStarGRPOTrainer overrides would
    leave the override unused and the q* corrections silently off: this fails first."""
    import inspect

    from trl import GRPOTrainer, __version__

    from dualvllm.training.trl_trainer import OVERRIDDEN

    for name, parameters in OVERRIDDEN.items():
        assert hasattr(GRPOTrainer, name), (
            f"TRL {__version__}'s GRPOTrainer has no {name} any more: QStarGRPOTrainer's override of it is dead; "
            "port it to the new method before widening pyproject.toml's TRL range")
        found = tuple(inspect.signature(getattr(GRPOTrainer, name)).parameters)
        assert found == parameters, f"TRL {__version__} changed GRPOTrainer.{name}{found}; the override takes {parameters}"
        assert tuple(inspect.signature(getattr(QStarGRPOTrainer, name)).parameters) == parameters
    # and no private method of ours shadows one of TRL's by accident
    ours = {n for n, f in vars(QStarGRPOTrainer).items() if n.startswith("_") and not n.startswith("__") and callable(f)}
    assert {n for n in ours if hasattr(GRPOTrainer, n)} == set(OVERRIDDEN)
