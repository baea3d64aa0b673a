"""The learner without [B, T, V] logits (issue 41): the lm_head in chunks (training/logprobs.py) and
micro-batches with gradient accumulation (training/learner.py), against the plain computation.

The reference is written here from the full-vocabulary forward: log_softmax over the model's
whole logits, then the loss terms of dualvllm.training.losses / dualvllm.training.distill on the whole batch.
The learner must give the same loss and the same gradient for every parameter whatever its
micro-batch size, lm_head chunk and gradient checkpointing; and it must never allocate a
tensor the size of the logits.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from dualvllm.training.distill import generalized_jsd, with_tail  # noqa: E402
from dualvllm.training.learner import Learner, Objective, completion_logprobs, pack  # noqa: E402
from dualvllm.training.losses import advantages as group_advantages, normalize, policy_loss  # noqa: E402
from dualvllm.training.rollouts import Rollout, ScoredBatch  # noqa: E402

PAD = 0
TOPK = 4
# (prompt length, completion length) per rollout, two groups of three: rows of different lengths
# so that micro-batches are padded differently from the whole batch.
SHAPES = (((3, 5), (6, 2), (4, 9)), ((5, 7), (2, 4), (7, 6)))
REWARDS = ((1.0, 0.0, 0.5), (0.0, 1.0, 1.0))


def tiny_model(vocab: int = 1000, hidden: int = 32, seed: int = 0):
    """A random Qwen3 (2 layers, GQA); initializer_range 0.2 so its distributions are far from uniform."""
    config = transformers.Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                      max_position_embeddings=64, initializer_range=0.2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return transformers.Qwen3ForCausalLM(config).float()


def rollouts(vocab: int = 1000, seed: int = 1) -> ScoredBatch:
    """Random token ids, log q* off the model by up to a few nats, log pi_t, and a teacher top-k with padding."""
    rng = np.random.default_rng(seed)
    groups = []
    for shapes, rewards in zip(SHAPES, REWARDS):
        group = []
        for (p, n), reward in zip(shapes, rewards):
            ids = rng.choice(np.arange(1, vocab), size=(n, TOPK)).astype(np.int64)
            logprobs = np.sort(np.log(rng.dirichlet(np.ones(TOPK + 1), size=n)[:, :TOPK]), axis=1)[:, ::-1].copy()
            logprobs[0, -1], ids[0, -1] = -math.inf, -1  # the teacher recorded fewer than k at the first state
            group.append(Rollout(
                prompt_ids=tuple(int(i) for i in rng.integers(1, vocab, p)),
                completion_ids=tuple(int(i) for i in rng.integers(1, vocab, n)),
                logprobs_q=tuple(rng.uniform(-8.0, -4.0, n)), alphas=(0.5,) * n, text="", reward=reward,
                logprobs_t=tuple(rng.uniform(-9.0, -1.0, n)), teacher_topk=(ids, logprobs)))
        groups.append(tuple(group))
    return ScoredBatch(groups=tuple(groups), policy_version=0, data_position=0, sample_seconds=1.0, tokens=0)


def full_logprobs(model, packed) -> torch.Tensor:
    """log_softmax of the whole logits at every completion state -> [B, T, V]."""
    logits = model(input_ids=packed.input_ids, attention_mask=packed.attention_mask).logits  # [B, L, V]
    positions = packed.starts[:, None] - 1 + torch.arange(packed.targets.shape[1])[None, :]  # [B, T]
    positions = positions.clamp(max=logits.shape[1] - 1)
    return torch.log_softmax(logits[torch.arange(logits.shape[0])[:, None], positions].float(), dim=-1)


def reference_loss(model, reference_model, batch: ScoredBatch, objective: Objective, kl_coef: float) -> torch.Tensor:
    """The update's loss from full-vocabulary log-probabilities, the whole batch at once."""
    rows = [r for g in batch.groups for r in g]
    packed = pack(rows, PAD)
    mask = packed.target_mask
    all_logp = full_logprobs(model, packed)  # [B, T, V]
    logp = all_logp.gather(-1, packed.targets[..., None])[..., 0] * mask  # [B, T]
    loss = torch.zeros(())
    rewards = [torch.tensor([r.reward for r in g]) for g in batch.groups]
    if objective.method in ("grpo", "opd"):
        behaviour = packed.logp_behaviour.float()
        log_ratio = ((logp.detach() - behaviour) * mask).sum(-1)
        correction = objective.correction if objective.method == "grpo" else "none"
        advantages, _ = group_advantages(rewards, torch.split(log_ratio, [3, 3]), correction=correction,
                                         share_cap=objective.share_cap)
        if objective.method == "opd":
            advantages = torch.zeros_like(advantages)
        token_advantages = None
        if objective.teacher_advantage_coef:
            token_advantages = -objective.teacher_advantage_coef * (logp.detach() - packed.logp_teacher.float()) * mask
        reference = None
        if kl_coef:
            with torch.no_grad():
                reference = full_logprobs(reference_model, packed).gather(-1, packed.targets[..., None])[..., 0] * mask
        term, _ = policy_loss(logp, behaviour, advantages.float(), mask, correction=correction,
                              normalization=objective.normalization,
                              max_completion_length=objective.max_completion_length, logp_reference=reference,
                              kl_coef=kl_coef, token_advantages=token_advantages)
        loss = loss + term
    elif objective.method == "sft":
        loss = loss + normalize(-logp, mask, "dapo")
    if objective.distill_coef:
        valid = torch.isfinite(packed.teacher_logprobs)
        student = with_tail(all_logp.gather(-1, packed.teacher_ids), valid)  # [B, T, K + 1]
        teacher = with_tail(packed.teacher_logprobs, valid)
        divergence = generalized_jsd(student, teacher, objective.distill_beta)  # [B, T]
        loss = loss + objective.distill_coef * normalize(divergence, mask, "dapo")
    return loss


CASES = {
    "grpo-sequence-kl": (Objective(correction="sequence", normalization="dapo"), 0.1),
    "grpo-token-kl-opd": (Objective(correction="token", normalization="grpo", teacher_advantage_coef=0.5), 0.1),
    "grpo-vespo-dr_grpo": (Objective(correction="vespo", normalization="dr_grpo", max_completion_length=9), 0.0),
    "sft": (Objective(method="sft"), 0.0),
    "opd": (Objective(method="opd", teacher_advantage_coef=1.0), 0.0),
    "distill-forward-kl": (Objective(method="distill", distill_coef=1.0, distill_beta=0.0), 0.0),
    "distill-jsd": (Objective(method="distill", distill_coef=1.0, distill_beta=0.5), 0.0),
}


def gradients(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_gradients(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, expected in want.items():
        scale = float(expected.abs().max())
        assert scale > 0, f"{name} got no gradient: the comparison would say nothing"
        torch.testing.assert_close(got[name], expected, rtol=1e-5, atol=1e-5 * scale, msg=name)


@pytest.mark.parametrize("case", list(CASES))
def test_micro_batches_and_logit_chunks_give_the_full_vocabulary_loss_and_gradient(case):
    objective, kl_coef = CASES[case]
    batch = rollouts()
    model = tiny_model()
    reference_model = tiny_model(seed=5)  # a reference apart from the model, so the KL term is not ~0
    want_loss = reference_loss(model, reference_model, batch, objective, kl_coef)
    want_loss.backward()
    want = gradients(model)
    baseline_metrics = None
    for micro_batch_size, chunk in ((None, 256), (None, 3), (1, 3), (3, 3), (4, 5)):
        model.zero_grad()
        learner = Learner(model, learning_rate=1e-3, kl_coef=kl_coef, pad_id=PAD, micro_batch_size=micro_batch_size,
                          logit_chunk_size=chunk)
        if learner.reference is not None:
            learner.reference.load_state_dict(reference_model.state_dict())
        metrics = learner.accumulate_gradients(batch, objective)
        assert metrics["loss"] == pytest.approx(float(want_loss), rel=1e-5), (micro_batch_size, chunk)
        assert_same_gradients(gradients(model), want)
        if baseline_metrics is None:
            baseline_metrics = metrics
        assert metrics.keys() == baseline_metrics.keys()
        for key, value in metrics.items():  # the metrics are the whole batch's, however it was cut
            assert value == pytest.approx(baseline_metrics[key], rel=1e-5, abs=1e-7), (key, micro_batch_size)


def test_learner_loss_is_the_whole_batch_in_one_graph_whatever_the_micro_batch_size():
    objective = Objective(correction="sequence", distill_coef=0.5, distill_beta=0.5)
    batch = rollouts()
    model = tiny_model()
    want_loss = reference_loss(model, None, batch, objective, 0.0)
    want_loss.backward()
    want = gradients(model)
    model.zero_grad()
    loss, _ = Learner(model, learning_rate=1e-3, kl_coef=0.0, pad_id=PAD, micro_batch_size=2,
                      logit_chunk_size=4).loss(batch, objective)
    loss.backward()
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-5)
    assert_same_gradients(gradients(model), want)


def test_gradient_checkpointing_changes_no_gradient_and_leaves_sampling_with_a_cache_alone():
    objective = Objective(correction="sequence")
    batch = rollouts()
    model = tiny_model()
    Learner(model, learning_rate=1e-3, kl_coef=0.0, pad_id=PAD).accumulate_gradients(batch, objective)
    want = gradients(model)
    model = tiny_model()
    learner = Learner(model, learning_rate=1e-3, kl_coef=0.0, pad_id=PAD, micro_batch_size=2, logit_chunk_size=4,
                      gradient_checkpointing=True)
    learner.accumulate_gradients(batch, objective)
    assert_same_gradients(gradients(model), want)
    # Between updates the model is in eval mode: generation with a KV cache (the in-process
    # engine's) gives what the same model without checkpointing gives.
    assert not model.training
    prompt = torch.tensor([[5, 17, 99, 3]])
    with torch.no_grad():
        cached = model.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True)
        plain = tiny_model().generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True)
    assert torch.equal(cached, plain)


def test_a_lora_model_with_checkpointing_gets_the_full_vocabulary_gradient_on_its_adapters():
    from dualvllm.training import lora

    objective = Objective(method="distill", distill_coef=1.0, distill_beta=0.5)
    batch = rollouts()

    def adapted():
        model = lora.wrap(tiny_model(), rank=4, alpha=8)
        torch.manual_seed(3)
        for name, p in model.named_parameters():
            if "lora_B" in name:  # peft starts B at 0, where the adapter changes nothing yet
                torch.nn.init.normal_(p, std=0.1)
        return model

    model = adapted()
    packed = pack([r for g in batch.groups for r in g], PAD)
    with torch.no_grad():
        full = full_logprobs(model, packed).gather(-1, packed.targets[..., None])[..., 0] * packed.target_mask
        torch.testing.assert_close(completion_logprobs(model, packed, chunk_size=3), full, rtol=1e-5, atol=1e-5)
    reference_loss(model, None, batch, objective, 0.0).backward()
    want = gradients(model)
    assert want and all("lora_" in name for name in want)
    model = adapted()
    Learner(model, learning_rate=1e-3, kl_coef=0.0, pad_id=PAD, micro_batch_size=2, logit_chunk_size=3,
            gradient_checkpointing=True).accumulate_gradients(batch, objective)
    assert_same_gradients(gradients(model), want)


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an operator returns (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in torch.utils._pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel())
        return out


@pytest.mark.parametrize("objective", [Objective(correction="sequence"),
                                       Objective(method="distill", distill_coef=1.0, distill_beta=0.5)],
                         ids=["grpo", "distill"])
def test_no_tensor_as_large_as_the_logits_is_ever_allocated(objective):
    """A vocabulary large against the model (5,000 x 16): logits of the whole batch would be the
    largest tensor by far. An update may allocate one chunk of logits or a parameter-sized tensor
    (the head's gradient), nothing larger."""
    vocab, chunk = 5000, 4
    batch = rollouts(vocab)
    model = tiny_model(vocab=vocab, hidden=16)
    packed = pack([r for g in batch.groups for r in g], PAD)
    real_tokens = int(packed.target_mask.sum())
    allowed = max(chunk * vocab, max(p.numel() for p in model.parameters()))
    assert allowed * 2 < real_tokens * vocab, "the test's shapes must tell a chunk from the whole"
    with LargestTensor() as probe:  # the probe sees the full-vocabulary computation's logits
        reference_loss(model, None, batch, objective, 0.0).backward()
    assert probe.largest >= packed.input_ids.numel() * vocab
    for micro_batch_size in (None, 2):
        model.zero_grad()
        learner = Learner(model, learning_rate=1e-3, kl_coef=0.0, pad_id=PAD, micro_batch_size=micro_batch_size,
                          logit_chunk_size=chunk)
        with LargestTensor() as probe:
            learner.accumulate_gradients(batch, objective)
        assert probe.largest <= allowed, (micro_batch_size, probe.largest, allowed)


def test_the_chunks_logits_are_not_kept_for_backward():
    """What the forward keeps for backward (autograd's saved tensors, parameters aside) stays well
    below one copy of the logits: each chunk's logits are recomputed in backward, not saved.
    (The body's own activations, some 300 kB here, are what it keeps.)"""
    vocab = 20_000
    batch = rollouts(vocab)
    model = tiny_model(vocab=vocab, hidden=16)
    objective = Objective(method="distill", distill_coef=1.0, distill_beta=0.5)
    packed = pack([r for g in batch.groups for r in g], PAD)
    logits_bytes = int(packed.target_mask.sum()) * vocab * 4  # float32 logits at the real completion states
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def saved_bytes(forward) -> int:
        storages: dict[int, int] = {}

        def keep(tensor):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in parameters:
                storages[storage.data_ptr()] = storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            forward()
        return sum(storages.values())

    assert saved_bytes(lambda: reference_loss(model, None, batch, objective, 0.0)) >= logits_bytes
    learner = Learner(model, learning_rate=1e-3, kl_coef=0.0, pad_id=PAD, logit_chunk_size=4)
    assert saved_bytes(lambda: learner.loss(batch, objective)) < logits_bytes / 4


def test_an_update_flushes_denormal_floats_in_its_backward_and_restores_the_threads_flag():
    """A rollout with a tiny sequence weight backpropagates denormal gradients, ~100x slower on x86
    (dualvllm.training.learner.denormals_flushed): the update's backward zeroes them, in a worker thread too,
    and the thread flushes as before once it is over (left on, the flag broke hypothesis's floats)."""
    import threading

    def tiny_product() -> float:
        return float(torch.tensor([1e-30]) * torch.tensor([1e-10]))  # 1e-40: a denormal float32, or 0

    seen: dict[str, float] = {}

    def update() -> None:
        torch.set_flush_denormal(False)  # a new thread inherits its creator's flag
        seen["before"] = tiny_product()
        model = tiny_model()
        next(model.parameters()).register_hook(lambda grad: seen.update(backward=tiny_product()))
        learner = Learner(model, learning_rate=1e-3, kl_coef=0.0, pad_id=PAD, micro_batch_size=2)
        learner.train_step(rollouts(), Objective(correction="sequence", normalization="dapo"))
        seen["after"] = tiny_product()

    worker = threading.Thread(target=update)
    worker.start()
    worker.join(timeout=120)
    assert not worker.is_alive(), "the update did not finish within 120 s"
    assert seen["before"] > 0.0, "this CPU keeps denormals by default: the check below would say nothing"
    assert seen["backward"] == 0.0, "the backward pass kept denormal floats"
    assert seen["after"] == seen["before"], "the update left the thread flushing denormals"
