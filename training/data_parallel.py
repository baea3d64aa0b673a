"""Several learner processes, one update: data parallelism over torch.distributed (issue 55).

    accelerate launch --num_processes N -m dualvllm train ...

accelerate's launcher (torchrun's environment: WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT) starts N copies of `dualvllm train`. `Ranks.from_environment()` reads that
environment; with one process it is None and nothing here runs. Otherwise:

    rank 0 (main)  servers, coordinator, sampler, verifiers, evaluations, weight pushes,
                   checkpoints, metrics; per update `send(Update(batch))`, then the update
    rank r > 0     the learner alone: `receive()` -> the update, until `Stop`

Every rank holds the whole model (cuda:LOCAL_RANK, or the CPU) and the same optimizer. An
update's whole-batch quantities (normalizers, advantages) are computed on every rank from
the same batch; each rank runs a contiguous share of the micro-batches (`shares`); the rows
that the whole batch's advantages and metrics read are gathered (`gather_rows`); the gradients
are summed over the ranks (`sum_gradients`) before the clip and the optimizer step, so every
rank takes the single-process step, up to float round-off, and the weights stay equal.

Two process groups, for two kinds of wait (each bounded by its own timeout):
- the step's collectives (gloo on the CPU, NCCL on GPUs): ranks that wait there for each
  other only the length of one rank's share of an update;
- the control group (gloo, CPU objects): followers wait there for rank 0's next message
  through its sampling, evaluations, pushes and server starts.
A rank that dies closes its connections, so the others' collectives fail at once (and
accelerate's launcher stops the rest); the timeouts bound what a live, stuck rank makes the
others wait.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from dualvllm.common.errors import InvalidInputError, RankStoppedError
from dualvllm.training.device import device_of, learner_device
from dualvllm.training.rollouts import ScoredBatch

log = logging.getLogger("dualvllm.training")

T = TypeVar("T")

# The step's collectives: a rank waits for the slowest rank's share of one update (its
# micro-batches' forward and backward). An hour covers a CPU learner at Qwen3-0.6B's shape
# (~35 s per micro-batch backward on 2 cores, benchmarks/denormals.py) with dozens per rank.
STEP_TIMEOUT_S = 3600.0
# Followers wait for rank 0's next update through the servers' start (minutes for large models),
# the first evaluation and the sampling of a batch; this bounds a rank 0 that is alive but stuck.
CONTROL_TIMEOUT_S = 2 * 3600.0


@dataclass(frozen=True)
class Update:
    """Rank 0 to every rank: take one update on `batch`."""

    batch: ScoredBatch


@dataclass(frozen=True)
class Stop:
    """Rank 0 to every rank: the run is over (`error` None) with rank 0's `result`, or rank 0 failed with `error`."""

    error: str | None = None
    result: object = None


Message = Update | Stop


@dataclass(frozen=True)
class Ranks:
    """Where this process stands among the learner's processes (torchrun's environment)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @property
    def main(self) -> bool:
        return self.rank == 0

    @staticmethod
    def from_environment(environ: dict[str, str] | None = None) -> Ranks | None:
        """This process's place from WORLD_SIZE, RANK, LOCAL_RANK, LOCAL_WORLD_SIZE; None with one process."""
        env = os.environ if environ is None else environ
        world_size = int(env.get("WORLD_SIZE", "1"))
        if world_size <= 1:
            return None
        try:
            rank, local_rank = int(env["RANK"]), int(env["LOCAL_RANK"])
        except KeyError as err:
            raise InvalidInputError(
                f"WORLD_SIZE={world_size} without {err.args[0]}: start several learner processes with "
                "`accelerate launch --num_processes N -m dualvllm train ...` (or torchrun), which sets both"
            ) from err
        return Ranks(rank, world_size, local_rank, int(env.get("LOCAL_WORLD_SIZE", str(world_size))))

    def device(self, spec: str | None) -> torch.device:
        """This rank's learner device: cuda:LOCAL_RANK when `--learner-device` is unset or cuda and a GPU
        is there, the CPU for cpu. A numbered GPU is refused: each rank's GPU is its local rank."""
        if spec is None and not torch.cuda.is_available():
            return torch.device("cpu")
        wanted = learner_device(spec)  # a GPU that is not there is refused, naming the flag
        if wanted.type != "cuda":
            return wanted
        refuse_numbered_gpu(spec, self.world_size)
        if self.local_rank >= torch.cuda.device_count():
            raise InvalidInputError(
                f"learner process {self.rank} has local rank {self.local_rank} and torch sees "
                f"{torch.cuda.device_count()} GPU(s): start at most that many processes per node"
            )
        return torch.device("cuda", self.local_rank)


def refuse_numbered_gpu(spec: str | None, world_size: int) -> None:
    """Several learner processes take a GPU each, cuda:LOCAL_RANK: a `--learner-device cuda:N` is refused."""
    if spec is not None and device_of(spec).type == "cuda" and device_of(spec).index is not None:
        raise InvalidInputError(
            f"--learner-device {spec} with {world_size} learner processes: each process trains on "
            "cuda:LOCAL_RANK (GPUs 0 to N-1 of CUDA_VISIBLE_DEVICES); give --learner-device cuda, or none"
        )


class DataParallel:
    """The process groups of one run's learner processes and the collectives an update needs.

    Opened once (`open`), closed once (`close`); every rank calls the collectives in the same
    order (the learner and the recipe keep them in lockstep).
    """

    def __init__(self, ranks: Ranks, device: torch.device) -> None:
        self.ranks = ranks
        self.device = device
        self._control: Any = None  # the gloo group of rank 0's messages
        self._updating = False  # rank 0: the others are inside an update's collectives

    def open(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group(
            "nccl" if self.device.type == "cuda" else "gloo",
            timeout=timedelta(seconds=STEP_TIMEOUT_S),
            rank=self.ranks.rank,
            world_size=self.ranks.world_size,
        )
        self._control = dist.new_group(backend="gloo", timeout=timedelta(seconds=CONTROL_TIMEOUT_S))
        log.info("learner process %d of %d on %s", self.ranks.rank, self.ranks.world_size, self.device)

    def close(self, error: str | None = None, result: object = None) -> None:
        """Rank 0: `Stop(error, result)` to the others (`error` None: the run is over), then every rank's
        groups closed.

        Rank 0 failing inside an update sends nothing: the others wait in that update's
        collectives, which fail when this process exits and its connections close.
        """
        try:
            if self.ranks.main and self._control is not None:
                if self._updating:
                    log.error("rank 0 failed inside an update; the other learner processes stop when it exits")
                else:
                    self.send(Stop(error, result))
        except (RuntimeError, OSError) as err:  # a follower already gone: nothing left to tell it
            log.warning("could not tell the other learner processes to stop: %s", err)
        finally:
            if dist.is_initialized() and not self._updating:
                dist.destroy_process_group()
            self._control = None

    def update(self, batch: ScoredBatch, step: Callable[[ScoredBatch], T]) -> T:
        """Rank 0: the others are told to take an update on `batch`, and this rank takes it (`step`)."""
        self.send(Update(batch))
        self._updating = True
        result = step(batch)
        self._updating = False
        return result

    def follow(self, step: Callable[[ScoredBatch], object]) -> object:
        """Ranks > 0: `step` on each batch rank 0 sends, until it stops; rank 0's result.

        Raises RankStoppedError when rank 0 stopped on an error.
        """
        while isinstance(message := self.receive(), Update):
            step(message.batch)
        if message.error is not None:
            raise RankStoppedError(
                f"learner process {self.ranks.rank} stops: rank 0 failed ({message.error}); see rank 0's log"
            )
        return message.result

    # Rank 0's messages.

    def send(self, message: Message) -> None:
        """Rank 0: `message` to every other rank (they wait in `receive`)."""
        assert self.ranks.main, "only rank 0 sends"
        dist.broadcast_object_list([message], src=0, group=self._control)

    def receive(self) -> Message:
        """Ranks > 0: rank 0's next message, within CONTROL_TIMEOUT_S."""
        assert not self.ranks.main, "rank 0 sends"
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self._control)
        message = box[0]
        assert isinstance(message, Update | Stop), f"rank 0 sent {type(message).__name__}"
        return message

    # An update's collectives.

    def shares(self, n: int) -> list[range]:
        """Each rank's contiguous block of `n` micro-batches, in rank order; earlier ranks take one more when
        uneven (a rank may get none: it still joins every collective)."""
        size, extra = divmod(n, self.ranks.world_size)
        starts = [r * size + min(r, extra) for r in range(self.ranks.world_size + 1)]
        return [range(a, b) for a, b in zip(starts, starts[1:])]

    def gather_rows(self, part: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """Each rank's rows [counts[r], ...] -> every rank's, in rank order [sum(counts), ...], on every rank.

        torch's all_gather takes equal shapes: each part is padded to the largest count, then trimmed.
        """
        assert part.shape[0] == counts[self.ranks.rank], (part.shape, counts, self.ranks.rank)
        most = max(counts)
        padded = part.new_zeros((most, *part.shape[1:]))
        padded[: part.shape[0]] = part
        gathered = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(gathered, padded)
        return torch.cat([g[:n] for g, n in zip(gathered, counts)])

    def sum_gradients(self, parameters: Sequence[torch.nn.Parameter]) -> None:
        """Every trainable parameter's .grad summed over the ranks, in place.

        A gradient that no rank made stays None, as in one process (AdamW skips it; a zero
        gradient would still move the weights through the moments and the weight decay).
        """
        made = torch.tensor([p.grad is not None for p in parameters], dtype=torch.uint8, device=self.device)
        dist.all_reduce(made, op=dist.ReduceOp.MAX)
        pending = []
        for p, anywhere in zip(parameters, made.tolist()):
            if not anywhere:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            pending.append(dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, async_op=True))
        for work in pending:
            work.wait()

    def broadcast_parameters(self, model: torch.nn.Module) -> None:
        """Rank 0's weights on every rank (they load the same checkpoint; this makes it so)."""
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)
