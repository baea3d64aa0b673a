"""What `--dry-run` prints of the servers a command would start: each one's name, model, URL (its
port, chosen at plan time), log, GPUs, the variables the launcher sets for it, its command
line, and the start order. Nothing is started, and no model is loaded.

    theta-0: models/base
      url:          http://127.0.0.1:41873
      log:          runs/a/theta-0.log
      placement:    GPUs 0,1 (tensor-parallel size 2, memory share 0.9)
      environment:  CUDA_VISIBLE_DEVICES=0,1 CUDA_DEVICE_ORDER=PCI_BUS_ID VLLM_API_KEY=<redacted> ...
      command:      .venv/bin/python -m vllm.entrypoints.openai.api_server --model models/base ...
    start order: theta-0 then t-0 (they share a GPU); theta-1 then t-1 (they share a GPU); these chains start concurrently
"""

from __future__ import annotations

import shlex

from dualvllm.engines.launcher import ServerConfig, VLLMServer
from dualvllm.engines.placement import start_chains

REDACTED = "<redacted>"
# Variables whose values are credentials: printed as REDACTED.
SECRET_VARIABLES = frozenset({"VLLM_API_KEY"})


def describe_servers(named: list[tuple[ServerConfig, str]]) -> str:
    """The report of the (config, name) servers, in start-list order, and their start order."""
    servers = [VLLMServer(config, name=name) for config, name in named]
    lines: list[str] = []
    for server in servers:
        c = server.config
        environment = server.launcher_environment()
        shown = " ".join(
            f"{key}={REDACTED if key in SECRET_VARIABLES else shlex.quote(value)}"
            for key, value in sorted(environment.items())
        )
        lines += [
            f"{server.name}: {c.model}",
            f"  url:          {server.url}",
            f"  log:          {server.log_path or f'a new temporary file (vllm-{server.name}-*.log)'}",
            f"  placement:    {_placement(server)}",
            f"  environment:  {shown}",
            f"  command:      {shlex.join(server.command())}",
        ]
    lines.append(f"start order: {start_order(servers)}")
    return "\n".join(lines)


def start_order(servers: list[VLLMServer]) -> str:
    """Which servers start one after another (those sharing a GPU), in words."""
    chains = start_chains([server.config.gpus if server.on_gpu else None for server in servers])
    if all(len(chain) == 1 for chain in chains):
        return {1: servers[0].name, 2: "both at once"}.get(len(servers), f"all {len(servers)} at once")
    words = [
        " then ".join(servers[i].name for i in chain) + (" (they share a GPU)" if len(chain) > 1 else "")
        for chain in chains
    ]
    return "; ".join(words) + ("; these chains start concurrently" if len(chains) > 1 else "")


def _placement(server: VLLMServer) -> str:
    c = server.config
    if not server.on_gpu:
        return f"CPU, cores {c.cpu_cores}" if c.cpu_cores else "CPU, cores unbound"
    if c.gpus is None:
        gpus = "every GPU this process sees"
    else:
        gpus = ("GPU " if len(c.gpus) == 1 else "GPUs ") + ",".join(str(gpu) for gpu in c.gpus)
    return f"{gpus} (tensor-parallel size {c.tensor_parallel_size}, memory share {c.gpu_memory_utilization:g})"
