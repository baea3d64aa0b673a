"""TRL's stock GRPOTrainer on q* rollouts: `dualvllm serve` stands in for `vllm serve`.

    dualvllm serve --dev-mode                      # the bundled pair; prints: q* endpoint: http://127.0.0.1:8100/v1
    python examples/trl_stock_grpo.py --url http://127.0.0.1:8100 --max-steps 4 --output-dir runs/trl-stock

Nothing here is dualvllm's but the URL: GRPOConfig(use_vllm=True, vllm_mode="server",
vllm_server_base_url=URL) and TRL does the rest, with one setting changed: its
importance-sampling correction is off. The completions it gets are samples of q*, and the
logprobs are log q* of each sampled token (the service reports logprobs_mode
"processed_logprobs"), so TRL's correction (vllm_importance_sampling_correction, on by default:
sequence_mask, cap 3) would weigh rollouts by pi_theta / q*: docs/trl.md, "TRL's importance
sampling on q* rollouts", measured that default driving the base to 0% in every seed, and the
correction off as the sound setting for stock TRL. Weight pushes go through the service's
forwarded weight-transfer routes into the base server, inside the coordinator's pause.

TRL's trainer-side weight sync runs on NCCL and refuses any device but CUDA. On a GPU
machine (`--gpu`; the base servers started with `--weight-transfer nccl`) TRL's own sync runs
unchanged; that path has not run here (no GPU). Without a GPU, `cpu_weight_sync()` replaces
TRL's two sync methods with dualvllm's shared-memory engine, driven through the same four
routes of the same service (dualvllm.training.weight_transfer): the only non-stock lines, and only on CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import warnings
from pathlib import Path
from typing import Any
from collections.abc import Iterator

from dualvllm import tinymodels
from dualvllm.training.data import BUNDLED_TRAIN
from dualvllm.training.rewards import reward_exact


@contextlib.contextmanager
def cpu_weight_sync(url: str, model_of: Any) -> Iterator[list[Any]]:
    """TRL's VLLMClient pushes on CPU within the block: `init_communicator` (NCCL) does nothing,
    and `update_named_params` sends `model_of()`'s weights through the service's four phases with
    the shared-memory engine. Yields the push reports (dualvllm.training.weight_transfer.TransferStats)."""
    from trl.generation.vllm_client import VLLMClient as TRLClient

    from dualvllm.engines.vllm_client import VLLMClient
    from dualvllm.training import weight_transfer

    pushes: list[Any] = []

    async def push() -> Any:
        async with VLLMClient(url, name="q* service") as service:
            dtype = await service.admin.served_dtype() or "float32"
            return await weight_transfer.send_weights(
                service, model_of(), dtype=dtype, weight_version=f"trl-{len(pushes)}"
            )

    def update_named_params(self: Any, metadata: Any, named_params: Any) -> None:
        pushes.append(asyncio.run(push()))

    saved = TRLClient.init_communicator, TRLClient.update_named_params
    TRLClient.init_communicator = lambda self, device=0: None  # type: ignore[method-assign]
    TRLClient.update_named_params = update_named_params  # type: ignore[method-assign]
    try:
        yield pushes
    finally:
        TRLClient.init_communicator, TRLClient.update_named_params = saved  # type: ignore[method-assign]


def train(
    url: str,
    output_dir: Path,
    *,
    max_steps: int,
    gpu: bool = False,
    rows: list[dict] | None = None,
    learning_rate: float = 1e-3,
) -> tuple[Any, list[Any]]:
    """A stock GRPOTrainer against the q* service at `url`: (the trainer, the CPU pushes made)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    rows = rows or [json.loads(line) for line in BUNDLED_TRAIN.read_text().splitlines()[:64]]

    config = GRPOConfig(
        output_dir=str(output_dir),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=5,
        max_steps=max_steps,
        learning_rate=learning_rate,
        report_to=[],
        use_cpu=not gpu,
        bf16=gpu,
        logging_steps=1,
        save_strategy="no",
        temperature=1.0,
        seed=0,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=url,  # the q* service
        # TRL's default correction (sequence_mask, cap 3) on log q* drove the base to 0% in
        # every seed; off, it learned as --correction none (docs/trl.md, "TRL's importance
        # sampling on q* rollouts": 34.0% against 0% at update 150).
        vllm_importance_sampling_correction=False,
    )
    holder: dict[str, Any] = {}
    sync = contextlib.nullcontext([]) if gpu else cpu_weight_sync(url, lambda: holder["trainer"].model)
    with sync as pushes, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL 1.16 names vLLM 0.31 as its newest tested; the pin is 0.32
        trainer = holder["trainer"] = GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(tinymodels.BASE_DIR),
            reward_funcs=reward_exact,
            args=config,
            train_dataset=Dataset.from_list(rows),
            processing_class=AutoTokenizer.from_pretrained(tinymodels.BASE_DIR),
        )
        trainer.train()
        trainer.vllm_generation.sync_weights()  # TRL pushes before each generation: once more after the last step
    return trainer, list(pushes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8100", help="the q* service (`dualvllm serve --dev-mode`)")
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--output-dir", type=Path, default=Path("runs/trl-stock"))
    parser.add_argument("--gpu", action="store_true", help="train on CUDA; TRL's own NCCL weight sync")
    args = parser.parse_args()
    trainer, pushes = train(args.url, args.output_dir, max_steps=args.max_steps, gpu=args.gpu)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    history = trainer.state.log_history
    (args.output_dir / "log_history.json").write_text(json.dumps(history, indent=1))
    for entry in history:
        if "reward" in entry:
            print(f"step {entry['step']}: reward {entry['reward']:.3f}", flush=True)
    print(f"{len(pushes)} pushes through {args.url}; log: {args.output_dir / 'log_history.json'}")


if __name__ == "__main__":
    main()
