"""The learner: the base model in this process, updated on scored rollouts.

One update's loss is a sum of terms (`Objective`, from TrainConfig):
- the reward policy gradient of GRPO (dualvllm.training.losses.policy_loss) with its off-policy
  correction, plus on-policy distillation's per-token teacher advantages when opd_coef > 0
  (--method opd: those alone, no reward advantage), LUFFY's shaping on guided rollouts;
- supervised fine-tuning on chosen rollouts (--method sft: all of them, teacher samples;
  --method rft: those whose reward reaches rft_min_reward);
- distill_coef x the top-k JSD to the teacher at every visited state (dualvllm.training.distill;
  --method distill: that term alone).

None of it needs whole next-token distributions: the log-probabilities of the sampled
tokens and at the teacher's top-k ids come from the last hidden states through the lm_head
chunk by chunk (dualvllm.training.logprobs), so no [B, T, V] logits exist (issue 41: 40 GB at
Qwen3's vocabulary for 64 x 1,024 tokens). With `micro_batch_size` a few rollouts go
through the model at a time and their gradients accumulate; what the loss needs from the
whole batch (the normalizers, the group advantages) is computed first, so each
micro-batch backpropagates its exact share and the sum is the whole batch's gradient.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from dataclasses import dataclass
from typing import Any
from collections.abc import Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from dualvllm.training import lora
from dualvllm.training.data_parallel import DataParallel
from dualvllm.training.device import autocast
from dualvllm.training.distill import sft_loss, teacher_advantages, topk_divergence
from dualvllm.training.logprobs import body_and_head, last_hidden_states, selected_logprobs
from dualvllm.training.losses import Correction, Normalization, advantages as group_advantages, normalize, policy_loss
from dualvllm.training.rollouts import Rollout, ScoredBatch

log = logging.getLogger("dualvllm.training")

# Completion positions per lm_head chunk: one chunk's float32 logits at Qwen3's vocabulary are
# 256 x 151,936 x 4 B = 156 MB, and its backward holds a few such buffers (dualvllm.training.logprobs).
LOGIT_CHUNK_SIZE = 256


@dataclass(frozen=True)
class Objective:
    """What one update optimizes (see the module docstring); built by `dualvllm.training.grpo.objective`."""

    method: str = "grpo"  # grpo, sft, rft, opd, distill or adaptive
    correction: Correction = "sequence"
    scale_advantages: bool = True
    is_cap: float = 2.0
    share_cap: float = 3.0
    normalization: Normalization = "dapo"
    max_completion_length: int | None = None
    teacher_advantage_coef: float = 0.0
    distill_coef: float = 0.0
    distill_beta: float = 0.0
    shaping_gamma: float | None = None
    rft_min_reward: float = 1.0

    @property
    def policy_gradient(self) -> bool:
        return self.method in ("grpo", "opd", "adaptive")

    @property
    def min_group(self) -> int:
        """Rollouts a group needs to count: grpo compares them, the other methods take each alone
        (adaptive's groups of guided rollouts train each alone; its on-policy ones are compared)."""
        return 2 if self.method == "grpo" else 1

    @property
    def split_rows(self) -> bool:
        """adaptive: the reward term on the on-policy rollouts only (advantages among a group's
        on-policy members), the distillation term on the guided ones only (training/regimes.py)."""
        return self.method == "adaptive"

    @property
    def needs_teacher_topk(self) -> bool:
        return self.distill_coef > 0


@dataclass(frozen=True)
class Packed:
    """Rollouts as padded tensors: prompt + completion per row, completion positions masked in."""

    input_ids: torch.Tensor  # [B, L] right-padded
    attention_mask: torch.Tensor  # [B, L]
    targets: torch.Tensor  # [B, T] completion tokens, 0 where padded
    target_mask: torch.Tensor  # [B, T] 1 on real completion tokens
    logp_behaviour: torch.Tensor  # [B, T] log q* of each completion token
    starts: torch.Tensor  # [B] index in input_ids of the first completion token
    logp_teacher: torch.Tensor  # [B, T] log pi_t of each completion token (0 where not recorded)
    teacher_ids: torch.Tensor | None  # [B, T, k] the teacher's top-k at each state, when recorded
    teacher_logprobs: torch.Tensor | None  # [B, T, k] their logprobs (-inf in padding)


def pack(rollouts: Sequence[Rollout], pad_id: int, *, device: torch.device | str = "cpu") -> Packed:
    """`rollouts` as padded tensors on `device` (the model's).

    Filled row by row in host arrays, then each copied to the device once: filling a CUDA
    tensor row by row would copy every row on its own.
    """
    width_t = max(len(r.completion_ids) for r in rollouts)
    width = max(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts)
    batch = len(rollouts)
    input_ids = np.full((batch, width), pad_id, dtype=np.int64)
    attention = np.zeros((batch, width), dtype=np.int64)
    targets = np.zeros((batch, width_t), dtype=np.int64)
    target_mask = np.zeros((batch, width_t), dtype=np.float32)
    behaviour = np.zeros((batch, width_t), dtype=np.float64)
    starts = np.array([len(r.prompt_ids) for r in rollouts], dtype=np.int64)
    teacher = np.zeros((batch, width_t), dtype=np.float64)
    recorded = [r.teacher_topk for r in rollouts if r.teacher_topk is not None]
    k = recorded[0][0].shape[1] if len(recorded) == batch else 0
    teacher_ids = np.zeros((batch, width_t, k), dtype=np.int64) if k else None
    teacher_logprobs = np.full((batch, width_t, k), -np.inf, dtype=np.float32) if k else None
    for row, r in enumerate(rollouts):
        sequence = [*r.prompt_ids, *r.completion_ids]
        input_ids[row, : len(sequence)] = sequence
        attention[row, : len(sequence)] = 1
        n = len(r.completion_ids)
        targets[row, :n] = r.completion_ids
        target_mask[row, :n] = 1.0
        behaviour[row, :n] = r.logprobs_q
        if r.logprobs_t:
            teacher[row, :n] = r.logprobs_t
        if teacher_ids is not None and teacher_logprobs is not None and r.teacher_topk is not None:
            teacher_ids[row, :n] = np.maximum(r.teacher_topk[0], 0)
            teacher_logprobs[row, :n] = r.teacher_topk[1]

    def moved(values: np.ndarray | None) -> torch.Tensor | None:
        return None if values is None else torch.as_tensor(values, device=device)

    return Packed(
        torch.as_tensor(input_ids, device=device),
        torch.as_tensor(attention, device=device),
        torch.as_tensor(targets, device=device),
        torch.as_tensor(target_mask, device=device),
        torch.as_tensor(behaviour, device=device),
        torch.as_tensor(starts, device=device),
        torch.as_tensor(teacher, device=device),
        moved(teacher_ids),
        moved(teacher_logprobs),
    )


def completion_states(model: Any, packed: Packed) -> torch.Tensor:
    """The body's last hidden state before each real completion token, row by row -> [M, H].

    M = real completion tokens in the batch: padding never reaches the lm_head.
    """
    assert bool((packed.starts >= 1).all()), "every rollout needs a prompt token before its completion"
    hidden = last_hidden_states(model, packed.input_ids, packed.attention_mask)  # [B, L, H]
    # The token at position s + t is predicted by the state at s + t - 1.
    device = packed.targets.device
    positions = packed.starts[:, None] - 1 + torch.arange(packed.targets.shape[1], device=device)[None, :]  # [B, T]
    rows = torch.arange(hidden.shape[0], device=device)[:, None].expand_as(positions)  # [B, T]
    real = packed.target_mask.bool()  # [B, T]
    return hidden[rows[real], positions[real]]  # [M, H]


def token_logprobs(
    model: Any, packed: Packed, ids: torch.Tensor, *, chunk_size: int = LOGIT_CHUNK_SIZE
) -> torch.Tensor:
    """log pi(ids[b, t, j] | prompt, y_<t) at every completion state: int64 [B, T, J] -> [B, T, J], 0 where padded.

    One pass of the body, then the lm_head `chunk_size` states at a time (dualvllm.training.logprobs):
    no [B, T, V] tensor, with or without gradients.
    """
    real = packed.target_mask.bool()  # [B, T]
    _, head = body_and_head(model)
    values = selected_logprobs(completion_states(model, packed), head, ids[real], chunk=chunk_size)  # [M, J]
    return values.new_zeros((*real.shape, ids.shape[-1])).index_put((real,), values)  # [B, T, J]


def completion_logprobs(model: Any, packed: Packed, *, chunk_size: int = LOGIT_CHUNK_SIZE) -> torch.Tensor:
    """log pi(y_t | prompt, y_<t) of every completion token -> [B, T] (0 where padded)."""
    return token_logprobs(model, packed, packed.targets[..., None], chunk_size=chunk_size)[..., 0]


def enable_gradient_checkpointing(model: Any) -> None:
    """Recompute each decoder layer in backward instead of keeping its activations (transformers'
    own switch; it acts in train mode only)."""
    base = model.get_base_model() if lora.is_lora(model) else model
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # Only reentrant checkpointing needs the embeddings' output to require grad (frozen embeddings
    # under LoRA); the hook transformers adds for it would also fire in the in-process sampler.
    base.disable_input_require_grads()


@contextlib.contextmanager
def denormals_flushed() -> Iterator[None]:
    """Within the block, this thread's CPU float math flushes denormal numbers to zero; on exit
    the thread's flag is what it was (a no-op where torch cannot flush).

    A rollout whose self-normalized sequence weight is tiny (its summed log ratio some 90 nats
    below its group's best: common at 1,024 tokens) backpropagates denormal gradients, and x86
    cores take a microcode assist on every one. On 2 cores at Qwen3-0.6B's shape a micro-batch's
    backward went from ~35 s to more than 7 minutes; a [1024 x 1024] stack of 8 linear layers from
    0.21 s to 26.0 s (`python benchmarks/denormals.py`). Such gradients are below any
    float32 step that matters, so zero them. The flag is per thread (wrap the code that runs
    backward) and process-wide code reads it: left on, it broke hypothesis's float strategies
    in the caller's thread, so it is restored.
    """
    was = _flushing_denormals()
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(was)


def _flushing_denormals() -> bool:
    """Whether this thread flushes denormals now (torch has no getter: 1e-40 is a float32 denormal).
    On the CPU whatever the learner's device: the flag is the CPU's."""
    tiny, scale = torch.tensor([1e-30], device="cpu"), torch.tensor([1e-10], device="cpu")
    return float(tiny * scale) == 0.0


def _padded_rows(parts: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    """Micro-batches' [b_i, T_i, ...] values -> [sum b_i, width, ...], zero beyond each T_i."""
    return torch.cat([F.pad(p, (0, 0) * (p.dim() - 2) + (0, width - p.shape[1])) for p in parts])


@dataclass(frozen=True)
class Prepared:
    """One update's rollouts (group order) and what any micro-batch of them needs from the whole batch."""

    groups: list[Sequence[Rollout]]
    rollouts: list[Rollout]
    rewards: list[torch.Tensor]  # [G_g] per group
    packed: Packed  # every row
    chosen: torch.Tensor  # bool [B], the rows the sft/rft term trains on
    shaped: torch.Tensor | None  # bool [B], the rows taking LUFFY's shaping
    tokens: float  # real completion tokens of the batch
    chosen_tokens: float  # ... of the chosen rows
    reward_rows: torch.Tensor  # bool [B], the rows the reward term trains on (all but adaptive's guided ones)
    reward_tokens: float  # ... their real tokens
    distill_rows: torch.Tensor  # bool [B], the rows the distillation term trains on (all but adaptive's on-policy)
    distill_tokens: float  # ... their real tokens


class Learner:
    """Holds the model being trained, its optimizer and the frozen reference.

    `micro_batch_size`: rollouts per forward and backward pass, their gradients accumulated
    (None: the whole batch in one pass). `gradient_checkpointing`: recompute each decoder
    layer in backward instead of keeping its activations. `logit_chunk_size`: completion
    positions per lm_head chunk (dualvllm.training.logprobs).

    Everything runs on the model's device: the batches are packed there and the reference is
    a copy there. `autocast_dtype` (dualvllm.training.device.autocast_dtype; None: float32):
    the forward passes run under autocast in it, while the weights, their gradients and
    AdamW's state stay float32; under float16 the loss is scaled (torch.amp.GradScaler) so
    that small gradients do not underflow.

    `data_parallel` (training/data_parallel.py; None: this process alone): this rank runs its
    share of the micro-batches and `train_step` sums the ranks' gradients, so that every rank
    takes the whole batch's step.

    The model is in train mode only during an update: between updates an in-process engine
    (dualvllm.training.inprocess) samples the same weights with a KV cache, which transformers'
    checkpointed layers drop in train mode.
    """

    def __init__(
        self,
        model: Any,
        *,
        learning_rate: float,
        kl_coef: float,
        pad_id: int,
        micro_batch_size: int | None = None,
        gradient_checkpointing: bool = False,
        logit_chunk_size: int = LOGIT_CHUNK_SIZE,
        weight_decay: float = 0.0,
        autocast_dtype: torch.dtype | None = None,
        data_parallel: DataParallel | None = None,
    ) -> None:
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ValueError(
                f"micro_batch_size must be at least 1 rollout (None: the whole batch), got {micro_batch_size}"
            )
        if logit_chunk_size < 1:
            raise ValueError(f"logit_chunk_size must be at least 1 position, got {logit_chunk_size}")
        self.model = model.eval()
        self.device: torch.device = next(model.parameters()).device
        self.autocast_dtype = autocast_dtype
        self._scaler = torch.amp.GradScaler(self.device.type, enabled=autocast_dtype == torch.float16)
        # Only what trains: with LoRA the base weights are frozen.
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=learning_rate, weight_decay=weight_decay
        )
        self.reference = copy.deepcopy(model).eval().requires_grad_(False) if kl_coef > 0 else None
        if gradient_checkpointing:
            enable_gradient_checkpointing(self.model)
        self.kl_coef = kl_coef
        self.pad_id = pad_id
        self.micro_batch_size = micro_batch_size
        self.logit_chunk_size = logit_chunk_size
        self.data_parallel = data_parallel

    def train_step(self, batch: ScoredBatch, objective: Objective) -> dict[str, float]:
        started = time.perf_counter()
        self.optimizer.zero_grad()
        metrics = self.accumulate_gradients(batch, objective)
        if self.data_parallel is not None:  # every rank's share summed: the whole batch's gradient on each
            self.data_parallel.sum_gradients([p for p in self.model.parameters() if p.requires_grad])
        self._scaler.unscale_(self.optimizer)  # the clip reads the true gradients (a no-op but under float16)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self._scaler.step(self.optimizer)  # skipped when float16 overflowed; the scale then shrinks
        self._scaler.update()
        return {
            **metrics,
            "grad_norm": float(grad_norm),
            "train_tokens_per_s": metrics["train_tokens"] / (time.perf_counter() - started),
        }

    def loss(self, batch: ScoredBatch, objective: Objective) -> tuple[torch.Tensor, dict[str, float]]:
        """The update's loss on `batch` (with its graph, nothing stepped) and its metrics.

        The whole batch in one graph, whatever `micro_batch_size` (the lm_head still runs in
        chunks). Apart from `train_step` so that another trainer's loss can be checked against
        it (tests/unit/training/test_trl.py compares TRL's path with this one).
        """
        return self._loss(self._prepare(batch, objective), objective)

    def _loss(self, prepared: Prepared, objective: Objective) -> tuple[torch.Tensor, dict[str, float]]:
        with self._training():
            values = self._values(prepared.packed, objective)  # [B, T, J]
        return self._whole_batch(prepared, objective, values, self._reference_logprobs(prepared.packed, objective))

    def accumulate_gradients(self, batch: ScoredBatch, objective: Objective) -> dict[str, float]:
        """Add the gradient of the update's loss on `batch` to the parameters' .grad; {"loss", **metrics}.

        Micro-batch by micro-batch, each backpropagating its exact share of the whole batch's
        loss: the whole batch's normalizers (dualvllm.training.losses.normalize) and advantages. The
        "sequence" correction's advantages read every rollout's log pi_theta - log q*, so
        they come from a first pass without gradients. The metrics are computed afterwards
        on the whole batch's values, as `loss` computes them. Equal to
        `loss(batch)[0].backward()` up to float round-off (times the loss scale under float16
        autocast: `train_step` unscales). With `data_parallel`, only this rank's share of the
        micro-batches: `train_step` sums the ranks' gradients.
        """
        # Denormals cost only on the CPU's float units, and the flag is the CPU's.
        with denormals_flushed() if self.device.type == "cpu" else contextlib.nullcontext():
            return self._accumulate_gradients(batch, objective)

    def _accumulate_gradients(self, batch: ScoredBatch, objective: Objective) -> dict[str, float]:
        prepared = self._prepare(batch, objective)
        size = self.micro_batch_size or len(prepared.rollouts)
        ranks = self.data_parallel
        if ranks is None and size >= len(prepared.rollouts):
            loss, metrics = self._loss(prepared, objective)
            with self._training():  # checkpointed layers recompute in backward in the mode they ran in
                self._scaler.scale(loss).backward()
            return {"loss": float(loss.detach()), **metrics}
        if ranks is not None:  # data parallel: at least one micro-batch per rank where the batch allows
            size = min(size, -(-len(prepared.rollouts) // ranks.ranks.world_size))
        slices = [slice(start, start + size) for start in range(0, len(prepared.rollouts), size)]
        # Data parallel: each rank's micro-batches (one process: all), this rank's, and each rank's rows.
        shares = ranks.shares(len(slices)) if ranks is not None else [range(len(slices))]
        mine = [slices[i] for i in shares[ranks.ranks.rank if ranks is not None else 0]]
        counts = [sum(len(prepared.rollouts[slices[i]]) for i in share) for share in shares]
        advantages = None
        if objective.policy_gradient:
            first = None
            if self._advantages_need_logprobs(objective):
                first = self._gathered(self._first_pass_logprobs(prepared, mine), counts)
            advantages, _ = self._advantages(prepared, objective, first)
        values: list[torch.Tensor] = []
        references: list[torch.Tensor] = []  # none when there is no reference model, one per micro-batch else
        started = time.perf_counter()
        for done, rows in enumerate(mine, 1):
            packed = pack(prepared.rollouts[rows], self.pad_id, device=self.device)
            reference = self._reference_logprobs(packed, objective)
            with self._training():
                part = self._values(packed, objective)  # [b, T_b, J]
                share, _ = self._terms(
                    objective, prepared, packed, part, reference, None if advantages is None else advantages[rows], rows
                )
                if share.requires_grad:  # rows without real tokens add nothing
                    self._scaler.scale(share).backward()
            values.append(part.detach())
            if reference is not None:
                references.append(reference)
            log.debug("gradient pass: micro-batch %d/%d, %.1f s", done, len(mine), time.perf_counter() - started)
        width, teacher_ids = prepared.packed.targets.shape[1], prepared.packed.teacher_ids
        columns = 1 + (teacher_ids.shape[-1] if teacher_ids is not None and objective.distill_coef > 0 else 0)
        reference = None
        if self.reference is not None and objective.policy_gradient:
            reference = self._gathered(self._rows(references, width), counts)
        gathered = self._gathered(self._rows(values, width, columns), counts)
        with torch.no_grad():
            loss, metrics = self._whole_batch(prepared, objective, gathered, reference)
        return {"loss": float(loss), **metrics}

    def _rows(self, parts: Sequence[torch.Tensor], width: int, *columns: int) -> torch.Tensor:
        """`_padded_rows`, and float32 [0, width, *columns] for none (a data-parallel rank without micro-batches)."""
        return _padded_rows(parts, width) if parts else torch.zeros((0, width, *columns), device=self.device)

    def _gathered(self, part: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """Data parallel: every rank's rows of a per-row value, in row order; in one process, `part`."""
        return part if self.data_parallel is None else self.data_parallel.gather_rows(part, counts)

    def _autocast(self) -> contextlib.AbstractContextManager[None]:
        """The forward passes' precision (backward runs outside it, as torch.autocast asks; checkpointed
        layers and logit chunks recompute under the autocast state they first ran in)."""
        return autocast(self.device, self.autocast_dtype)

    @contextlib.contextmanager
    def _training(self) -> Iterator[None]:
        self.model.train()
        try:
            yield
        finally:
            self.model.eval()

    def _prepare(self, batch: ScoredBatch, objective: Objective) -> Prepared:
        groups: list[Sequence[Rollout]] = [g for g in batch.groups if len(g) >= objective.min_group]
        rewards = [torch.tensor([r.reward for r in g], device=self.device) for g in groups]
        rollouts = [r for g in groups for r in g]
        packed = pack(rollouts, self.pad_id, device=self.device)
        if objective.distill_coef > 0 and (packed.teacher_ids is None or packed.teacher_logprobs is None):
            raise ValueError(
                "the distillation term needs the teacher's top-k of every rollout; sample with record_topk"
            )
        all_rewards = torch.cat(rewards)
        chosen = torch.ones_like(all_rewards, dtype=torch.bool)
        if objective.method == "rft":
            chosen = all_rewards >= objective.rft_min_reward
        mask = packed.target_mask
        shaped = (
            torch.tensor([not r.on_policy for r in rollouts], device=self.device)
            if objective.shaping_gamma is not None
            else None
        )
        on_policy = torch.tensor([r.on_policy for r in rollouts], dtype=torch.bool, device=self.device)
        reward_rows = on_policy if objective.split_rows else torch.ones_like(on_policy)
        distill_rows = ~on_policy if objective.split_rows else torch.ones_like(on_policy)
        return Prepared(
            groups,
            rollouts,
            rewards,
            packed,
            chosen,
            shaped,
            float(mask.sum()),
            float((mask * chosen[:, None]).sum()),
            reward_rows,
            float((mask * reward_rows[:, None]).sum()),
            distill_rows,
            float((mask * distill_rows[:, None]).sum()),
        )

    def _values(self, packed: Packed, objective: Objective) -> torch.Tensor:
        """log pi_theta of the sampled token, then at the teacher's top-k ids when distilling -> [B, T, 1 (+ K)]."""
        ids = packed.targets[..., None]  # [B, T, 1]
        if objective.distill_coef > 0:
            assert packed.teacher_ids is not None, "checked by _prepare"
            ids = torch.cat([ids, packed.teacher_ids], dim=-1)  # [B, T, 1 + K]
        with self._autocast():
            return token_logprobs(self.model, packed, ids, chunk_size=self.logit_chunk_size)

    def _reference_logprobs(self, packed: Packed, objective: Objective) -> torch.Tensor | None:
        if self.reference is None or not objective.policy_gradient:
            return None
        with torch.no_grad(), self._autocast():
            return completion_logprobs(self.reference, packed, chunk_size=self.logit_chunk_size)  # [B, T]

    @staticmethod
    def _advantages_need_logprobs(objective: Objective) -> bool:
        """Only the "sequence" correction's advantages depend on log pi_theta (dualvllm.training.losses.advantages)."""
        return objective.method in ("grpo", "adaptive") and objective.correction == "sequence"

    def _first_pass_logprobs(self, prepared: Prepared, slices: Sequence[slice]) -> torch.Tensor:
        """log pi_theta of every completion token, micro-batch by micro-batch, without gradients -> [B, T]."""
        parts, started = [], time.perf_counter()
        with torch.no_grad(), self._autocast():
            for done, rows in enumerate(slices, 1):
                packed = pack(prepared.rollouts[rows], self.pad_id, device=self.device)
                parts.append(completion_logprobs(self.model, packed, chunk_size=self.logit_chunk_size))
                log.debug(
                    "pass without gradients: micro-batch %d/%d, %.1f s",
                    done,
                    len(slices),
                    time.perf_counter() - started,
                )
        return self._rows(parts, prepared.packed.targets.shape[1])

    def _advantages(
        self, prepared: Prepared, objective: Objective, logp: torch.Tensor | None
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Per-rollout advantages [B] and their metrics; `logp` [B, T] detached (None: only when the
        correction does not read it, and then the metrics that do read it are wrong)."""
        packed = prepared.packed
        if logp is None:
            assert not self._advantages_need_logprobs(objective), "the sequence correction needs log pi_theta"
            log_ratio = torch.zeros(len(prepared.rollouts), device=self.device)
        else:
            log_ratio = ((logp - packed.logp_behaviour.float()) * packed.target_mask).sum(-1)  # [B]
        correction: Correction = objective.correction if objective.method in ("grpo", "adaptive") else "none"
        rewards, ratios = prepared.rewards, list(torch.split(log_ratio, [len(g) for g in prepared.groups]))
        compared = [torch.ones_like(r, dtype=torch.bool) for r in rewards]  # [G_g] per group: the rows compared
        if objective.split_rows:  # a group's on-policy members among themselves, when there are two or more
            compared = [
                m if int(m.sum()) >= 2 else torch.zeros_like(m)
                for m in torch.split(prepared.reward_rows, [len(g) for g in prepared.groups])
            ]
        kept = [i for i, m in enumerate(compared) if m.any()]
        advantages = torch.zeros(len(prepared.rollouts), device=self.device)
        metrics: dict[str, float] = {}
        if kept:
            values, metrics = group_advantages(
                [rewards[i][compared[i]] for i in kept],
                [ratios[i][compared[i]] for i in kept],
                correction=correction,
                scale=objective.scale_advantages,
                share_cap=objective.share_cap,
            )
            advantages[torch.cat(compared)] = values.to(advantages.dtype)
        if objective.method == "opd":  # the teacher's advantages alone
            advantages = torch.zeros_like(advantages)
        return advantages, metrics

    def _whole_batch(
        self, prepared: Prepared, objective: Objective, values: torch.Tensor, reference: torch.Tensor | None
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss of the whole batch from its values [B, T, J] (with or without a graph) and the update's metrics."""
        mask = prepared.packed.target_mask
        logp = values[..., 0]  # [B, T]
        advantages: torch.Tensor | None = None
        metrics: dict[str, float] = {}
        if objective.policy_gradient:
            advantages, metrics = self._advantages(prepared, objective, logp.detach())
        loss, term_metrics = self._terms(
            objective, prepared, prepared.packed, values, reference, advantages, slice(None)
        )
        metrics.update(term_metrics)
        with torch.no_grad():
            entropy_proxy = -(logp * mask).sum() / mask.sum()
            if bool(prepared.packed.logp_teacher.any()):  # how far the learner is from the teacher on its tokens
                metrics["teacher_log_ratio"] = float(
                    normalize((logp - prepared.packed.logp_teacher.float()), mask, "dapo")
                )
        all_rewards = torch.cat(prepared.rewards)
        return loss, {
            "reward_mean": float(all_rewards.mean()),
            "reward_std": float(all_rewards.std()) if len(all_rewards) > 1 else 0.0,
            "accuracy": float((all_rewards >= 1.0).float().mean()),
            # Groups whose rollouts all scored alike: no advantage, so no learning signal from them.
            "zero_advantage_groups": sum(bool((r == r[0]).all()) for r in prepared.rewards) / len(prepared.rewards),
            "neg_logp_per_token": float(entropy_proxy),
            "train_tokens": prepared.tokens,
            **metrics,
        }

    def _terms(
        self,
        objective: Objective,
        prepared: Prepared,
        packed: Packed,
        values: torch.Tensor,
        reference: torch.Tensor | None,
        advantages: torch.Tensor | None,
        rows: slice,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss of rows `rows` of the batch (all, or one micro-batch packed as `packed`), normalized by the
        whole batch, and these rows' metrics. `values` [b, T, J] (`_values`), `advantages` [b]."""
        mask = packed.target_mask  # [b, T]
        logp = values[..., 0]  # [b, T]
        loss = values.new_zeros(())  # float32 on the model's device, as every term
        metrics: dict[str, float] = {}
        if objective.policy_gradient:
            assert advantages is not None, "policy-gradient methods need the advantages"
            term, metrics = self._policy_gradient(objective, prepared, packed, logp, reference, advantages, rows)
            loss = loss + term
        elif objective.method in ("sft", "rft"):
            chosen = prepared.chosen[rows]
            loss = loss + sft_loss(logp, mask, chosen, batch_tokens=prepared.chosen_tokens)
            metrics["sft_rollouts"] = float(chosen.float().mean())
        if objective.distill_coef > 0:
            assert packed.teacher_logprobs is not None, "checked by _prepare"
            divergence = topk_divergence(
                values[..., 1:], packed.teacher_logprobs, beta=objective.distill_beta
            )  # [b, T]
            distill = normalize(
                divergence, mask * prepared.distill_rows[rows][:, None], "dapo", batch_tokens=prepared.distill_tokens
            )
            loss = loss + objective.distill_coef * distill
            metrics["distill_divergence"] = float(distill.detach())
        return loss, metrics

    def _policy_gradient(
        self,
        objective: Objective,
        prepared: Prepared,
        packed: Packed,
        logp: torch.Tensor,
        reference: torch.Tensor | None,
        advantages: torch.Tensor,
        rows: slice,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """GRPO's reward term (none under opd) with the teacher's per-token advantages and LUFFY's shaping."""
        token_advantages = None
        if objective.teacher_advantage_coef > 0:
            token_advantages = (
                teacher_advantages(logp, packed.logp_teacher.float(), objective.teacher_advantage_coef)
                * packed.target_mask
            )
        return policy_loss(
            logp,
            packed.logp_behaviour.float(),
            advantages.float(),
            packed.target_mask * prepared.reward_rows[rows][:, None],
            correction=objective.correction if objective.method in ("grpo", "adaptive") else "none",
            is_cap=objective.is_cap,
            normalization=objective.normalization,
            max_completion_length=objective.max_completion_length,
            logp_reference=reference,
            kl_coef=self.kl_coef,
            token_advantages=token_advantages,
            shaped=None if prepared.shaped is None else prepared.shaped[rows],
            shaping_gamma=objective.shaping_gamma or 0.1,
            batch_rows=max(int(prepared.reward_rows.sum()), 1),
            batch_tokens=prepared.reward_tokens,
        )
