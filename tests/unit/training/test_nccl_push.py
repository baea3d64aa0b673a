"""Contract tests of the NCCL push (dualvllm.training.nccl_push) against vLLM's own code, on the CPU.

vLLM's CUDA build cannot run here, so what we send is fed to vLLM's own code: its parsers
(`parse_init_info`, `parse_update_info`), its worker-side rank arithmetic
(`worker_init_process_group` over a real `ParallelConfig`), its trainer engine
(`NCCLTrainerWeightTransferEngine.trainer_init` + `send_weights`), its worker's
`receive_weights`, and its packed producer and consumer. Only the communicator and the CUDA
stream calls are stand-ins:

- `nccl_common.stateless_init_process_group` (both sides' rendezvous: a TCPStore and a
  `PyNcclCommunicator`) -> `Rendezvous.join`: every rank waits at a barrier for all the
  others (as NCCL's init does, so calls sent one replica after another would time out), and
  its communicator broadcasts among threads, checking that sender and receivers agree on
  dtype and size as NCCL needs;
- `torch.accelerator.current_device_index` (both sides), `packed_tensor._get_streams` and
  `torch.cuda.stream` (the packed producer and consumer), `torch.cuda.current_stream` (the
  unpacked broadcast on both sides).

A replica here is one server's worth of vLLM worker engines (TP 2: two workers, ranks 0 and 1
of its ParallelConfig), each built without a GPU (`object.__new__` plus the attributes vLLM's
methods read) and receiving into a model stand-in whose `load_weights` records what arrived.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import queue
import threading
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("vllm")

from vllm.config import ParallelConfig  # noqa: E402
from vllm.distributed.weight_transfer import WeightTransferTrainerFactory, packed_tensor  # noqa: E402
from vllm.distributed.weight_transfer import nccl_common  # noqa: E402
from vllm.distributed.weight_transfer.nccl_engine import (  # noqa: E402
    NCCLTrainerInitInfo,
    NCCLWeightTransferEngine,
    NCCLWeightTransferUpdateInfo,
)

from dualvllm.common.errors import ServerRejectedError, WeightSyncError  # noqa: E402
from dualvllm.engines.vllm_admin import replica_init_infos  # noqa: E402
from dualvllm.engines.vllm_client import VLLMClient  # noqa: E402
from dualvllm.training import lora, nccl_push  # noqa: E402
from dualvllm.training.learner_source import LearnerSource  # noqa: E402
from dualvllm.training.weight_sync import BasePusher  # noqa: E402
from tests.fake_vllm import Failure, FakeModel, rendezvous, running_fakes  # noqa: E402

WAIT_S = 20.0  # far beyond what any step here takes: only a rank that never comes waits this long


def small_model() -> Any:
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                      max_position_embeddings=32, tie_word_embeddings=False)
    return transformers.Qwen3ForCausalLM(config)


# -- the stand-ins for NCCL and CUDA ---------------------------------------------------------------

class Rendezvous:
    """What `stateless_init_process_group` does, among threads: every rank of one (address, port)
    waits until all `world_size` have joined, then gets a communicator of the group."""

    def __init__(self) -> None:
        self.joined: list[tuple[str, int, int, int]] = []  # (address, port, rank, world size), in arrival order
        self.destroyed: list[int] = []
        self._lock = threading.Lock()
        self._groups: dict[tuple[str, int], Group] = {}

    def join(self, master_address: str, master_port: int, rank: int, world_size: int, device: Any) -> Communicator:
        with self._lock:
            self.joined.append((master_address, master_port, rank, world_size))
            group = self._groups.setdefault((master_address, master_port), Group(world_size))
        assert group.world_size == world_size, f"rank {rank} says world {world_size}, the group {group.world_size}"
        group.barrier.wait(WAIT_S)  # like NCCL's init: nobody returns before every rank has come
        return Communicator(self, group, rank)


class Group:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size)
        self.inboxes = {rank: queue.Queue() for rank in range(1, world_size)}


class Communicator:
    """PyNcclCommunicator's broadcast and destroy: the sender's bytes reach every other rank."""

    def __init__(self, rendezvous: Rendezvous, group: Group, rank: int) -> None:
        self._rendezvous, self._group, self.rank = rendezvous, group, rank

    def broadcast(self, tensor: Any, src: int, stream: Any = None) -> None:
        assert src == 0
        if self.rank == 0:
            for inbox in self._group.inboxes.values():
                inbox.put(tensor.detach().clone())
            return
        sent = self._group.inboxes[self.rank].get(timeout=WAIT_S)
        # NCCL moves count x dtype bytes and checks neither: a mismatch is garbage or a hang there.
        assert (sent.dtype, sent.numel()) == (tensor.dtype, tensor.numel()), (sent.dtype, sent.numel(), tensor.dtype,
                                                                             tensor.numel())
        tensor.copy_(sent.view(tensor.shape))

    def destroy(self) -> None:
        self._rendezvous.destroyed.append(self.rank)


class Stream:
    def synchronize(self) -> None:
        pass


@pytest.fixture
def nccl(monkeypatch) -> Rendezvous:
    """vLLM's NCCL weight transfer with its CUDA-only calls stood in for (the lines listed above)."""
    rendezvous = Rendezvous()
    monkeypatch.setattr(nccl_common, "stateless_init_process_group", rendezvous.join)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(packed_tensor, "_get_streams", lambda device, n: tuple(Stream() for _ in range(n)))
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: Stream())
    return rendezvous


# -- a base replica: vLLM's worker engines behind one server's admin routes -------------------------

class Received:
    """The model stand-in: what `load_weights` got, by name (copies: packed views are reused)."""

    def __init__(self) -> None:
        self.weights: dict[str, Any] = {}

    def load_weights(self, weights: Any) -> None:
        for name, tensor in weights:
            self.weights[name] = tensor.clone()


class Replica:
    """One vLLM server of `tp` workers, as ReplicaFanOut and NcclGroup drive its admin: each
    worker is vLLM's NCCLWeightTransferEngine, in a thread of its own per phase (the workers of
    one server enter NCCL together)."""

    def __init__(self, url: str, tp: int = 2) -> None:
        self.url, self.name = url, f"replica {url}"
        self.admin = self  # what NcclGroup reads of a VLLMClient: its admin and its url
        self.models = [Received() for _ in range(tp)]
        self.workers = [self._worker(ParallelConfig(tensor_parallel_size=tp), rank, model)
                        for rank, model in enumerate(self.models)]
        self.calls: list[tuple[str, Any]] = []
        self.fail: str | None = None  # a phase this server refuses

    @staticmethod
    def _worker(config: ParallelConfig, rank: int, model: Received) -> NCCLWeightTransferEngine:
        engine = object.__new__(NCCLWeightTransferEngine)  # its __init__ wants a whole VllmConfig and a GPU
        engine.parallel_config = dataclasses.replace(config, rank=rank)
        engine.model, engine.device, engine.model_update_group = model, torch.device("cpu"), None
        return engine

    def _check(self, phase: str, payload: Any = None) -> None:
        self.calls.append((phase, payload))
        if self.fail == phase:
            raise ServerRejectedError(self.name, self.url, 500, f"{phase} refused")

    async def _on_workers(self, work) -> None:
        await asyncio.gather(*(asyncio.to_thread(work, worker) for worker in self.workers))

    async def world_size(self, include_dp: bool = True) -> int:
        return len(self.workers)

    async def init_weight_transfer_engine(self, init_info: dict, *, timeout_s: float) -> None:
        self._check("init", init_info)
        await self._on_workers(lambda w: w.init_transfer_engine(w.parse_init_info(init_info)))

    async def start_weight_update(self, *, timeout_s: float) -> None:
        self._check("start")  # the worker's layerwise reload needs a vLLM model: not run here

    async def update_weights(self, update_info: dict, *, timeout_s: float) -> None:
        self._check("update", update_info)
        await self._on_workers(lambda w: w.receive_weights(w.parse_update_info(update_info)))

    async def finish_weight_update(self, weight_version: str | None = None, *, timeout_s: float) -> None:
        self._check("finish", weight_version)

    async def shutdown_weight_transfer_engine(self, *, timeout_s: float) -> None:
        self._check("shutdown")
        for worker in self.workers:
            worker.shutdown()

    async def pause(self, mode: str = "wait") -> bool:
        self._check("pause", mode)
        return True

    async def resume(self) -> None:
        self._check("resume")

    async def reset_prefix_cache(self, *, reset_running_requests: bool = False) -> None:
        self._check("reset", reset_running_requests)

    def phases(self) -> list[str]:
        return [phase for phase, _ in self.calls]


def expected_weights(model: Any, dtype: Any) -> dict[str, Any]:
    return {name: tensor.to(dtype) for name, tensor in LearnerSource(model, dtype)}


def assert_received(replicas: list[Replica], model: Any, dtype: Any) -> None:
    expected = expected_weights(model, dtype)
    for replica in replicas:
        for worker, received in enumerate(replica.models):
            assert received.weights.keys() == expected.keys(), (replica.url, worker)
            for name, tensor in expected.items():
                got = received.weights[name]
                assert got.dtype == dtype and torch.equal(got, tensor), (replica.url, worker, name)


def step(model: Any) -> None:
    """A learner step: every weight moves."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 1e-2)


# -- payloads, parsed by vLLM -------------------------------------------------------------------------

def test_each_replicas_init_payload_is_what_vllms_worker_parses_with_its_own_rank_offset():
    payload = nccl_common.worker_init_payload(nccl_common.NCCLWeightTransferInitInfo(
        master_address="127.0.0.1", master_port=29500, rank_offset=1, world_size=5, packed=True))
    engine = object.__new__(NCCLWeightTransferEngine)
    infos = [engine.parse_init_info(info) for info in replica_init_infos(payload, [2, 2])]
    assert [(i.rank_offset, i.world_size, i.master_address, i.master_port, i.packed) for i in infos] == [
        (1, 5, "127.0.0.1", 29500, True), (3, 5, "127.0.0.1", 29500, True)]


def test_the_update_payload_of_a_bf16_source_is_what_vllms_worker_parses():
    model = small_model()
    meta = LearnerSource(model, torch.bfloat16).metadata()
    engine = object.__new__(NCCLWeightTransferEngine)
    info = engine.parse_update_info(dataclasses.asdict(NCCLWeightTransferUpdateInfo(
        names=[m.name for m in meta], dtype_names=[str(m.dtype).split(".")[-1] for m in meta],
        shapes=[list(m.shape) for m in meta])))
    assert set(info.dtype_names) == {"bfloat16"} and len(info.names) == len(dict(model.state_dict()))
    assert [getattr(torch, d) for d in info.dtype_names] == [torch.bfloat16] * len(meta)


def test_two_replicas_of_tp_2_take_ranks_1_2_and_3_4_of_a_world_of_5(nccl):
    """vLLM's own worker_init_process_group, on real ParallelConfigs, with the payloads we send."""
    payload = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 5}
    replicas = [[dataclasses.replace(ParallelConfig(tensor_parallel_size=2), rank=r) for r in (0, 1)]
                for _ in range(2)]
    threads = [threading.Thread(target=nccl_common.worker_init_process_group,
                                args=(NCCLWeightTransferEngine.init_info_cls(**info), config))
               for info, configs in zip(replica_init_infos(payload, [2, 2]), replicas) for config in configs]
    threads.append(threading.Thread(target=nccl_common.trainer_init, args=(payload,)))  # the learner, rank 0
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
    assert sorted(nccl.joined) == [("127.0.0.1", 29500, rank, 5) for rank in range(5)]


def test_a_world_too_small_for_the_replicas_is_refused_before_anything_is_sent():
    with pytest.raises(WeightSyncError, match="cannot hold the base replicas' workers: ranks 1 to 4"):
        replica_init_infos({"rank_offset": 1, "world_size": 3, "master_address": "x", "master_port": 1}, [2, 2])
    shm = {"segment": "s", "token": "t"}  # not a group: every replica gets it as it is
    assert replica_init_infos(shm, [1, 1]) == [shm, shm]


# -- the whole sequence, through vLLM's trainer engine --------------------------------------------

@pytest.mark.parametrize("packed", [True, False], ids=["packed", "one-by-one"])
async def test_one_rendezvous_serves_two_pushes_to_every_worker_of_two_replicas(nccl, packed):
    model, dtype = small_model(), torch.bfloat16
    replicas = [Replica("http://127.0.0.1:1"), Replica("http://127.0.0.1:2")]
    fanout = nccl_push.ReplicaFanOut(replicas, [2, 2], asyncio.get_running_loop(), timeout_s=WAIT_S)
    # Buffers of 8 kB: the model (about 50 kB in bf16) crosses in several packed chunks.
    info = NCCLTrainerInitInfo(rank=0, master_address="127.0.0.1", master_port=29501, world_size=5, packed=packed,
                               packed_buffer_size_bytes=8192)
    source = LearnerSource(model, dtype)
    engine = await asyncio.to_thread(WeightTransferTrainerFactory.trainer_init, info, client=fanout, source=source)
    assert sorted(rank for *_, rank, _ in nccl.joined) == [0, 1, 2, 3, 4]
    assert [r.calls[0][1]["rank_offset"] for r in replicas] == [1, 3]
    for version in ("step-1", "step-2"):
        step(model)
        fanout.weight_version = version
        await asyncio.to_thread(engine.send_weights)
        assert_received(replicas, model, dtype)
    assert len(nccl.joined) == 5  # one rendezvous for both pushes
    for replica in replicas:
        assert replica.phases() == ["init", "start", "update", "finish", "start", "update", "finish"]
        assert [p for name, p in replica.calls if name == "finish"] == ["step-1", "step-2"]
    engine.shutdown()
    assert nccl.destroyed == [0]


async def test_the_group_fences_each_push_and_closes_both_sides(nccl):
    model = small_model()
    replicas = [Replica("http://127.0.0.1:1"), Replica("http://localhost:2")]
    group = await nccl_push.NcclGroup.open(replicas, LearnerSource(model, torch.float32), torch.device("cpu"))
    assert {address for address, *_ in nccl.joined} == {"127.0.0.1"}  # every server on loopback
    for version in ("step-1", "step-2"):
        step(model)
        sent = await group.push(version)
        assert_received(replicas, model, torch.float32)
    assert sent.bytes == sum(p.numel() * 4 for p in model.state_dict().values())
    await group.close()
    for replica in replicas:
        assert replica.phases() == ["init"] + ["pause", "start", "update", "finish", "reset", "resume"] * 2 + [
            "shutdown"]
        assert ("pause", "keep") in replica.calls and ("reset", True) in replica.calls
    assert sorted(nccl.destroyed) == [0, 1, 2, 3, 4]  # the learner's communicator and every worker's
    with pytest.raises(WeightSyncError, match="closed"):
        await group.push("step-3")


async def test_a_failed_push_breaks_the_group_and_no_push_is_tried_on_it_again(nccl):
    model = small_model()
    replicas = [Replica("http://127.0.0.1:1"), Replica("http://127.0.0.1:2")]
    group = await nccl_push.NcclGroup.open(replicas, LearnerSource(model, torch.float32), torch.device("cpu"))
    replicas[1].fail = "update"
    with pytest.raises(WeightSyncError, match="cannot be used again") as failed:
        await group.push("step-1")
    assert "update refused" in str(failed.value)
    assert [r.phases()[-1] for r in replicas] == ["resume", "resume"]  # both serve again
    calls = len(replicas[0].calls)
    with pytest.raises(WeightSyncError, match="broken since an earlier push failed"):
        await group.push("step-2")
    assert len(replicas[0].calls) == calls  # nothing sent
    await group.close()


async def test_a_kv_cache_that_cannot_be_dropped_fails_the_push_but_not_the_group(nccl):
    model = small_model()
    replicas = [Replica("http://127.0.0.1:1"), Replica("http://127.0.0.1:2")]
    group = await nccl_push.NcclGroup.open(replicas, LearnerSource(model, torch.float32), torch.device("cpu"))
    replicas[0].fail = "reset"
    with pytest.raises(WeightSyncError, match="could not drop its KV cache .*The group can push again"):
        await group.push("step-1")
    assert [r.phases()[-1] for r in replicas] == ["resume", "resume"]
    replicas[0].fail = None
    step(model)
    await group.push("step-2")
    assert_received(replicas, model, torch.float32)
    await group.close()


def test_the_master_address_is_loopback_when_every_server_is():
    assert nccl_push.master_address(["http://127.0.0.1:8000", "http://localhost:8001", "http://[::1]:8002"]) \
        == "127.0.0.1"
    port = nccl_push.free_port("127.0.0.1")
    assert 0 < port < 65536


# -- the source: what is announced is what is iterated ---------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("adapted", [False, True], ids=["full", "lora"])
def test_the_metadata_is_what_iteration_yields_name_dtype_and_shape(dtype, adapted):
    model = small_model()
    if adapted:
        model = lora.wrap(model, rank=2, alpha=4)
    source = LearnerSource(model, dtype, only=lora.adapted_names(model) if adapted else None)
    announced = [(m.name, m.dtype, tuple(m.shape)) for m in source.metadata()]
    iterated = [(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in source]
    assert announced == iterated and announced
    assert {d for _, d, _ in iterated} == {dtype}


# -- over HTTP, against fake vLLM servers ------------------------------------------------------------

async def test_the_fan_out_gives_each_server_its_offset_and_sends_every_phase_to_all_at_once():
    """Real VLLMClients over loopback HTTP: each phase reaches both servers only if the two
    requests are in flight together (a rendezvous), as NCCL's init and update need."""
    async with running_fakes(FakeModel(seed=1), FakeModel(seed=3)) as (a, b):
        a.world_size, b.world_size = 2, 3
        for path in ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
                     "/finish_weight_update"):
            first, second = rendezvous(Failure(0), Failure(0))
            a.fail_next(path, first)
            b.fail_next(path, second)
        async with VLLMClient(a.url, name="a") as ca, VLLMClient(b.url, name="b") as cb:
            sizes = [await ca.admin.world_size(), await cb.admin.world_size()]
            fanout = nccl_push.ReplicaFanOut([ca.admin, cb.admin], sizes, asyncio.get_running_loop(), timeout_s=WAIT_S)
            fanout.weight_version = "step-3"
            payload = {"master_address": "127.0.0.1", "master_port": 29502, "rank_offset": 1, "world_size": 6}

            def phases() -> None:
                fanout.init_weight_transfer_engine(payload)
                fanout.start_weight_update()
                fanout.update_weights({"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[2]]})
                fanout.finish_weight_update()

            await asyncio.to_thread(phases)
        assert [s.calls["/init_weight_transfer_engine"][0]["init_info"]["rank_offset"] for s in (a, b)] == [1, 3]
        assert all(s.calls["/finish_weight_update"] == [{"weight_version": "step-3"}] for s in (a, b))
        assert all(s.calls["/update_weights"][0]["update_info"]["names"] == ["w"] for s in (a, b))


@pytest.mark.parametrize("device, via, pushes_in_memory", [
    ("cpu", "auto", False), ("cuda:0", "auto", True), ("cuda:0", "disk", False)])
async def test_nccl_is_chosen_only_for_a_learner_on_cuda(fake_theta, device, via, pushes_in_memory):
    fake_theta.weight_transfer_backend = "nccl"
    async with VLLMClient(fake_theta.url, name="theta") as client:
        assert await BasePusher(client, [[1, 2]], via=via).in_memory(torch.device(device)) is pushes_in_memory


async def test_weights_via_memory_with_an_nccl_server_and_a_cpu_learner_says_why(fake_theta):
    fake_theta.weight_transfer_backend = "nccl"
    async with VLLMClient(fake_theta.url, name="theta") as client:
        with pytest.raises(WeightSyncError, match="'nccl' engine takes tensors from CUDA; the learner is on cpu"):
            await BasePusher(client, [[1, 2]], via="memory").in_memory(torch.device("cpu"))


class RecordingGroup:
    """NcclGroup's surface as BasePusher uses it, recording instead of sending."""

    opened: list[RecordingGroup] = []

    def __init__(self, clients: list, source: LearnerSource) -> None:
        self.urls, self.source = [c.url for c in clients], source
        self.pushes: list[str | None] = []
        self.closed = False

    @classmethod
    async def open(cls, clients: list, source: LearnerSource, device: Any) -> RecordingGroup:
        cls.opened.append(cls(clients, source))
        return cls.opened[-1]

    def sends(self, model: Any) -> bool:
        return self.source.reads(model)

    async def push(self, weight_version: str | None = None) -> nccl_push.NcclSend:
        self.pushes.append(weight_version)
        return nccl_push.NcclSend(bytes=1234, tensors=5, seconds={"pause": 0.0, "send": 0.0, "reset": 0.0})

    async def close(self) -> None:
        self.closed = True


async def test_the_pusher_opens_one_group_for_its_pushes_verifies_each_and_closes_it(fake_theta, tmp_path,
                                                                                     monkeypatch):
    """BasePusher's NCCL route over HTTP: the group is opened once, each push verified on the
    server's logprobs (the fake serves FakeModel(seed=1), which is what the learner 'is' here)."""
    from dualvllm.training import weight_sync, weight_transfer

    probes = [[1, 2, 3], [4, 5]]
    served = np.stack([FakeModel(seed=1).logprobs(p) for p in probes])
    fake_theta.weight_transfer_backend = "nccl"
    monkeypatch.setattr(weight_sync, "_on_cuda", lambda device: True)  # the learner 'is' on CUDA
    monkeypatch.setattr(weight_transfer, "expected_logprobs", lambda model, probes, dtype: served)
    monkeypatch.setattr(nccl_push, "NcclGroup", RecordingGroup)
    RecordingGroup.opened = []
    learner, other = small_model(), small_model()
    async with VLLMClient(fake_theta.url, name="theta") as client:
        pusher = BasePusher(client, probes)
        reports = [await pusher.push(learner, None, tmp_path / f"step-{n}") for n in (1, 2)]
        assert [(r.via, r.bytes_moved, r.replicas, r.path) for r in reports] == [("nccl", 1234, 1, None)] * 2
        assert len(RecordingGroup.opened) == 1 and RecordingGroup.opened[0].pushes == ["step-1", "step-2"]
        assert RecordingGroup.opened[0].urls == [fake_theta.url]
        await pusher.push(other, None, tmp_path / "step-3")  # another model: a group of its own
        assert RecordingGroup.opened[0].closed and len(RecordingGroup.opened) == 2
        await pusher.close()
    assert RecordingGroup.opened[1].closed
    assert not (tmp_path / "step-1").exists()  # nothing written to disk
    assert len(fake_theta.calls["/v1/completions"]) >= 3  # each push verified on the server's answers


def test_the_source_yields_every_tensor_on_the_learners_own_device():
    """On the `meta` device, as on CUDA: the cast to the wire dtype happens where the tensor is."""
    with torch.device("meta"):
        model = small_model()
    assert {(t.device.type, t.dtype) for _, t in LearnerSource(model, torch.bfloat16)} == {("meta", torch.bfloat16)}
