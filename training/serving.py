"""The servers a training or evaluation run samples from, and the coordinator over them.

Which weights each server holds, by `--teacher`:

    a model directory   two servers: the base (start_dir; the weights pushed during training)
                        and that teacher
    self                one server: the base, sent the teacher's prompts too, so the teacher
                        is always the current policy shown privileged information
    self-frozen         two servers: the base, and the starting base weights as the teacher
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from collections.abc import AsyncIterator, Sequence

from dualvllm import tinymodels
from dualvllm.coordinator import CoordinatorConfig, DualVLLMCoordinator
from dualvllm.engines.launcher import VLLMServer, launch_replicas, replica_configs
from dualvllm.training.task_config import TaskConfig

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
    return CoordinatorConfig(
        **{
            "max_batch_size": batch,
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
    base_dir = config.base or str(tinymodels.BASE_DIR)
    teacher = base_dir if config.teacher == "self-frozen" else config.teacher
    bundled = {"dtype": tinymodels.SERVER_DTYPE} if config.base is None else {}  # start_dir is a copy of it
    pairs = replica_configs(
        start_dir,
        None if teacher == "self" else teacher,
        replicas=config.replicas,
        log_dir=log_dir,
        dev_mode=dev_mode,
        max_logprobs=max(config.top_k, 20),
        lockstep=config.lockstep,
        **bundled,
    )
    if teacher == "self":  # one server plays both roles
        base = await stack.enter_async_context(VLLMServer(pairs[0][0], name="theta"))
        return [base.url], [base.url]
    servers = await stack.enter_async_context(launch_replicas(pairs))
    return [theta.url for theta, _ in servers], [t.url for _, t in servers]
