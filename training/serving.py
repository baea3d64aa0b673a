"""The servers a training or evaluation run samples from, and the coordinator over them.

Which weights each server holds, by `--teacher`:

    a model directory   two servers: the base (start_dir; the weights pushed during training)
                        and that teacher
    self                one server: the base, sent the teacher's prompts too, so the teacher
                        is always the current policy shown privileged information
    self-frozen         two servers: the base, and the starting base weights as the teacher

Where each server runs (GPUs, tensor parallelism, memory, the start order) is the plan of
engines/placement.py over the run's ServerOptions (TaskConfig inherits them); a training run's
learner GPU (`--learner-device`) is never given to a server. `describe_run` prints that plan for
`--dry-run` without starting anything.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING
from pathlib import Path
from collections.abc import AsyncIterator, Sequence

from dualvllm import tinymodels
from dualvllm.coordinator import CoordinatorConfig, DualVLLMCoordinator
from dualvllm.common.errors import InvalidInputError
from dualvllm.engines import placement
from dualvllm.engines.dry_run import describe_servers
from dualvllm.engines.vllm_admin import NCCL_BACKEND
from dualvllm.engines.launcher import (
    ServerConfig,
    VLLMServer,
    launch_replicas,
    replica_configs,
    server_names,
    visible_gpus,
    with_ports,
)
from dualvllm.training.task_config import TaskConfig

if TYPE_CHECKING:
    import torch

    from dualvllm.training.config import TrainConfig

# The batch a run's coordinator gets unless its config sets one: the run's batch, at least this.
MIN_BATCH = 64


def coordinator_config(config: TaskConfig, *, batch_size: int, **run_owned: object) -> CoordinatorConfig:
    """The run's coordinator: the options its config sets (`config.coordinator`, DUALVLLM_*
    variables for the rest), with what the run owns set by the run: top_k and seed from its
    own options, and `run_owned` (its servers' URLs, or the in-process mode). The batch is
    the run's (`batch_size`, at least MIN_BATCH) unless the config sets it; one per-token
    request carries every active sequence, so it is at most what a request may carry."""
    coordinator = config.coordinator
    batch = min(max(MIN_BATCH, batch_size), coordinator.max_prompts_per_request)
    # --lockstep / --no-lockstep decide the decoding mode on running servers too (--theta-urls),
    # which `auto` would otherwise choose by whether they carry the plugin.
    chosen = {"mode": "lockstep" if config.lockstep else "per_token"} if "lockstep" in config.model_fields_set else {}
    return CoordinatorConfig(
        **{
            "max_batch_size": batch,
            **chosen,
            **coordinator.model_dump(include=coordinator.model_fields_set),
            "top_k": config.top_k,
            "seed": config.seed,
            **run_owned,
        }
    )


@contextlib.asynccontextmanager
async def serving(
    config: TaskConfig, start_dir: str, *, log_dir: Path | None = None, dev_mode: bool = False, batch_size: int = 64
) -> AsyncIterator[DualVLLMCoordinator]:
    """A coordinator over the servers of `config`: those it names (--theta-urls, --t-urls), or
    `config.replicas` pairs started here, pooled per role.

    Started base servers serve `start_dir` (the base, or a checkpoint when resuming), in dev
    mode for weight pushes when asked (loopback only). `batch_size` is the run's batch, the
    coordinator's unless the config's coordinator options set one (`coordinator_config`).
    The base role's engine, for pushes, is `coordinator.base_engine`.
    """
    async with contextlib.AsyncExitStack() as stack:
        theta_urls: Sequence[str]  # the config's tuples, or the lists of the servers started here
        t_urls: Sequence[str]
        if config.theta_urls:
            theta_urls, t_urls = config.theta_urls, config.t_urls or config.theta_urls
        else:
            theta_urls, t_urls = await _start_servers(stack, config, start_dir, log_dir=log_dir, dev_mode=dev_mode)
        run = coordinator_config(config, batch_size=batch_size, theta_urls=theta_urls, t_urls=t_urls)
        yield await stack.enter_async_context(DualVLLMCoordinator(run))


async def _start_servers(
    stack: contextlib.AsyncExitStack, config: TaskConfig, start_dir: str, *, log_dir: Path | None, dev_mode: bool
) -> tuple[list[str], list[str]]:
    """Start the run's servers (stopped when `stack` closes) -> (base URLs, teacher URLs)."""
    pairs = server_configs(config, start_dir, log_dir=log_dir, dev_mode=dev_mode)
    if config.teacher == "self":  # one server plays both roles
        base = await stack.enter_async_context(VLLMServer(pairs[0][0], name="theta"))
        return [base.url], [base.url]
    servers = await stack.enter_async_context(launch_replicas(pairs))
    return [theta.url for theta, _ in servers], [t.url for _, t in servers]


def server_configs(
    config: TaskConfig, start_dir: str, *, log_dir: Path | None, dev_mode: bool, plan_gpus: int | None = None
) -> list[tuple[ServerConfig, ServerConfig]]:
    """The (base, teacher) configs of the servers the run starts, placed and with their ports chosen.
    With `--teacher self` only the first base is started. `plan_gpus`: plan for that many GPUs (a dry run)."""
    base_dir = config.base or str(tinymodels.BASE_DIR)
    teacher = base_dir if config.teacher == "self-frozen" else config.teacher
    bundled = {"dtype": tinymodels.SERVER_DTYPE} if config.base is None else {}  # start_dir is a copy of it
    plan = run_plan(config, plan_gpus=plan_gpus)
    pushes = {"weight_transfer": NCCL_BACKEND} if dev_mode and _pushes_over_nccl(config, plan, plan_gpus) else {}
    pairs = replica_configs(
        start_dir,
        None if teacher == "self" else teacher,
        replicas=config.replicas,
        log_dir=log_dir,
        dev_mode=dev_mode,
        plan=plan,
        max_logprobs=max(config.top_k, 20),
        lockstep=config.lockstep,
        **{**bundled, **config.server_fields(), **pushes},
    )
    return with_ports(pairs)


def _pushes_over_nccl(config: TaskConfig, plan: placement.Plan, plan_gpus: int | None) -> bool:
    """Whether the base servers a training run starts load vLLM's NCCL engine (else dualvllm's
    shared-memory one): when the learner is on a GPU, the servers are too, and pushes may go in
    memory. The weights then go GPU to GPU in one broadcast to every replica (training/nccl_push.py)
    instead of through host memory; BasePusher picks NCCL from the servers' own /server_info."""
    from dualvllm.training.config import TrainConfig

    if not isinstance(config, TrainConfig) or config.weights_via == "disk" or not plan.on_gpus:
        return False
    device = _learner(config, plan_gpus)
    return device is not None and device.type == "cuda"


def run_plan(config: TaskConfig, *, plan_gpus: int | None = None) -> placement.Plan:
    """Where the run's servers go (engines/placement.py): on this machine's GPUs (none on the CPU
    build), or on `plan_gpus` GPUs numbered 0..N-1 for a dry run; a training run's learner GPUs are
    kept for the learner."""
    visible = tuple(range(plan_gpus)) if plan_gpus is not None else visible_gpus()
    learner = learner_gpus(config, plan_gpus=plan_gpus) if visible is not None else ()
    return placement.plan(
        config, replicas=config.replicas, visible=visible, learner_gpus=learner, teacher=config.teacher != "self"
    )


def learner_gpus(config: TaskConfig, *, plan_gpus: int | None = None) -> tuple[int, ...]:
    """The host numbers of a training run's learner GPUs, one per learner process (none: no learner,
    or not on a GPU).

    torch numbers the GPUs it sees from 0; under CUDA_VISIBLE_DEVICES, cuda:N is its N-th entry.
    With `plan_gpus` (a dry run for another machine) the plan's GPUs are numbered 0..N-1."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    indices = [d.index or 0 for d in _learner_devices(config, plan_gpus) if d.type == "cuda"]
    hosts = indices if plan_gpus is not None else [placement.host_gpu(i, visible) for i in indices]
    return tuple(h for h in hosts if h is not None)  # None: a GPU named by UUID, whose number is unknown


def _learner_devices(config: TaskConfig, plan_gpus: int | None) -> tuple[torch.device, ...]:
    """A training run's learner device, or under `accelerate launch --num_processes N` (training/data_parallel.py)
    each of this node's learner processes' devices: cuda:0..N-1 (on the CPU, the CPU N times)."""
    import torch

    from dualvllm.training.config import TrainConfig
    from dualvllm.training.data_parallel import Ranks, refuse_numbered_gpu

    device = _learner(config, plan_gpus)
    ranks = Ranks.from_environment()
    if device is None or ranks is None:
        return () if device is None else (device,)
    if device.type != "cuda":
        return (device,) * ranks.local_world_size
    assert isinstance(config, TrainConfig), "a learner is a training run's"
    refuse_numbered_gpu(config.learner_device, ranks.world_size)
    if plan_gpus is not None and ranks.local_world_size > plan_gpus:
        raise InvalidInputError(
            f"{ranks.local_world_size} learner processes on this node need as many GPUs, and the plan has "
            f"{plan_gpus} (--plan-gpus)"
        )
    return tuple(torch.device("cuda", rank) for rank in range(ranks.local_world_size))


def _learner(config: TaskConfig, plan_gpus: int | None) -> torch.device | None:
    """A training run's learner device (None for an evaluation). For a plan (`plan_gpus`),
    `--learner-device` as written (default: cuda:0 when the plan has GPUs), without asking torch
    whether the GPU is there."""
    from dualvllm.training.config import TrainConfig
    from dualvllm.training.device import device_of, learner_device

    if not isinstance(config, TrainConfig):
        return None
    if plan_gpus is None:
        return learner_device(config.learner_device)
    device = device_of(config.learner_device or ("cuda:0" if plan_gpus else "cpu"))
    if device.type == "cuda" and (device.index or 0) >= plan_gpus:
        raise InvalidInputError(f"--learner-device {device}: the plan has {plan_gpus} GPU(s) (--plan-gpus)")
    return device


def describe_run(config: TaskConfig, *, plan_gpus: int | None = None) -> str:
    """`train --dry-run` / `eval --dry-run`: the servers the run would start (engines/dry_run.py), or
    why it starts none, and a training run's learner. Starts nothing and loads no model."""
    from dualvllm.training.config import TrainConfig

    run = config if isinstance(config, TrainConfig) else None  # None: an evaluation, without a learner
    lines = []
    if run is not None and run.engine == "transformers":
        lines.append("--engine transformers: no server is started; the base and the teacher run in this process")
    elif config.theta_urls:
        lines.append(
            f"no server is started: the run samples from --theta-urls {' '.join(config.theta_urls)}"
            + (f" and --t-urls {' '.join(config.t_urls)}" if config.t_urls else "")
        )
    else:
        log_dir = run.output_dir if run is not None else None
        dev_mode = run is not None and run.method != "dpo"  # as grpo.py and dpo.py start them
        pairs = server_configs(
            config, config.base or str(tinymodels.BASE_DIR), log_dir=log_dir, dev_mode=dev_mode, plan_gpus=plan_gpus
        )
        named = server_names(pairs)
        lines.append(describe_servers(named[:1] if config.teacher == "self" else named))
        if run is not None and run.method == "dpo":
            lines.append(
                f"then, after training, the same servers on the trained model (logs in {log_dir}/final-servers)"
            )
    if run is not None:
        lines.append(_learner_line(run, plan_gpus))
    return "\n".join(lines)


def _learner_line(config: TrainConfig, plan_gpus: int | None) -> str:
    from dualvllm.training.device import autocast_dtype

    device = _learner(config, plan_gpus)
    assert device is not None, "a training run has a learner"
    precision: str = config.mixed_precision
    if plan_gpus is None:  # what autocast resolves to on this machine
        dtype = autocast_dtype(device, config.mixed_precision)
        computed = "float32" if dtype is None else f"{str(dtype).removeprefix('torch.')} autocast over float32 weights"
        precision += f" ({computed})"
    hosts = learner_gpus(config, plan_gpus=plan_gpus)
    devices = _learner_devices(config, plan_gpus)
    if len(devices) == 1:
        where = f" (GPU {hosts[0]} of the host)" if hosts else ""
        return f"learner: {device}{where}, mixed precision {precision}"
    where = f" (GPUs {','.join(map(str, hosts))} of the host)" if hosts else ""
    named = ", ".join(dict.fromkeys(str(d) for d in devices))
    return f"learner: {len(devices)} processes on {named}{where}, mixed precision {precision}"
