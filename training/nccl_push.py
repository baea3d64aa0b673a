"""NCCL pushes from `dualvllm train`: one group from the learner to every base replica, kept for the run.

    open (first push)  GET /get_world_size of each replica (TP x PP x DP) -> world = 1 + their sum
                       -> vLLM's `WeightTransferTrainerFactory.trainer_init(NCCLTrainerInitInfo(rank 0,
                       master address, a free port, world))`: POST /init_weight_transfer_engine to
                       every replica at once, each with its own rank_offset, while the learner
                       opens rank 0; all of them meet in one rendezvous
    each push          POST /pause?mode=keep (all) -> `engine.send_weights()`: start (all),
                       update_weights (all, while the learner broadcasts), finish (all)
                       -> POST /reset_prefix_cache?reset_running_requests=true (all) -> /resume (all);
                       BasePusher then checks each replica's logprobs (weight_transfer.verify_transfer)
    end of run         `engine.shutdown()` and POST /shutdown_weight_transfer_engine (all), bounded

The trainer side is vLLM's own (`NCCLTrainerWeightTransferEngine`): this module writes no NCCL.
It gives vLLM's engine a client (`ReplicaFanOut`) that sends each phase to every replica at
once (NCCL's init and broadcast return only when every rank has joined: one replica after
another would wait forever for the next) and turns the one worker payload vLLM's engine
builds (rank_offset 1) into one per replica: ranks 1..ws0 for the first, 1+ws0.. for the
second, and so on (dualvllm.engines.vllm_admin.replica_init_infos, shared with the service's
dev routes). The source is `LearnerSource`: the learner's tensors on its device, cast to the
servers' dtype as they are yielded, exactly as `metadata()` announces them.

The master address is 127.0.0.1 when every base server listens on loopback, else this
machine's address on the route to the first server; the port is a free one.

What fails, and what then:
    a phase refused, a timeout, a rank   WeightSyncError; the group is marked broken: vLLM's
    that never joins, a failed broadcast  engine leaves a group whose broadcast failed unusable
                                          (a peer still waits in the matching NCCL call), so no
                                          later push is tried on it: restart the run, or push
                                          through the disk (--weights-via disk)
    a replica restarted during the run    cannot join the group, which is fixed at its
                                          rendezvous: it stays out of the pool (BasePusher)

Every wait is bounded: each HTTP phase by PHASE_TIMEOUT_S, the learner's side of an open or a
send by its own timeout, run in a daemon thread of its own; a thread still stuck in NCCL
after its timeout is left behind (nothing can interrupt an NCCL call) and the error says so.

Lines only CUDA runs (vllm/distributed/weight_transfer/ in vllm 0.32; never run here), and what
the contract tests (tests/unit/training/test_nccl_push.py) prove in their place, with vLLM's own
code on the CPU:
  - the communicator: `nccl_common.stateless_init_process_group` (a TCPStore rendezvous and a
    `PyNcclCommunicator`) on both sides, its `broadcast` and `destroy`. The tests patch that one
    function with a broadcast among threads (every rank waits at a barrier for all the others,
    as NCCL's init does; receivers check dtype and size against the sender's), and run vLLM's
    real `nccl_common.trainer_init` and `worker_init_process_group` around it, with real
    `ParallelConfig`s (TP 2): two replicas of TP 2 take ranks 1,2 and 3,4 of a world of 5, at
    one master address and port, and a fan-out that sent one replica after the other would time
    out at that barrier.
  - CUDA devices and streams: `torch.accelerator.current_device_index` (both sides),
    `packed_tensor._get_streams` and `torch.cuda.stream` (the packed producer and consumer,
    double-buffered on two streams), `torch.cuda.current_stream` (the one-by-one broadcast,
    both sides), `NCCLTrainerWeightTransferEngine._post_send_sync` (a stream sync, skipped
    without CUDA), `torch.accelerator.synchronize` (the worker's `update_weights` wrapper) and
    `_use` below (`torch.cuda.set_device` in the thread that runs vLLM's engine). The tests
    stand in for the first four; the packed producer and consumer themselves run, with 8 kB
    buffers so that the model crosses in several chunks, and one by one too.
  - the worker's layerwise reload (`start_weight_update` / `finish_weight_update` on a vLLM
    model). The tests' workers run vLLM's real `parse_init_info`, `init_transfer_engine`,
    `parse_update_info` and `receive_weights`, into a model stand-in whose `load_weights`
    records what arrives: each worker of each replica gets exactly the learner's weights in
    the announced dtype (bf16 and float32), on two pushes over one rendezvous, and the source's
    metadata equals its iteration (vLLM's `_checked_iter` runs on every send).
  - memory: vLLM's packed defaults, two 1 GB buffers on the learner's GPU and on each worker's,
    and the learner's tensors cast to the wire dtype one at a time (one tensor's copy at most).
What the tests do not prove: NCCL itself across processes and machines (ports, interfaces,
NCCL_* environment), vLLM's reload on a real model, and timings.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit

import torch
from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine, WeightTransferUpdatePayload
from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

from dualvllm.common.errors import ServerError, WeightSyncError
from dualvllm.engines.vllm_admin import VLLMAdmin, replica_init_infos
from dualvllm.engines.vllm_client import VLLMClient
from dualvllm.training.learner_source import LearnerSource

log = logging.getLogger("dualvllm.training")

T = TypeVar("T")

# How long one phase may take on the replicas. Init waits for every rank to join the rendezvous
# (the servers' workers included), and update_weights carries the whole model in one call: 140 GB
# for a 70B model in bf16 crosses NVLink in seconds, but the servers then load it layer by layer.
PHASE_TIMEOUT_S = 600.0
# The learner's side of one open (one phase) and one send (start, update, finish), each phase
# bounded above; the margin only guards an NCCL call that a dead peer never meets.
OPEN_TIMEOUT_S = PHASE_TIMEOUT_S + 60.0
SEND_TIMEOUT_S = 3 * PHASE_TIMEOUT_S + 60.0
# Closing: the communicators are destroyed, which does no bulk work.
CLOSE_TIMEOUT_S = 30.0
# A thread that has answered is gone within this long.
JOIN_TIMEOUT_S = 5.0
# Errors of a phase, a rendezvous or a broadcast, as the learner's thread raises them: the
# client's (ServerError, WeightSyncError), vLLM's engine's (RuntimeError, ValueError for a source
# that disagrees with its metadata), the rendezvous's (OSError), and the timeouts.
TRANSFER_ERRORS = (ServerError, WeightSyncError, RuntimeError, ValueError, OSError, TimeoutError)


class ReplicaFanOut:
    """vLLM's `VLLMWeightSyncClient` over several base replicas, bridged to the event loop that
    owns their sessions: each phase goes to every replica at once and returns when all have
    answered (the first error raised). vLLM's trainer engine calls it from a thread of its own."""

    def __init__(
        self,
        servers: Sequence[VLLMAdmin],
        world_sizes: Sequence[int],
        loop: asyncio.AbstractEventLoop,
        *,
        timeout_s: float = PHASE_TIMEOUT_S,
    ) -> None:
        assert len(servers) == len(world_sizes), "one world size per replica"
        self._servers, self._world_sizes = list(servers), list(world_sizes)
        self._loop, self._timeout_s = loop, timeout_s
        self.weight_version: str | None = None  # what finish tags the update with (vLLM's engine passes none)

    def _each(self, calls: Sequence[Coroutine[Any, Any, Any]]) -> None:
        async def together() -> None:
            await asyncio.gather(*calls)

        # Each call is bounded by timeout_s; the margin only guards against a stuck loop.
        asyncio.run_coroutine_threadsafe(together(), self._loop).result(self._timeout_s + 30)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        infos = replica_init_infos(init_info, self._world_sizes)
        self._each(
            [s.init_weight_transfer_engine(info, timeout_s=self._timeout_s) for s, info in zip(self._servers, infos)]
        )

    def start_weight_update(self) -> None:
        self._each([s.start_weight_update(timeout_s=self._timeout_s) for s in self._servers])

    def update_weights(self, update_info: WeightTransferUpdatePayload) -> None:
        self._each([s.update_weights(update_info, timeout_s=self._timeout_s) for s in self._servers])

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        version = weight_version if weight_version is not None else self.weight_version
        self._each([s.finish_weight_update(version, timeout_s=self._timeout_s) for s in self._servers])


@dataclass
class NcclSend:
    """What one push moved, and where its time went."""

    bytes: int
    tensors: int
    seconds: dict[str, float] = field(default_factory=dict)  # pause, send (start, update, finish), reset


class NcclGroup:
    """The learner (rank 0) and every base replica's workers in one NCCL group, for the run.

    `open` once, `push` per push, `close` at the end; after a failed push the group is broken
    and `push` refuses (see the module's docstring)."""

    def __init__(
        self,
        engine: TrainerWeightTransferEngine[Any],
        fanout: ReplicaFanOut,
        clients: Sequence[VLLMClient],
        source: LearnerSource,
        device: torch.device,
    ) -> None:
        self._engine: TrainerWeightTransferEngine[Any] | None = engine
        self._fanout, self._clients, self._source, self._device = fanout, list(clients), source, device
        self._broken: BaseException | None = None

    def sends(self, model: Any) -> bool:
        """Whether this group's pushes send `model` (its source reads that very object)."""
        return self._source.reads(model)

    @property
    def urls(self) -> list[str]:
        """The base replicas in the group (fixed at its rendezvous)."""
        return [c.url for c in self._clients]

    @classmethod
    async def open(
        cls,
        clients: Sequence[VLLMClient],
        source: LearnerSource,
        device: torch.device,
        *,
        timeout_s: float = PHASE_TIMEOUT_S,
    ) -> NcclGroup:
        """The rendezvous of the learner's `device` with every worker of `clients`' servers."""
        where = ", ".join(c.url for c in clients)
        try:
            world_sizes = list(await asyncio.gather(*(c.admin.world_size() for c in clients)))
            address = master_address([c.url for c in clients])
            info = NCCLTrainerInitInfo(
                rank=0, master_address=address, master_port=free_port(address), world_size=1 + sum(world_sizes)
            )
            fanout = ReplicaFanOut(
                [c.admin for c in clients], world_sizes, asyncio.get_running_loop(), timeout_s=timeout_s
            )

            def rendezvous() -> TrainerWeightTransferEngine[Any]:
                _use(device)
                return WeightTransferTrainerFactory.trainer_init(info, client=fanout, source=source)

            started = time.perf_counter()
            engine = await in_thread(rendezvous, OPEN_TIMEOUT_S, "the NCCL rendezvous")
        except TRANSFER_ERRORS as err:
            raise WeightSyncError(
                f"the NCCL group from the learner on {device} to the base servers at {where} could not be opened: "
                f"{err}. Check that each server was started with --weight-transfer-config "
                '\'{"backend": "nccl"}\' and dev mode, that they can reach this machine, and their logs; or push '
                "through the disk (--weights-via disk)"
            ) from err
        log.info(
            "opened an NCCL group of %d ranks at %s:%d (the learner on %s, base world sizes %s) in %.1f s",
            info.world_size,
            info.master_address,
            info.master_port,
            device,
            world_sizes,
            time.perf_counter() - started,
        )
        return cls(engine, fanout, clients, source, device)

    async def push(self, weight_version: str | None = None) -> NcclSend:
        """Fence every replica (pause "keep"), send the source, drop their KV cache, resume them."""
        if self._broken is not None or self._engine is None:
            raise WeightSyncError(
                "the NCCL group to the base servers at "
                f"{', '.join(self.urls)} is "
                + ("closed" if self._broken is None else f"broken since an earlier push failed ({self._broken})")
                + ": vLLM's NCCL engine cannot send on a group whose broadcast failed. Restart the run, or push "
                "through the disk (--weights-via disk)"
            )
        engine, admins = self._engine, [c.admin for c in self._clients]
        meta = self._source.metadata()
        sent = NcclSend(bytes=sum(m.dtype.itemsize * _numel(m.shape) for m in meta), tensors=len(meta))
        started = time.perf_counter()
        paused = await asyncio.gather(*(a.pause(mode="keep") for a in admins), return_exceptions=True)
        fenced = [p is True for p in paused]
        if any(p is False for p in paused):
            log.warning("a base server has no /pause endpoint; pushing weights without fencing its requests")
        sent.seconds["pause"] = time.perf_counter() - started
        try:
            for admin, failed in zip(admins, paused):
                if isinstance(failed, BaseException):
                    raise WeightSyncError(
                        f"{admin.name} server at {admin.url} could not be paused for the NCCL push {weight_version} "
                        f"({failed}); nothing was sent"
                    ) from failed
            self._fanout.weight_version = weight_version
            begun = time.perf_counter()

            def send() -> None:
                _use(self._device)
                engine.send_weights()

            try:
                await in_thread(send, SEND_TIMEOUT_S, "the NCCL send")
            except TRANSFER_ERRORS as err:
                self._broken = err
                raise WeightSyncError(
                    f"the NCCL push {weight_version} to the base servers at {', '.join(self.urls)} failed: {err}. "
                    "The group cannot be used again (a peer may still wait in the broadcast), so this run pushes "
                    "no more: restart it (and any base server it did not start itself: its workers may still wait "
                    "in NCCL), or push through the disk (--weights-via disk)"
                ) from err
            sent.seconds["send"] = time.perf_counter() - begun
            begun = time.perf_counter()
            # Requests frozen by the pause hold KV the old weights computed: dropping it makes them
            # recompute their context with the new weights when they resume.
            resets = await asyncio.gather(
                *(a.reset_prefix_cache(reset_running_requests=True) for a in admins), return_exceptions=True
            )
            for admin, reset in zip(admins, resets):
                if isinstance(reset, BaseException):
                    raise WeightSyncError(
                        f"the NCCL push {weight_version} arrived, but {admin.name} server at {admin.url} could not "
                        f"drop its KV cache ({reset}): requests the pause froze would go on with KV the old weights "
                        "computed. The group can push again"
                    ) from reset
            sent.seconds["reset"] = time.perf_counter() - begun
        finally:
            await _resume(admins, fenced)
        return sent

    async def close(self) -> None:
        """Destroy the learner's communicator and the servers' sides; bounded, errors logged."""
        if self._engine is None:
            return
        engine, self._engine = self._engine, None

        def shutdown() -> None:
            _use(self._device)
            engine.shutdown()

        ends = [
            in_thread(shutdown, CLOSE_TIMEOUT_S, "closing the learner's NCCL communicator"),
            *(c.admin.shutdown_weight_transfer_engine(timeout_s=CLOSE_TIMEOUT_S) for c in self._clients),
        ]
        for end in await asyncio.gather(*ends, return_exceptions=True):
            if isinstance(end, BaseException):
                log.warning("closing the NCCL group to the base servers at %s: %s", ", ".join(self.urls), end)


async def _resume(admins: Sequence[VLLMAdmin], fenced: Sequence[bool]) -> None:
    """/resume every fenced replica, after a push that worked or failed: a server that died cannot
    take it, and the push's own error (if any) already says what happened."""
    for admin, result in zip(
        admins, await asyncio.gather(*(a.resume() for a, f in zip(admins, fenced) if f), return_exceptions=True)
    ):
        if isinstance(result, BaseException):
            log.warning("%s server at %s could not be resumed after a push: %s", admin.name, admin.url, result)


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _use(device: torch.device) -> None:
    """Make `device` current in this thread: vLLM's engine opens its communicator and streams on
    the current CUDA device (torch.accelerator.current_device_index), which is per thread."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


async def in_thread(work: Callable[[], T], timeout_s: float, what: str) -> T:
    """`work()` in a daemon thread of its own -> its result, within `timeout_s`.

    Not the loop's executor: an NCCL call that a dead peer never meets cannot be interrupted,
    and an executor's thread stuck in it would hang the interpreter's exit (it joins them all).
    """
    future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(work())
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task, which raises it
            future.set_exception(exc)

    thread = threading.Thread(target=run, name=f"dualvllm {what}", daemon=True)
    thread.start()
    try:
        result = await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
    except TimeoutError:
        raise TimeoutError(
            f"{what} took over {timeout_s:.0f} s (a rank that never joined, or a broadcast a dead peer never met); "
            "its thread is left behind, stuck in NCCL"
        ) from None
    thread.join(JOIN_TIMEOUT_S)  # it has handed its result over: it is at its last line
    return result


def master_address(urls: Sequence[str]) -> str:
    """Where the learner's rank 0 listens for the rendezvous: 127.0.0.1 when every server is on
    loopback, else this machine's address on the route to the first server."""
    hosts = [urlsplit(url).hostname or "" for url in urls]
    if all(_loopback(host) for host in hosts):
        return "127.0.0.1"
    first = urlsplit(urls[0])
    family = socket.AF_INET6 if ":" in (first.hostname or "") else socket.AF_INET
    with contextlib.closing(socket.socket(family, socket.SOCK_DGRAM)) as probe:
        probe.connect((first.hostname, first.port or 80))  # a UDP connect sends nothing: it picks the route
        return str(probe.getsockname()[0])


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: resolved by the servers' side, not assumed local
        return False


def free_port(address: str) -> int:
    """A port free at `address` now (the rendezvous binds it a moment later)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with contextlib.closing(socket.socket(family, socket.SOCK_STREAM)) as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])
