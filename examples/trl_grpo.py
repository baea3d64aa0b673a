"""q*-GRPO through TRL on the bundled arithmetic task, on one process or several (accelerate).

    dualvllm serve --servers-only --dev-mode --lockstep     # prints: export DUALVLLM_THETA_URL=... DUALVLLM_T_URL=...
    python examples/trl_grpo.py --max-steps 3 --output-dir runs/trl                        # one process
    accelerate launch --multi_gpu --num_processes 2 examples/trl_grpo.py --max-steps 3 --output-dir runs/trl-ddp

Every process samples its own share of each step's prompts through its own QStarRollouts
(one coordinator over the same servers) and trains with QStarGRPOTrainer; DDP averages the
gradients. After each optimizer step the main process pushes the weights into the base server
and verifies them (QStarWeightSync); the others wait at a barrier.

Without GPUs `--multi_gpu` is what starts several processes: accelerate 1.15 launches them
through torchrun, and this script's `use_cpu=True` makes accelerate run DDP over gloo. (`accelerate
launch --cpu --num_processes 2` starts one process: accelerate's CPU launcher spreads processes
only through mpirun with `--mpirun_hostfile`.) On GPUs pass `--gpu` here and pick the distributed
setup with `accelerate config` (FSDP: the push gathers the full state dict with
accelerator.get_state_dict).

Each process writes OUTPUT/rank-<i>.json: the prompts it sampled, how many rollouts and
the reports of the pushes it made; the main process adds the trainer's log history
(reward, loss and the push's metrics per step: push/digest_verified, and push/max_abs_diff where
a probe ran).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import warnings
from pathlib import Path
from typing import Any

from dualvllm import tinymodels
from dualvllm.coordinator import CoordinatorConfig
from dualvllm.training.data import BUNDLED_TRAIN
from dualvllm.training.rewards import reward_exact
from dualvllm.training.trl_rollouts import QStarRollouts
from dualvllm.training.trl_sync import QStarWeightSync
from dualvllm.training.trl_trainer import CORRECTIONS, QStarGRPOConfig, QStarGRPOTrainer


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", type=Path, required=True, help="Where the run's files go.")
    parser.add_argument("--theta-url", help="The base server (dev mode); default: DUALVLLM_THETA_URL.")
    parser.add_argument("--t-url", help="The teacher server; default: DUALVLLM_T_URL.")
    parser.add_argument("--mode", choices=("auto", "lockstep", "per_token"), default="auto",
                        help="The coordinator's mode (CoordinatorConfig.mode).")
    parser.add_argument("--max-steps", type=int, default=3, help="Optimizer steps.")
    parser.add_argument("--prompts", type=int, default=64, help="Rows of the bundled training set to train on.")
    parser.add_argument("--batch-size", type=int, default=8, help="Rollouts per process per step.")
    parser.add_argument("--num-generations", type=int, default=4, help="Rollouts per prompt (the group).")
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--correction", choices=CORRECTIONS, default="none", help="QStarGRPOConfig.correction.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gpu", action="store_true", help="Train on the GPUs accelerate gives each process.")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    from datasets import Dataset
    from transformers import AutoTokenizer

    rows = [json.loads(line) for line in BUNDLED_TRAIN.read_text().splitlines()[:args.prompts]]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    config = QStarGRPOConfig(
        output_dir=str(args.output_dir), per_device_train_batch_size=args.batch_size,
        num_generations=args.num_generations, max_completion_length=5, max_steps=args.max_steps,
        learning_rate=args.learning_rate, correction=args.correction, temperature=1.0, seed=args.seed,
        use_cpu=not args.gpu, bf16=False, logging_steps=1, save_strategy="no", report_to=[])
    urls = {k: v for k, v in (("theta_url", args.theta_url), ("t_url", args.t_url)) if v}
    sampled: list[str] = []

    def rollout(prompts: list[Any], trainer: Any) -> dict[str, list]:
        sampled.extend(prompts)
        return rollouts(prompts, trainer)

    with QStarRollouts(CoordinatorConfig(top_k=20, mode=args.mode, **urls), seed=args.seed) as rollouts:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TRL warns that rollout_func is experimental
            trainer = QStarGRPOTrainer(model=str(tinymodels.BASE_DIR), reward_funcs=reward_exact, args=config,
                                       train_dataset=dataset, rollout_func=rollout,
                                       processing_class=AutoTokenizer.from_pretrained(tinymodels.BASE_DIR))
        sync = QStarWeightSync(trainer, rollouts, sync_every=1)
        trainer.add_callback(sync)
        trainer.train()
        mode = rollouts.coordinator.mode
    accelerator = trainer.accelerator
    summary: dict[str, Any] = {"rank": accelerator.process_index, "world_size": accelerator.num_processes,
                               "distributed_type": str(accelerator.distributed_type),
                               "backend": accelerator.state.backend,
                               "wrapped_model": type(trainer.model_wrapped).__name__,
                               "weights_sha256": _weights_digest(trainer.accelerator.unwrap_model(trainer.model)),
                               "mode": mode, "rollouts": len(sampled), "prompts_sampled": sorted(set(sampled)),
                               # the pushes this process made: the main process's only
                               "pushes": [{"path": str(r.path), "max_abs_diff": r.max_abs_diff,
                                           "verified_by": r.verified_by, "digest": r.digest,
                                           "replicas": r.replicas} for r in sync.reports]}
    if accelerator.is_main_process:
        summary["log_history"] = trainer.state.log_history
    out = args.output_dir / f"rank-{accelerator.process_index}.json"
    out.write_text(json.dumps(summary, indent=1))
    print(f"rank {accelerator.process_index}: {len(sampled)} rollouts of {len(set(sampled))} prompts -> {out}")


def _weights_digest(model: Any) -> str:
    """A digest of every weight: equal on every process if DDP kept the replicas in step."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


if __name__ == "__main__":
    main()
