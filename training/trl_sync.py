"""Push a TRL trainer's policy into the base servers, verified: a TrainerCallback.

    every sync_every optimizer steps (and once before the first, so the servers sample
    the trainer's weights from the start):
      every rank   accelerator.get_state_dict(model)   the full weights; a collective under
                                                       FSDP and ZeRO-3, so all ranks call it
      main only    inside coordinator.paused(): push into every base replica and verify
                   each (dualvllm.training.weight_sync.BasePusher): in memory through vLLM's
                   weight-transfer API when the servers have a weight-transfer engine,
                   else saved to a new directory and reloaded from there (`weights_via`)
      every rank   accelerator.wait_for_everyone()     no rank samples before the push is done

Each rank owns its QStarRollouts (its own coordinator over the same servers); only the
main process's pushes. Under FSDP or ZeRO-3 the main process holds only a shard, so the
push goes through the disk and the logprobs to verify against are computed from the saved
checkpoint, loaded on the CPU (one more copy of the model in memory for the length of a
push); otherwise from the live model. The push is the one `dualvllm train` makes, so its failures are the same
WeightSyncErrors and it needs the servers in dev mode (VLLM_SERVER_DEV_MODE=1, loopback).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from collections.abc import Sequence

from transformers import TrainerCallback

from dualvllm.common.errors import InvalidInputError
from dualvllm.training import lora, untie
from dualvllm.training.trl_rollouts import QStarRollouts
from dualvllm.training.weight_sync import (
    BasePusher,
    PushReport,
    WeightsVia,
    new_push_dir,
    prune_pushed,
    push_metrics,
    write_push,
)

# A push of the bundled models takes well under a second; a large model's save and reload take
# minutes, and a replica that restarts gets BasePusher's own health wait on top.
PUSH_TIMEOUT_S = 1800.0
PROBES = 4
# Closing a push group: the learner's communicator and each server's side, each bounded by the pusher.
CLOSE_TIMEOUT_S = 120.0


class QStarWeightSync(TrainerCallback):
    """Keeps the base servers on the trainer's weights: `trainer.add_callback(QStarWeightSync(trainer, rollouts))`.

    `probes` are prompt token ids to verify pushes on (default: the first `PROBES` prompts of the
    trainer's train_dataset, rendered as the rollouts render them). `reports` holds each push's
    PushReport (main process only). Pushed directories go under `push_dir` (default
    `<output_dir>/pushed`); the newest is kept. A push in memory is proved by the servers'
    digest; a logprob probe also runs at the first push and every `probe_every`-th (0: the
    first only), as `dualvllm train --push-probe-every` does.
    """

    def __init__(
        self,
        trainer: Any,
        rollouts: QStarRollouts,
        *,
        sync_every: int = 1,
        probes: Sequence[Sequence[int]] | None = None,
        push_dir: Path | None = None,
        tolerance: float | None = None,
        push_timeout_s: float = PUSH_TIMEOUT_S,
        sync_at_start: bool = True,
        weights_via: WeightsVia = "auto",
        probe_every: int = 0,
    ) -> None:
        if sync_every < 1:
            raise InvalidInputError(f"sync_every={sync_every}; push every N >= 1 optimizer steps")
        self.trainer, self.rollouts = trainer, rollouts
        self.sync_every, self.tolerance = sync_every, tolerance
        self.push_timeout_s, self.sync_at_start = push_timeout_s, sync_at_start
        self.weights_via, self.probe_every = weights_via, probe_every
        self.out = Path(push_dir) if push_dir is not None else Path(trainer.args.output_dir)
        self._probes = [list(p) for p in probes] if probes is not None else None
        self._pusher: BasePusher | None = None
        self.reports: list[PushReport] = []

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.sync_at_start:
            self.sync(state.global_step)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step % self.sync_every == 0:
            self.sync(state.global_step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """End the pushes' NCCL group, if they opened one: its servers' side waits on it otherwise."""
        if self._pusher is not None and self.trainer.accelerator.is_main_process:
            self.rollouts.run(self._pusher.close(), timeout_s=CLOSE_TIMEOUT_S, what="closing the weight-push group")

    def sync(self, step: int) -> None:
        """One push at optimizer step `step`; every rank must call it (see the module docstring)."""
        accelerator = self.trainer.accelerator
        state_dict = accelerator.get_state_dict(self.trainer.model_wrapped) if _sharded(accelerator) else None
        if accelerator.is_main_process:
            report = self._push(step, state_dict)
            self.reports.append(report)
            # GRPOTrainer averages its metric buffer into the next log line (Trainer.log would flush it early).
            metrics = getattr(self.trainer, "_metrics", {}).get("train")
            if metrics is not None:
                if report.max_abs_diff is not None:  # None: proved by digest, no probe ran
                    metrics["push/max_abs_diff"].append(report.max_abs_diff)
                # 1: the servers' digest matched the trainer's (a logged number, where verified_by is a word)
                metrics["push/digest_verified"].append(float("digest" in report.verified_by))
                metrics["push/replicas"].append(float(report.replicas))
                metrics["push/replicas_dropped"].append(float(len(report.dropped)))
                for key, value in push_metrics(report).items():
                    if isinstance(value, (int, float)):
                        metrics[key.replace("push_", "push/", 1)].append(float(value))
        accelerator.wait_for_everyone()

    def _push(self, step: int, state_dict: dict[str, Any] | None) -> PushReport:
        trainer = self.trainer
        model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
        out_dir = new_push_dir(self.out, step)
        probes = self._probe_ids()
        if state_dict is not None and lora.is_lora(model):
            raise InvalidInputError(
                "pushing a LoRA model trained under FSDP or ZeRO-3 is not supported: merge "
                "the adapter, or train without sharding"
            )
        if self._pusher is None:
            untie.refuse_tied(model, str(getattr(model, "name_or_path", "the trained model")))
            via = "disk" if state_dict is not None else self.weights_via
            if state_dict is not None and self.weights_via == "memory":
                raise InvalidInputError(
                    "weights_via='memory' needs the whole model in this process; under FSDP or "
                    "ZeRO-3 each rank holds a shard: push via the disk"
                )
            self._pusher = BasePusher(
                self.rollouts.coordinator.base_engine,
                probes,
                tolerance=self.tolerance,
                via=via,
                probe_every=self.probe_every,
            )
        if state_dict is None:  # in memory when the servers can take it (BasePusher.push)
            report = self.rollouts.run(
                self._push_live(model, out_dir),
                timeout_s=self.push_timeout_s,
                what=f"pushing the weights of step {step}",
            )
            prune_pushed(self.out)
            return report
        dtype = self.rollouts.run(
            self._pusher.served_dtype(), timeout_s=self.push_timeout_s, what="asking the base server's dtype"
        )
        # In the server's dtype, compared like with like (dualvllm.training.weight_sync.write_push); a
        # sharded model (state_dict given) is probed on a CPU copy of the checkpoint.
        expected = write_push(model, trainer.processing_class, out_dir, probes, dtype=dtype, state_dict=state_dict)
        report = self.rollouts.run(
            self._reload(out_dir, expected), timeout_s=self.push_timeout_s, what=f"pushing the weights of step {step}"
        )
        prune_pushed(self.out)
        return report

    async def _push_live(self, model: Any, out_dir: Path) -> PushReport:
        assert self._pusher is not None
        async with self.rollouts.coordinator.paused():  # lockstep sequences resume on the new weights
            return await self._pusher.push(model, self.trainer.processing_class, out_dir)

    async def _reload(self, out_dir: Path, expected: Any) -> PushReport:
        assert self._pusher is not None
        async with self.rollouts.coordinator.paused():  # lockstep sequences resume on the new weights
            return await self._pusher.push_saved(out_dir, expected)

    def _probe_ids(self) -> list[list[int]]:
        if self._probes is None:
            dataset = self.trainer.train_dataset
            prompts = [dataset[i]["prompt"] for i in range(min(PROBES, len(dataset)))]
            self._probes = self.rollouts.render(prompts, self.trainer)
        return self._probes


def _sharded(accelerator: Any) -> bool:
    """Whether each rank holds only a shard of the weights (FSDP, or DeepSpeed ZeRO stage 3)."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.FSDP:
        return True
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return accelerator.distributed_type == DistributedType.DEEPSPEED and plugin is not None and plugin.zero_stage == 3
